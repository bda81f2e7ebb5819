"""The chat workload's systems (benchmarks/chat.py): what each one runs, at which batch, and what it reports.

- `ours-{full,h2o-20}-{refill,norefill}`: `python -m flexgen_h2o.run` in batch mode on the job's JSONL
  (`--full-cache` or `--hh-ratio 0.1`, as benchmarks/systems/ours.py maps ours-h2o-20; `--no-refill` for the
  norefill variants). Batch: the largest (capped) whose planner estimate at the job's longest prompt + max_new
  fits the budget, as ours.py's predicted_bytes computes it for a suite workload.
- `openvino-f16`, `openvino-evict-20-f16`: `openvino_child.py --chat` in the openvino venv: every prompt added to
  the ContinuousBatchingPipeline at once, max_num_seqs = the batch, so its scheduler refills. f16 KV blocks sized
  as the adapter sizes them (benchmarks/systems/openvino.py num_kv_blocks) for the longest prompt + max_new; the
  batch the largest whose blocks plus OV_BASE_BYTES fit the budget. Eviction: CacheEvictionConfig is one per
  pipeline, while ours gives each prompt int(0.1 * P) heavy + recent slots of its own length, so the sizes come
  from the job's mean prompt length (the same budget on average; `eviction_sizes`), scoring every prompt query.
- `hf`: this module as a child (`python -m benchmarks.chat_peers hf ...`): transformers `generate` on the same
  ids, prompts in order in fixed batches (left padding), greedy, stop at EOS; a batch ends when its longest
  answer does (no refill). Default batch 16 (`--batch hf=N`).

Every child prints nothing the parent parses except its JSON: per prompt the generated token count (EOS counted,
as our output's token_ids count it) and "eos" or "length", the generation time and the process's VmHWM.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

GIB, MIB = 1 << 30, 1 << 20
MAX_BATCH = 128
HF_BATCH = 16
# OpenVINO's resident set besides its KV blocks: the fp32 IR compiled (bf16 matmuls), the runtime and a prompt
# step of up to 4096 tokens. The suite's s512+512 searches (benchmarks/results/suite-36-s512+512*) measured
# 0.95 GiB at batch 1 and 1.02-1.10 GiB beyond the KV blocks at batch 16-64, plus ~1 MiB per sequence. The chat
# job (all requests queued at once, prompts up to 540 tokens) peaked 0.38-0.39 GiB above that rule at batches 37
# and 67 (benchmarks/results/chat-35: 2.39 and 2.38 GiB under a 2 GiB budget), so it takes 1.50 GiB
OV_BASE_BYTES = int(1.50 * GIB)
OV_SEQ_BYTES = 1 * MIB


@dataclass(frozen=True)
class ChatSystem:
    name: str
    kind: str                        # ours | openvino | hf
    hh_ratio: float | None = None    # ours: None = --full-cache
    refill: bool = True              # ours: False adds --no-refill
    refill_share: float | None = None  # ours: --refill-share (None: the engine's default rule)
    gpu_batches: int = 1             # ours: the batch cut into this many GPU batches (an idle one sits decode out)
    evict_pct: int | None = None     # openvino: ours-h2o-<pct>'s budget, None = full cache
    ov_kv: str = "f16"


SYSTEMS = {s.name: s for s in (
    ChatSystem("ours-full-refill", "ours"), ChatSystem("ours-full-norefill", "ours", refill=False),
    ChatSystem("ours-h2o-20-refill", "ours", hh_ratio=0.1),
    ChatSystem("ours-h2o-20-norefill", "ours", hh_ratio=0.1, refill=False),
    # the refill rule's study (not run by default): join once a quarter / half of the rows are free
    ChatSystem("ours-h2o-20-refill-s25", "ours", hh_ratio=0.1, refill_share=0.25),
    ChatSystem("ours-h2o-20-refill-s50", "ours", hh_ratio=0.1, refill_share=0.5),
    ChatSystem("ours-h2o-20-refill-4x", "ours", hh_ratio=0.1, gpu_batches=4),
    ChatSystem("ours-full-refill-4x", "ours", gpu_batches=4),
    ChatSystem("openvino-f16", "openvino"), ChatSystem("openvino-evict-20-f16", "openvino", evict_pct=20),
    ChatSystem("hf", "hf"),
)}
# run only when named: the refill rule's share, and the batch cut into 4 GPU batches
STUDY = {"ours-h2o-20-refill-s25", "ours-h2o-20-refill-s50", "ours-h2o-20-refill-4x", "ours-full-refill-4x"}


@dataclass(frozen=True)
class Job:
    """One chat job on disk: the CLI's input, the token ids every peer reads, and their shape."""
    dir: Path
    input_jsonl: Path
    ids_json: Path             # {"prompts": [[ids]], "max_new_tokens": [n], "eos_id", "pad_id"}
    prompt_lens: tuple[int, ...]
    max_new: int
    eos_id: int
    pad_id: int

    @property
    def longest(self) -> int:
        return max(self.prompt_lens)

    @property
    def mean_len(self) -> int:
        return round(sum(self.prompt_lens) / len(self.prompt_lens))


def chat_workload(job: Job, budget: int) -> Any:
    """A suite Workload of the job's worst shape (longest prompt + max_new, SmolLM2, weights in RAM), so ours.py's
    predicted_bytes (the engine's planner plus the runtime) prices a batch of it."""
    from benchmarks.workloads import WORKLOADS
    return replace(WORKLOADS["s512+512"], name="chat", prompt_len=job.longest, gen_len=job.max_new,
                   budget_bytes=budget, max_batch=MAX_BATCH)


def ours_batch(s: ChatSystem, job: Job, budget: int, cap: int = MAX_BATCH) -> tuple[int, dict[str, Any]]:
    from benchmarks.common import largest_batch
    from benchmarks.systems.ours import predicted_bytes
    w = chat_workload(job, budget)
    best, seen = largest_batch(lambda b: predicted_bytes(w, s.hh_ratio, b), budget, cap)
    return best, {"rule": f"planner at prompt {job.longest} + gen {job.max_new}, largest batch <= {cap} under "
                          f"{budget / GIB:.2f} GiB", "predicted_bytes": dict(seen).get(best)}


def ov_sizes(s: ChatSystem, job: Job) -> dict[str, int] | None:
    from benchmarks.systems.openvino import eviction_sizes
    if s.evict_pct is None:
        return None
    sizes = eviction_sizes(job.mean_len, s.evict_pct)
    return {**sizes, "snapkv_window_size": job.longest}


def ov_blocks(s: ChatSystem, job: Job, batch: int) -> int:
    from benchmarks.systems.openvino import num_kv_blocks
    return num_kv_blocks(batch, job.longest, job.max_new, ov_sizes(s, job))


def ov_batch(s: ChatSystem, job: Job, budget: int, cap: int = MAX_BATCH) -> tuple[int, dict[str, Any]]:
    """The largest batch whose KV blocks (each sequence's worst case, as the adapter allocates them) plus
    OV_BASE_BYTES and OV_SEQ_BYTES a sequence fit the budget."""
    from benchmarks.systems.openvino import BLOCK, kv_bytes_per_token
    from flexgen_h2o.models import resolve_model
    per_block = BLOCK * kv_bytes_per_token(resolve_model("smollm2-135m"), s.ov_kv)

    def need(b: int) -> int:
        return OV_BASE_BYTES + b * OV_SEQ_BYTES + ov_blocks(s, job, b) * per_block
    best = 0
    for b in range(1, cap + 1):
        if need(b) > budget:
            break
        best = b
    return best, {"rule": f"{OV_BASE_BYTES / GIB:.2f} GiB + {s.ov_kv} KV blocks for prompt {job.longest} + gen "
                          f"{job.max_new} per sequence under {budget / GIB:.2f} GiB, batch <= {cap}",
                  "predicted_bytes": need(best) if best else None, "eviction": ov_sizes(s, job)}


def pick_batch(s: ChatSystem, job: Job, budget: int, fixed: dict[str, int], cap: int = MAX_BATCH
               ) -> tuple[int, dict[str, Any]]:
    if s.name in fixed:
        return fixed[s.name], {"rule": "--batch"}
    if s.kind == "ours":
        return ours_batch(s, job, budget, cap)
    if s.kind == "openvino":
        return ov_batch(s, job, budget, cap)
    return min(HF_BATCH, cap), {"rule": f"default {HF_BATCH} (--batch hf=N)"}


def command(s: ChatSystem, job: Job, batch: int, run: Path) -> tuple[str, list[str]]:
    """(interpreter, arguments) of one run writing into the folder `run`; the child's JSON is run/'child.json'
    (ours: run/'metrics.json' and run/'out.jsonl')."""
    if s.kind == "ours":
        args = ["-m", "flexgen_h2o.run", "--model", "smollm2-135m", "--input", str(job.input_jsonl),
                "--output", str(run / "out.jsonl"), "--overwrite", "--gpu-batch-size", str(batch // s.gpu_batches),
                "--num-gpu-batches", str(s.gpu_batches), "--percent", "100", "0", "100", "0", "100", "0",
                "--offload-dir", str(run / "offload"), "--metrics-json", str(run / "metrics.json"), "--no-progress"]
        args += ["--full-cache"] if s.hh_ratio is None else ["--hh-ratio", f"{s.hh_ratio:g}"]
        args += ["--no-refill"] if not s.refill else []
        args += ["--refill-share", f"{s.refill_share:g}"] if s.refill_share is not None else []
        return sys.executable, args
    if s.kind == "openvino":
        from benchmarks.systems.openvino import CHILD, ir_dir, venv_python
        args = [str(CHILD), "--ir", str(ir_dir("smollm2-135m")), "--chat", str(job.ids_json), "--batch", str(batch),
                "--kv-precision", s.ov_kv, "--num-kv-blocks", str(ov_blocks(s, job, batch)),
                "--json", str(run / "child.json")]
        sizes = ov_sizes(s, job)
        if sizes is not None:
            args += ["--evict-start", str(sizes["start_size"]), "--evict-recent", str(sizes["recent_size"]),
                     "--evict-max", str(sizes["max_cache_size"]), "--snapkv-window", str(sizes["snapkv_window_size"])]
        return str(venv_python()), args
    return sys.executable, ["-m", "benchmarks.chat_peers", "hf", "--ids", str(job.ids_json), "--batch", str(batch),
                            "--json", str(run / "child.json")]


def collect(s: ChatSystem, run: Path, max_new: int) -> dict[str, Any]:
    """Per prompt lengths and finish reasons, generation seconds and peak RSS from a finished run's files."""
    if s.kind != "ours":
        raw = json.loads((run / "child.json").read_text())
        return {k: raw.get(k) for k in ("lengths", "finish", "gen_s", "load_s", "peak_rss_bytes", "num_kv_blocks",
                                        "kv_cache_bytes", "max_cache_usage", "max_scheduled", "inference_precision",
                                        "eos_in_ids", "batches", "openvino_genai_version")}
    lengths, finish = [], []
    for line in (run / "out.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            lengths.append(len(rec["token_ids"]))
            finish.append("eos" if rec["finish_reason"] == "eos" else rec["finish_reason"])
    m = json.loads((run / "metrics.json").read_text())
    keep = ("prefill_s", "decode_s", "blocks", "block_size", "padding_frac", "kv_cache_bytes", "generated_tokens")
    return {"lengths": lengths, "finish": finish, "gen_s": m.get("total_s"), "peak_rss_bytes": m["peak_rss_bytes"],
            "engine": {k: m[k] for k in m if k in keep or "refill" in k}}


# --- the hf child ---

def hf_child(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from benchmarks.systems.hf_generate import load_smollm2
    from flexgen_h2o.metrics import peak_rss_bytes
    job = json.loads(Path(a.ids).read_text())
    prompts, max_new, eos, pad = job["prompts"], job["max_new_tokens"], int(job["eos_id"]), int(job["pad_id"])
    t_load = time.perf_counter()
    model, _ = load_smollm2("cpu", torch.float32)
    t0 = time.perf_counter()
    lengths, finish, batches = [], [], []
    for lo in range(0, len(prompts), a.batch):
        chunk, news = prompts[lo:lo + a.batch], max_new[lo:lo + a.batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        tb = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max(news), do_sample=False,
                                 eos_token_id=eos, pad_token_id=pad)
        new = out[:, width:].tolist()
        for row, n in zip(new, news):
            k = row.index(eos) + 1 if eos in row[:n] else min(len(row), n)
            lengths.append(k)
            finish.append("eos" if eos in row[:n] else "length")
        batches.append({"size": len(chunk), "width": width, "steps": len(new[0]), "s": time.perf_counter() - tb})
    return {"mode": "chat", "batch": a.batch, "prompts": len(prompts), "lengths": lengths, "finish": finish,
            "generated_tokens": sum(lengths), "load_s": t0 - t_load, "gen_s": time.perf_counter() - t0,
            "batches": batches, "peak_rss_bytes": peak_rss_bytes(), "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chat_peers", description=__doc__.split("\n")[0])
    p.add_argument("child", choices=["hf"])
    p.add_argument("--ids", required=True, help="the job's ids JSON (benchmarks/chat.py writes it)")
    p.add_argument("--batch", type=int, default=HF_BATCH)
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    Path(a.json).write_text(json.dumps(hf_child(a), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
