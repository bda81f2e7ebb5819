"""The batch job `make run` answers (examples/questions.jsonl) is a valid input, and its printer's usage error."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from flexgen_h2o.frontends.requests import read_requests

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_shipped_batch_job_parses_as_chats():
    requests = read_requests(EXAMPLES / "questions.jsonl", 64)
    assert len(requests) >= 6 and len({r.key for r in requests}) == len(requests)
    assert all(r.messages is not None and r.max_new_tokens == 64 for r in requests)


def test_the_answer_printer_refuses_a_wrong_call_in_one_line():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "print_answers.py")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: usage:") and proc.stderr.count("\n") == 1
