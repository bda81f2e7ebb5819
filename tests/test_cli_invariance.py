"""The CLI's batch job gives each prompt the same tokens whatever it is batched with, however the job was cut
into blocks, and after a SIGKILL and a resume, which re-buckets the pending prompts into other blocks (the
per-sequence budgets of kv/budget.py make that hold under ratio budgets). The engine-level check with its
near-tie rule is tests/test_batch_invariance.py; here the tokens must be equal outright (they were in every
engine-level case)."""
from __future__ import annotations

import json
import signal

import pytest

from tests.test_cli import tiny  # noqa: F401  (the converted tiny checkpoint and its CLI environment)
from tests.tiny_checkpoint import kill_once_written, run_cli

ROWS = [{"prompt": "Item %d: " % i + "abcdefghij" * (1 + (i * 7) % 6) + "?", "id": f"q{i}"} for i in range(12)]


def tokens_by_id(path) -> dict:
    return {r["id"]: r["token_ids"] for r in map(json.loads, path.read_text().splitlines())}


def killed_then_resumed(args: list[str], out, env, log) -> None:
    """Start the job, SIGKILL it once a block is on disk, then rerun the same command to finish it."""
    assert kill_once_written(args, out, env, log, lines=3) == -signal.SIGKILL, log.read_text()[-2000:]
    done = out.read_text().count("\n")
    assert 3 <= done < len(ROWS), done                                      # killed mid-way
    rerun = run_cli(args, env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming {out}: {done} of {len(ROWS)} ids already done" in rerun.stdout


# the h2o-avg variant's invariance is tests/test_batch_invariance.py's (engine level): one CLI run of 23 s less
@pytest.mark.parametrize("kv", [["--hh-ratio", "0.2"], ["--policy", "random", "--hh-ratio", "0.2"]],
                         ids=["h2o", "random"])
def test_alone_batched_and_resumed_give_the_same_tokens(tiny, tmp_path, kv):
    ckpt, env = tiny
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    common = ["--model", str(ckpt), "--input", str(inp), "--gen-len", "40", "--no-progress", *kv]
    alone, batched, resumed = (tmp_path / f"{name}.jsonl" for name in ("alone", "batched", "resumed"))
    proc = run_cli(common + ["--output", str(alone), "--gpu-batch-size", "1"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the budgets really differ per prompt (the startup line gives their range)
    assert "slots/seq" in proc.stdout and "each prompt's own length" in proc.stdout, proc.stdout
    proc = run_cli(common + ["--output", str(batched), "--gpu-batch-size", "4", "--num-gpu-batches", "2"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    killed_then_resumed([*common, "--output", str(resumed), "--gpu-batch-size", "3"], resumed, env, tmp_path / "log")
    want = tokens_by_id(alone)
    assert len(want) == len(ROWS) and sum(map(len, want.values())) > 20 * len(ROWS)   # real generations
    assert tokens_by_id(batched) == want
    assert tokens_by_id(resumed) == want
