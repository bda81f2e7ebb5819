"""The CLI's batch job gives each prompt the same tokens whatever it is batched with, however the job was cut
into blocks, and after a SIGKILL and a resume, which re-buckets the pending prompts into other blocks (the
per-sequence budgets of kv/budget.py make that hold under ratio budgets). The engine-level check with its
near-tie rule is tests/test_batch_invariance.py; here the tokens must be equal outright, for int4
KV and weights too, with the KV on disk or split over RAM and disk (the compiled kernels make every prompt's
arithmetic bit for bit the same in any batch: docs/cli.md, "What is guaranteed")."""
from __future__ import annotations

import json
import signal

import pytest

from tests.tiny_checkpoint import ROWS, kill_once_written, run_main, tokens_by_id


def killed_then_resumed(args: list[str], out, env, log) -> None:
    """Start the job in a subprocess, SIGKILL it once a block is on disk, then rerun the same command (in this
    process) to finish it."""
    assert kill_once_written(args, out, env, log, lines=3) == -signal.SIGKILL, log.read_text()[-2000:]
    done = out.read_text().count("\n")
    assert 3 <= done < len(ROWS), done                                      # killed mid-way
    rerun = run_main(args, env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming {out}: {done} of {len(ROWS)} ids already done" in rerun.stdout


# the h2o-avg variant's invariance is tests/test_batch_invariance.py's (engine level), not a CLI run more here.
# name -> (flags of every run, flags of the batched run, flags of the resumed run): int4 KV and weights with the KV
# on disk in one run and split over RAM and disk in the other (fp32 rounding of K and V once turned into whole
# int4 steps there, issue 50)
CASES = {
    "h2o": (["--hh-ratio", "0.2"], [], []),
    "random": (["--policy", "random", "--hh-ratio", "0.2"], [], []),
    "int4-kv-and-weights": (["--hh-ratio", "0.2", "--compress-cache", "--compress-weight"],
                            ["--percent", "100", "0", "0", "0", "100", "0"],
                            ["--percent", "100", "0", "0", "50", "100", "0"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_alone_batched_and_resumed_give_the_same_tokens(tiny, tmp_path, case):
    ckpt, env = tiny
    flags, batched_flags, resumed_flags = CASES[case]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    common = ["--model", str(ckpt), "--input", str(inp), "--gen-len", "40", "--no-progress",
              "--offload-dir", str(tmp_path / "offload"), *flags]
    alone, batched, resumed = (tmp_path / f"{name}.jsonl" for name in ("alone", "batched", "resumed"))
    proc = run_main(common + ["--output", str(alone), "--gpu-batch-size", "1"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the budgets really differ per prompt (the startup line gives their range)
    assert "slots/seq" in proc.stdout and "each prompt's own length" in proc.stdout, proc.stdout
    assert "batch invariance: bit for bit" in proc.stdout, proc.stdout          # what the startup line promises
    proc = run_main(common + ["--output", str(batched), "--gpu-batch-size", "4", "--num-gpu-batches", "2",
                              *batched_flags], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # refilled: rows that finished took the next prompts in join passes (a batched job refills by default)
    killed_then_resumed([*common, "--output", str(resumed), "--gpu-batch-size", "3", *resumed_flags], resumed, env,
                        tmp_path / "log")
    want = tokens_by_id(alone)
    assert len(want) == len(ROWS) and sum(map(len, want.values())) > 20 * len(ROWS)   # real generations
    assert tokens_by_id(batched) == want
    assert tokens_by_id(resumed) == want
