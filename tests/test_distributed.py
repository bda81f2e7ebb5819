"""Scale-out under torchrun with gloo on this machine: data-parallel batch jobs and the layer pipeline.

Every job here is the real entry point (`python -m torch.distributed.run ... -m flexgen_h2o.run`) in local
processes; the reference is the same command run by run.main in this process (tests/tiny_checkpoint.py,
run_main). Tokens must be equal outright: a data-parallel rank's blocks hold other prompts than one process's
(batch invariance), and a pipeline computes the same layers in the same order, only in other processes.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from flexgen_h2o.config import ConfigError
from flexgen_h2o.distributed import World, world_from_env
from flexgen_h2o.frontends.parts import existing_parts
from flexgen_h2o.distributed.pipeline import split_layers, split_work
from flexgen_h2o.distributed.shard import shard_by_tokens
from flexgen_h2o.frontends.scale_out import join
from flexgen_h2o.models import build_layers, resolve_model, schedule_groups
from tests.helpers import tiny_hf
from tests.tiny_checkpoint import REPO, ROWS, char_tokenizer, run_main

# rank 1 SIGKILLs itself right after its first block is on disk (fsync'd in its part file)
_KILL_RANK_1 = """
import os, runpy, signal, sys
from flexgen_h2o.frontends import jsonl
plain = jsonl.ResultsFile.append
def append(self, records):
    plain(self, records)
    if os.environ["RANK"] == "1" and self.path.name.endswith(".part"):
        os.kill(os.getpid(), signal.SIGKILL)
jsonl.ResultsFile.append = append
sys.argv = ["flexgen_h2o.run", *sys.argv[1:]]
runpy.run_module("flexgen_h2o.run", run_name="__main__")
"""


def torchrun(n: int, args: list[str], env: dict, script: str | None = None) -> subprocess.CompletedProcess:
    entry = [script] if script else ["-m", "flexgen_h2o.run"]
    env = {"GLOO_SOCKET_IFNAME": "lo", **env}      # local ranks over loopback, whether or not the hostname resolves
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                           *entry, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


def results(path) -> list[tuple[str, list[int]]]:
    return [(r["id"], r["token_ids"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.fixture(scope="module")
def tiny_opt(tiny, tmp_path_factory):
    """A tiny random OPT checkpoint beside the tiny Llama (same tokenizer), converted by its first run."""
    folder = tmp_path_factory.mktemp("opt") / "tiny-opt"
    tiny_hf("opt").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    inp = tmp_path_factory.mktemp("job") / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return inp


@pytest.fixture(scope="module")
def one_process(tiny, tiny_opt, job, tmp_path_factory):
    """The job's results from one plain process (default blocks, refill), once per model and KV rule: every
    distributed run below must give exactly these tokens, whatever its blocks."""
    ckpt, env = tiny
    done: dict = {}

    def get(model: str, kv: tuple[str, ...]) -> list:
        if (model, kv) not in done:
            out = tmp_path_factory.mktemp("one") / "one.jsonl"
            proc = run_main(["--model", str(ckpt if model == "llama" else tiny_opt), "--input", str(job), "--output",
                             str(out), "--gen-len", "40", "--no-progress", *kv], env)
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[model, kv] = results(out)
            assert [i for i, _ in done[model, kv]] == [r["id"] for r in ROWS]
            assert sum(len(t) for _, t in done[model, kv]) > 20 * len(ROWS)          # real generations
        return done[model, kv]
    return get


# --- the pure parts ---

def test_shares_are_balanced_by_tokens_not_by_count():
    work = [100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10]
    shares = shard_by_tokens(work, 2)
    assert shares == [[0], list(range(1, 11))]                          # one long prompt weighs ten short ones
    assert all(s == sorted(s) for s in shard_by_tokens([5, 3, 8, 1, 9, 2], 3))      # a share keeps input order
    assert sorted(i for s in shard_by_tokens(list(range(17)), 4) for i in s) == list(range(17))
    assert shard_by_tokens([1, 1], 3) == [[0], [1], []]


def test_the_split_minimises_the_largest_stage_and_cuts_between_schedule_layers():
    work = [0, 4, 4, 4, 4, 9]
    best = min(max(sum(work[a:b]) for a, b in zip((0, i, j), (i, j, len(work))))
               for i in range(1, len(work)) for j in range(i + 1, len(work)))
    cut = split_work(work, 3)
    assert max(sum(work[a:b]) for a, b in cut) == best == 9 and cut[0][0] == 0 and cut[-1][1] == len(work)
    assert all(a < b for a, b in cut) and all(x[1] == y[0] for x, y in zip(cut, cut[1:]))
    cfg = resolve_model("smollm2-135m")                                    # 30 blocks, a 49152-word head
    kinds = [layer.kind for layer in build_layers(cfg)]
    for sep in (True, False):
        starts = {g[0] for g in schedule_groups(kinds, sep)}
        stages = split_layers(cfg, 4, sep)
        assert stages[0][0] == 0 and stages[-1][1] == len(kinds) and all(lo in starts for lo, _ in stages)
    # the head weighs 28M FLOPs per token against a block's 7M: the last stage holds fewer blocks
    blocks = [sum(1 for i in range(lo, hi) if kinds[i] == "attn") for lo, hi in split_layers(cfg, 2, True)]
    assert blocks[0] > blocks[1] and sum(blocks) == 30


def test_with_cached_rates_the_split_weighs_each_layer_by_its_predicted_time():
    """Rates where a layer call's fixed cost is everything and FLOPs are free: every schedule layer weighs the
    same, so SmolLM2's 62 (embed, 30 x attention and MLP, head) split 31 + 31, where FLOPs give the head's stage
    fewer blocks."""
    cfg = resolve_model("smollm2-135m")
    free_flops = {"linear_GFLOPs": {"fp16": {"1": 1e9, "64": 1e9}}, "fixed_decode_s_per_layer": 1e-3}
    by_time = split_layers(cfg, 2, True, free_flops, rows=4)
    assert [hi - lo for lo, hi in by_time] == [31, 31] and by_time != split_layers(cfg, 2, True)


def test_a_job_whose_shape_does_not_fit_the_world_is_refused_before_joining(tmp_path):
    args = SimpleNamespace(world=World(rank=0, size=2, local_rank=0, local_size=2), pipeline_stages=3,
                           stage_percent=None, percent=None, device="cpu", model="smollm2-135m", sep_layer=True)
    with pytest.raises(ConfigError, match="--pipeline-stages 3 needs as many ranks; torchrun started 2"):
        join(args, "batch")
    args.pipeline_stages = 1
    with pytest.raises(ConfigError, match="data-parallel runs are batch jobs"):
        join(args, "prompt")
    args.pipeline_stages, args.stage_percent = 2, [[100, 0, 100, 0, 100, 0]]
    with pytest.raises(ConfigError, match="--stage-percent is given 1 times for 2 stages"):
        join(args, "batch")
    assert world_from_env({"WORLD_SIZE": "1"}) is None
    env = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert world_from_env(env) == World(3, 4, 1, 2)


def test_pipeline_flags_without_torchrun_are_one_error_line(tiny, tmp_path):
    ckpt, env = tiny
    proc = run_main(["--model", str(ckpt), "--prompt", "hi", "--pipeline-stages", "2"], env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error: --pipeline-stages, --stage-percent and --stage-order split the model")


# --- data-parallel ---

@pytest.mark.parametrize("kv", [(), ("--hh-ratio", "0.2")], ids=["full", "h2o"])
def test_data_parallel_output_is_one_process_output_in_input_order(tiny, one_process, tmp_path, job, kv):
    ckpt, env = tiny
    out = tmp_path / "dp.jsonl"
    proc = torchrun(2, ["--model", str(ckpt), "--input", str(job), "--gen-len", "40", "--no-progress", *kv,
                        "--output", str(out)], env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert results(out) == one_process("llama", kv)
    assert "data-parallel: 2 ranks" in proc.stdout and not existing_parts(out)
    assert "per rank: 1/2 of this node's RAM and disk" in proc.stdout        # the plan counts a rank's share


def test_a_killed_rank_fails_the_job_and_a_rerun_on_another_world_size_finishes_it(tiny, one_process, tmp_path,
                                                                                     job):
    ckpt, env = tiny
    common = ["--model", str(ckpt), "--input", str(job), "--gen-len", "40", "--no-progress", "--hh-ratio", "0.2",
              "--gpu-batch-size", "2", "--no-refill"]
    out, script = tmp_path / "dp.jsonl", tmp_path / "kill_rank_1.py"
    script.write_text(_KILL_RANK_1)
    killed = torchrun(2, [*common, "--output", str(out)], env, script=str(script))
    assert killed.returncode != 0 and not out.exists()
    line = next(x for x in killed.stderr.splitlines() if x.startswith("error: "))
    assert line.startswith("error: rank 1 (pid ") and f"died; rank 0 stopped; rerun the same command to finish {out}" \
        in line, killed.stderr[-3000:]
    kept = [len(p.read_text().splitlines()) for p in existing_parts(out)]
    assert sum(kept) >= 2, kept                                          # rank 1's first block, maybe rank 0's
    rerun = torchrun(3, [*common, "--output", str(out)], env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming {out}: {sum(kept)} of {len(ROWS)} ids already done" in rerun.stdout
    assert results(out) == one_process("llama", ("--hh-ratio", "0.2")) and not existing_parts(out)


# --- pipeline ---

# stage 1 keeps its weights in host memory, stage 2 its KV on disk, stage 3 its KV split between compute and host
STAGES = {2: [["0", "100", "100", "0", "100", "0"], ["100", "0", "0", "0", "100", "0"]],
          3: [["0", "100", "100", "0", "100", "0"], ["100", "0", "0", "0", "100", "0"],
              ["0", "0", "50", "50", "100", "0"]]}


# Llama's second stage takes each GPU batch through its layers in turn (the default order for resident weights)
# and runs the job continuously refilled (every stage joins the same prompts into the same rows, from the ids the
# last stage sends); OPT's stages keep the zig-zag order, which a stage that streams its weights (stage 1 here)
# always runs, and FlexGen's synchronous blocks
@pytest.mark.parametrize("model,stages,order,refill", [("llama", 2, "auto", True), ("opt", 3, "zigzag", False)])
def test_pipeline_stages_give_one_process_greedy_tokens(tiny, tiny_opt, one_process, tmp_path, job, model, stages,
                                                        order, refill):
    ckpt, env = tiny
    folder = ckpt if model == "llama" else tiny_opt
    common = ["--model", str(folder), "--input", str(job), "--gen-len", "40", "--no-progress",
              "--gpu-batch-size", "2", "--num-gpu-batches", "2", *(() if refill else ("--no-refill",))]
    out, metrics = tmp_path / "pp.jsonl", tmp_path / "metrics.json"
    placements = [a for p in STAGES[stages] for a in ("--stage-percent", *p)]
    proc = torchrun(stages, [*common, "--output", str(out), "--pipeline-stages", str(stages), *placements,
                             "--stage-order", order, "--metrics-json", str(metrics),
                             "--offload-dir", str(tmp_path / "off")], {**env, "FLEXGEN_H2O_ALL_RANKS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert results(out) == one_process(model, ())
    joins = json.loads(metrics.read_text())["refill_joins"]
    assert (joins >= 2) if refill else joins is None, joins
    said = proc.stdout
    assert all(f"pipeline: stage {s + 1} of {stages} holds layers" in said for s in range(stages))
    assert "disk peak" in said and re.search(r"host peak [1-9]", said)   # stage 2's KV on disk, 1's weights on host
    assert not any((tmp_path / "off").glob("*"))                          # and stage 2's KV files are gone
