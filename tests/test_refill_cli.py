"""The CLI's batch mode refills by default: its output grows in input order (a finished answer waits for every
earlier id), and a job SIGKILLed at several points and resumed each time ends with every id once and the tokens
each prompt gets alone (--no-refill, one prompt per block)."""
from __future__ import annotations

import json
import random
import signal

from tests.tiny_checkpoint import ROWS, kill_at_line, run_main, tokens_by_id

# answers of different lengths, so rows free up at different steps
LINES = [dict(r, max_new_tokens=4 + (i * 11) % 37) for i, r in enumerate(ROWS)]
IDS = [r["id"] for r in LINES]


def test_killed_refilled_job_resumes_in_order_without_loss_or_duplicates(tiny, tmp_path):
    ckpt, env = tiny
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in LINES))
    common = ["--model", str(ckpt), "--input", str(inp), "--gen-len", "40", "--no-progress", "--hh-ratio", "0.2"]
    alone, out = tmp_path / "alone.jsonl", tmp_path / "out.jsonl"
    proc = run_main(common + ["--output", str(alone), "--gpu-batch-size", "1", "--no-refill"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    args = [*common, "--output", str(out), "--gpu-batch-size", "3", "--num-gpu-batches", "2"]
    done, kills = 0, 0
    rng = random.Random(35)
    while done < len(LINES) - 3:            # kill points in output lines, each before or after its append
        target = done + rng.randint(1, 3)
        status = kill_at_line(args, env, tmp_path / "log", target, before=rng.random() < 0.5)    # a subprocess
        assert status == -signal.SIGKILL, (tmp_path / "log").read_text()[-2000:]
        kills += 1
        written = [json.loads(line)["id"] for line in out.read_text().splitlines()] if out.exists() else []
        assert written == IDS[:len(written)], written     # a prefix of the input: nothing out of order or twice
        assert not list(tmp_path.glob(".out.jsonl.*.tmp"))
        done = len(written)
    assert kills >= 3
    rerun = run_main(args, env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert ("join passes" in rerun.stdout) == (done < len(LINES)), rerun.stdout
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == IDS
    want = tokens_by_id(alone)
    assert sum(map(len, want.values())) > 10 * len(LINES)       # real generations
    assert tokens_by_id(out) == want


def test_refill_flags_are_checked(tiny, tmp_path):
    ckpt, env = tiny
    proc = run_main(["--model", str(ckpt), "--gen-len", "4", "--no-refill"], env)
    assert proc.returncode == 2 and proc.stderr.startswith("error: benchmark mode runs FlexGen's synchronous"), \
        proc.stderr
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(LINES[0]) + "\n")
    proc = run_main(["--model", str(ckpt), "--input", str(inp), "--output", str(tmp_path / "o.jsonl"),
                     "--no-refill", "--refill-share", "0.5"], env)
    assert proc.returncode == 2 and "--refill-share sets when a refill happens" in proc.stderr, proc.stderr
    proc = run_main(["--model", str(ckpt), "--input", str(inp), "--output", str(tmp_path / "o.jsonl"),
                     "--refill-share", "2"], env)
    assert proc.returncode == 2 and "is not in [0, 1]" in proc.stderr, proc.stderr
