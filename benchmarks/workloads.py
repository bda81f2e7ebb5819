"""The suite's workloads (issue 8): shapes, the memory budget every system gets, and which systems run by default.

- `s512+32` ... `s512+1024`: the papers' prompt 512 + gen 32/128/512/1024, scaled to a 2-core CPU: SmolLM2-135M
  with its real weights and real prompts (Lee news text), weights and KV in RAM.
- `s2048+512`: long context, the same model.
- `disk512+128`, `disk512+512`, `disk512+1024`: an OPT-1.3B-shaped dummy model (2.6 GB of fp16 weights) whose
  decoder weights live on disk, page cache dropped before every run, under a RAM budget below the weights' size
  (2 GiB; 3 GiB for disk512+128, where Accelerate runs: it peaks at ~2.4 GiB of RSS at batch 1, almost all of it
  anonymous memory (the split measured on 2026-11-25), so 2 GiB would leave it no batch).
- `chat`: 200 real chat turns (benchmarks/chat_job.py) answered to EOS, at most 512 new tokens each, SmolLM2 in
  RAM; each system at the batch its sizing rule fits under the budget (`System.chat_batch`), no probes.

The budget is the process's peak RSS (VmHWM): one number, measured the same way for every system, whatever its
internals (our engine's tiers, HF's allocator, Accelerate's hooks). `--smoke` shrinks each workload
(`smoke()`): prompt 64 + gen 8, batches 1-2, OPT-125M instead of OPT-1.3B, the 20 % budget level only; the chat
job to 12 prompts of at most 32 new tokens, batches up to 4.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

GIB = 1 << 30
RAM_PERCENT = (100, 0, 100, 0, 100, 0)       # weights, KV and activations on the compute tier (RAM on a CPU)
DISK_PERCENT = (0, 0, 100, 0, 100, 0)        # every weight homed on disk, KV and activations on the compute tier
HOST_PERCENT = (0, 100, 100, 0, 100, 0)      # weights streamed from host RAM to the GPU, KV and activations on it
WEIGHTS_WHERE = {"disk": "decoder weights on a cold disk", "host": "weights streamed from host RAM to the GPU"}

# systems a workload runs when --systems is not given; deepspeed and flexgen are listed everywhere so that a
# machine without a GPU shows them as skipped, with the reason, instead of leaving them out
OURS = ["ours-full", "ours-h2o-10", "ours-h2o-20", "ours-h2o-40"]
KVPRESS = [f"kvpress-{p}-{b}" for p in ("observed", "streaming") for b in (10, 20, 40)]
GPU_ONLY = ["deepspeed", "flexgen"]
# the engines a CPU user would also try (issue 36), each in its own cached virtualenv
CPU_ENGINES = ["kvpress-decoding-20", "openvino", "openvino-f16", "openvino-evict-20", "openvino-evict-20-f16",
               "openvino-evict-20-normsum", "openvino-evict-20-snapkv",
               "vllm", "vllm-inproc", "llamacpp-f16", "llamacpp-q8_0", "llamacpp-q4_0"]
# the chat job: ours with continuous refill (the CLI's default) and without, OpenVINO's continuous batching (its
# scheduler refills) with an fp16 KV cache as ours, and HF generate in fixed batches
CHAT = ["ours-full", "ours-norefill-full", "ours-h2o-20", "ours-norefill-h2o-20", "hf", "openvino-f16",
        "openvino-evict-20-f16"]


@dataclass(frozen=True)
class Workload:
    name: str
    model: str                   # a flexgen_h2o preset
    prompt_len: int
    gen_len: int
    budget_bytes: int            # peak RSS (or, budget_kind "gpu", peak GPU memory) every system must stay under
    weights: str                 # "ram", "disk" (decoder weights homed on disk, read cold) or "host" (GPU runs)
    dummy: bool                  # random weights in the real shapes (no OPT weights ship offline)
    systems: tuple[str, ...]     # the default system list
    max_batch: int = 64          # the batch search stops here
    runtime_bytes: int = GIB // 2  # interpreter + torch + tokenizer, added to planner estimates (ours)
    probe_gen_len: int = 16      # generated tokens in a search probe (probes are short; final runs are not)
    is_smoke: bool = False
    budget_kind: str = "rss"     # "gpu": the budget is the device's memory (weights stream from host RAM)
    uncached: bool = False       # disk weights dropped from the page cache after every read (a model > RAM)
    chat_prompts: int = 0        # the chat workload: this many chat turns answered to EOS (gen_len: max new tokens)
    job: Any = None              # its files, once written (chat_job.ChatJob; prompt_len is then its longest prompt)

    @property
    def is_chat(self) -> bool:
        return self.chat_prompts > 0

    @property
    def needs_gpu(self) -> bool:
        return self.budget_kind == "gpu"

    @property
    def percent(self) -> tuple[int, ...]:
        return {"disk": DISK_PERCENT, "host": HOST_PERCENT}.get(self.weights, RAM_PERCENT)

    def peak_bytes(self, row: dict[str, Any]) -> int:
        """The peak the budget is about: the process's RSS, or its GPU memory for a GPU workload."""
        return int(row["peak_gpu_bytes"] or 0) if self.needs_gpu else int(row["peak_rss_bytes"])

    @property
    def cold_disk(self) -> bool:
        return self.weights == "disk"

    def model_config(self) -> Any:
        from flexgen_h2o.models import resolve_model
        return resolve_model(self.model)

    def describe(self) -> str:
        if self.is_chat:
            return (f"{self.model} (real weights, weights in RAM), {self.chat_prompts} chat turns (prompts up to "
                    f"{self.prompt_len} tokens) answered to EOS, at most {self.gen_len} new tokens each, budget "
                    f"{self.budget_bytes / GIB:.2f} GiB peak RSS per process")
        kind = "dummy weights" if self.dummy else "real weights"
        where = WEIGHTS_WHERE.get(self.weights, "weights in RAM")
        where += ", read from the disk at every step (never from the page cache)" if self.uncached else ""
        peak = "GPU memory" if self.needs_gpu else "RSS"
        return (f"{self.model} ({kind}, {where}), prompt {self.prompt_len} + gen {self.gen_len}, budget "
                f"{self.budget_bytes / GIB:.2f} GiB peak {peak} per process")


def _smollm2(prompt: int, gen: int, max_batch: int) -> Workload:
    return Workload(f"s{prompt}+{gen}", "smollm2-135m", prompt, gen, 2 * GIB, "ram", False,
                    tuple(OURS + ["hf"] + KVPRESS + CPU_ENGINES + GPU_ONLY), max_batch=max_batch)


def _disk(gen: int, with_accelerate: bool) -> Workload:
    systems = OURS + (["accelerate"] if with_accelerate else []) + GPU_ONLY
    # 2 GiB of RSS against 2.45 GiB of fp16 weights: the weights cannot all stay in the budget. Accelerate maps
    # its offloaded .dat files, and every page it touches counts in its RSS: it peaked at 2.25 GiB at batch 1
    # (issue 3's run), so where it runs the budget is 3 GiB, or it would have no batch at all
    budget = 3 * GIB if with_accelerate else 2 * GIB
    return Workload(f"disk512+{gen}", "opt-1.3b", 512, gen, budget, "disk", True, tuple(systems), max_batch=64)


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    _smollm2(512, 32, 128), _smollm2(512, 128, 128), _smollm2(512, 512, 128), _smollm2(512, 1024, 128),
    _smollm2(2048, 512, 128),
    # Accelerate runs at 512+128 only: its cold reads make 512+512 take hours per run (docs/suite.md "Workloads")
    _disk(128, True), _disk(512, False), _disk(1024, False),
    # scripts/gpu_bench.sh: FlexGen's headline shape on one GPU, weights (60 GB fp16) streamed from host RAM; the
    # budget is the GPU's memory (the script passes the device's size with --budget-gib)
    Workload("gpu-opt30b-512+512", "opt-30b", 512, 512, 70 * GIB, "host", True,
             ("ours-full", "ours-h2o-20", "flexgen", "deepspeed"), max_batch=512, budget_kind="gpu"),
    # issue 35's job; prompt_len is set once the job is written (with_job)
    Workload("chat", "smollm2-135m", 0, 512, 2 * GIB, "ram", False, tuple(CHAT), max_batch=128, chat_prompts=200),
)}


# the quick run exercises each adapter once: ours with H2O on the RAM shape and the full cache on the disk shape,
# kvpress's pipeline press once (observed and streaming differ only in the press) and its DecodingPress child
SMOKE_SAME_ADAPTER = {"ram": ("ours-full", "kvpress-streaming-20"), "disk": ("ours-h2o-20",)}


def smoke(w: Workload) -> Workload:
    """A couple of minutes for the whole suite: tiny shapes, batches 1-2, OPT-125M for the disk shape. The
    budget stays as it is (the search still checks it)."""
    if w.is_chat:           # OpenVINO only when named, as below
        return replace(w, name=w.name + "-smoke", chat_prompts=12, gen_len=32, max_batch=4, is_smoke=True,
                       systems=tuple(s for s in w.systems if not s.startswith("openvino")))
    model = "opt-125m" if w.model.startswith("opt") else w.model
    # one budget level per family (20 %) keeps every adapter exercised at a third of the cost. OpenVINO and vLLM
    # run only when named (`--smoke --systems openvino vllm`): their first use builds two virtualenvs and an IR
    # (about 8 minutes of pip and export), which `make test`'s quick run cannot afford on a fresh CI machine
    systems = tuple(s for s in w.systems if not s.endswith(("-10", "-40")) and not s.startswith(("openvino", "vllm"))
                    and s not in SMOKE_SAME_ADAPTER.get(w.weights, ()))
    # a probe of the whole gen_len is also the final run (Runner.final): one case per system
    return replace(w, name=w.name + "-smoke", model=model, prompt_len=64, gen_len=8, max_batch=2,
                   probe_gen_len=8, systems=systems, is_smoke=True)


def uncached(w: Workload) -> Workload:
    """The same disk workload with the weights read from the disk at every step, as they must be when the model
    is larger than the machine's RAM (on this VM the 2.45 GiB of OPT-1.3B would otherwise come back from the page
    cache after the first pass: RAM outside every process's RSS budget)."""
    if not w.cold_disk:
        raise SystemExit(f"error: --uncached-weights needs a disk workload; {w.name} keeps its weights in RAM")
    return replace(w, name=w.name + "-uncached", uncached=True)


def overridden(w: Workload, model: str | None, gen_len: int | None) -> Workload:
    """The workload with another model or generation length (a shortened run), under a name that says so."""
    model, gen_len = model or w.model, gen_len or w.gen_len
    return replace(w, name=f"{w.name}--{model}-gen{gen_len}", model=model, gen_len=gen_len,
                   probe_gen_len=min(w.probe_gen_len, gen_len))


def select_workloads(names: list[str] | None, smoke_mode: bool, uncached_weights: bool = False,
                     default: list[str] | None = None) -> list[Workload]:
    """Workloads by name, else `default` (else all), of which only the disk ones with uncached_weights; unknown
    names raise with the list of known ones."""
    names = names or [n for n in (default or WORKLOADS) if WORKLOADS[n].cold_disk or not uncached_weights]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"error: unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    picked = [uncached(WORKLOADS[n]) if uncached_weights else WORKLOADS[n] for n in names]
    return [smoke(w) for w in picked] if smoke_mode else picked


def ensure_real_store(w: Workload) -> str | None:
    """Convert a real-weights model's store once, before any system runs (on a fresh machine the first one to
    need it would otherwise convert inside its own case, or fail where it reads only the tokenizer); the reason
    every system is skipped if that fails."""
    if w.dummy:
        return None
    from flexgen_h2o.loader import ensure_store
    try:
        ensure_store(w.model, progress=False)
    except Exception as err:                  # noqa: BLE001 - any failure becomes the rows' printed reason
        return f"converting the {w.model} store failed: {str(err).strip().splitlines()[-1][:200]}"
    return None


def with_job(w: Workload, folder: Path) -> Workload:
    """The chat workload with its job written to `folder` (once per run, before any system runs it)."""
    from benchmarks.chat_job import write_job
    job = write_job(folder, w.chat_prompts, w.gen_len, w.model)
    return replace(w, prompt_len=job.longest, job=job)
