"""OpenVINO GenAI as a peer: `ContinuousBatchingPipeline` (paged attention, continuous batching) on the CPU.

- `openvino`: full cache, `KV_CACHE_PRECISION=u8` (what the CPU plugin names as its default; for this fp32 IR it
  would compile f16 unless told, so the child always names the precision).
- `openvino-f16`: full cache, `KV_CACHE_PRECISION=f16` (our engine stores fp16 KV).
- `openvino-evict-20`, `openvino-evict-20-f16`: `use_cache_eviction` with `AggregationMode.SUM` (attention summed
  over the evictable area: its H2O-like mode) at ours-h2o-20's budget, every prompt query scored.
- `openvino-evict-20-normsum`: `AggregationMode.NORM_SUM` (its default mode: the sum divided by the steps a token
  has been in the cache, so old tokens do not win by age), every prompt query scored: `snapkv_window_size = 0`,
  its no-window mode (NORM_SUM with a window as long as the prompt fails its own check, `new_scores_size >=
  num_snapkv_scores`, once the start and recent areas are taken out of the scored span).
- `openvino-evict-20-snapkv`: NORM_SUM with its default `snapkv_window_size` (8): the prompt is scored by its last
  8 queries only, SnapKV's observation window; CacheEvictionConfig as a user gets it, apart from the sizes.
The comparison is against the best of the three on each workload (docs/suite.md).

The optimum-intel exporter pins transformers < 5.6, so OpenVINO lives in its own virtualenv, created
on first use under `<store_root>/venvs/openvino` with the main environment's torch build. The IR is exported once
per model from the HF folder every peer reads (`benchmarks.model_formats.hf_folder`: the store's fp16 values as
fp32), into `<store_root>/formats/<model>-ov-fp32`, weights kept fp32. Each case runs `openvino_child.py` with the
venv's interpreter on the engine's own prompt token ids (`kvpress.write_prompt_ids`): identical tokens for all.
Compute precision is the plugin's default, which on a CPU with AVX512_BF16 or AMX (this VM's EPYC) is bf16
matmuls over the fp32 weights; the extras name it (`inference_precision`). With f32 forced, OpenVINO's greedy ids
equal HF's on four prompts; with bf16, one 128-token news prompt flips a near-tie at its 10th token (docs/suite.md
"Systems").

Budget mapping (`eviction_sizes`). ours-h2o-20 is `--hh-ratio 0.1`: heavy = recent = int(0.1 * P) slots, no sinks
(P 512: 51 + 51 = 102 slots; P 2048: 204 + 204 = 408). OpenVINO's CacheEvictionConfig takes three sizes in
tokens, each a multiple of its KV block (32 on a CPU), and evicts whole blocks:
    start_size     = 32                                  one block: the fewest sinks it accepts (ours has none)
    recent_size    = ceil32(int(0.1 * P))                ours' recent window
    max_cache_size = max(ceil32(2 * int(0.1 * P)),       ours' total; the sink block comes out of the heavy
                         start + recent + 32)            share, and the evictable area must hold >= 1 block
    P 512:  start 32, recent 64,  max 128 (evictable 32);   ours 102 slots
    P 2048: start 32, recent 224, max 416 (evictable 160);  ours 408 slots
It evicts only once a block fills, so a sequence holds up to max_cache_size + 31 tokens. Scores: SUM adds each
token's attention at every step; `snapkv_window_size = P` makes the prompt pass add the attention of every prompt
query (H2O's column sums; its default, 8, would score the last 8 queries only, SnapKV-style). No RoPE re-rotation
(`apply_rotation` off), as ours keeps each token's original position. Unlike ours, OpenVINO evicts only after the
whole prompt is in the cache: its peak KV is the full prompt's, whatever the budget.

Memory: the pipeline allocates its KV blocks up front. `SchedulerConfig.cache_size` is in whole GB (1 GB is 10x
the KV of batch 8 at 512+32), so the adapter passes the exact block count instead (`num_kv_blocks`, which
overrides cache_size): each sequence's worst case (`blocks_per_seq`) times the batch, plus one spare block per
sequence. RSS then holds only the KV this batch needs, the suite's budget check stays honest, and kv_grows is False
(a probe shorter than the final run allocates fewer blocks: `kv_growth_bytes` adds the difference).

The chat workload (`--chat` in the child): every prompt of the job added at once, max_num_seqs = the batch, so
its scheduler refills a finished sequence's place. Blocks are sized for the longest prompt + the max new tokens;
the batch is the largest whose blocks plus OV_BASE_BYTES and OV_SEQ_BYTES a sequence fit the budget
(`chat_batch`). CacheEvictionConfig is one per pipeline, while ours gives each prompt slots of its own length, so
the eviction sizes come from the job's mean prompt (the same budget on average), scoring every prompt query.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.systems import venvs
from benchmarks.systems.base import Candidate, System, largest_fitting
from benchmarks.workloads import Workload

GENAI_VERSION = "2026.4.1"                     # the release the suite's runs used (docs/suite.md "Systems")
PINS = [f"openvino-genai=={GENAI_VERSION}.0", f"openvino=={GENAI_VERSION}", f"openvino-tokenizers=={GENAI_VERSION}.0",
        "optimum-intel==2.2.0", "optimum==2.3.0", "nncf==3.4.0", "transformers==5.5.4"]
CHILD = Path(__file__).resolve().parent / "openvino_child.py"
BLOCK = 32                                     # the CPU plugin's KV block (tokens); eviction sizes are multiples
KV_BYTES = {"u8": 1, "f16": 2, "f32": 4}
GIB, MIB = 1 << 30, 1 << 20
# OpenVINO's resident set besides its KV blocks on the chat job (the compiled IR, the runtime, a prompt step of
# up to 4096 tokens, every request queued at once), and per sequence: the first chat run's batch rule assumed less
# and went over the budget (benchmarks/results/chat-35/NOTES.md)
OV_BASE_BYTES = int(1.50 * GIB)
OV_SEQ_BYTES = 1 * MIB


def venv_dir() -> Path:
    return venvs.venv_root("openvino")


def venv_python(root: Path | None = None) -> Path:
    return venvs.venv_python(root or venv_dir())


def recipe() -> list[list[str]]:
    return [[venvs.PY, "-m", "pip", "install", "--quiet", venvs.torch_pin()],
            [venvs.PY, "-m", "pip", "install", "--quiet", *PINS, "numpy"],
            [venvs.PY, "-c", "import openvino_genai, optimum.intel, transformers; "
                             "print('openvino_genai', openvino_genai.__version__, transformers.__version__)"]]


def ensure_venv(root: Path | None = None, log: Path | None = None) -> str | None:
    """The openvino virtualenv, created once (benchmarks/systems/venvs.py). None when usable, else the reason."""
    return venvs.ensure_venv("openvino", recipe(), root=root or venv_dir(), log=log)


def ceil_block(n: int, block: int = BLOCK) -> int:
    """n rounded up to a whole number of blocks (at least one block)."""
    return max(block, -(-n // block) * block)


def eviction_sizes(prompt_len: int, budget_pct: int, block: int = BLOCK) -> dict[str, int]:
    """CacheEvictionConfig sizes (tokens) for ours-h2o-<budget_pct>'s budget at this prompt length (module doc)."""
    half = int(budget_pct / 200 * prompt_len)      # ours: heavy = recent = int(hh_ratio * P), hh_ratio = pct / 200
    start, recent = block, ceil_block(half, block)
    max_cache = max(ceil_block(2 * half, block), start + recent + block)
    return {"ours_slots": 2 * half, "start_size": start, "recent_size": recent, "max_cache_size": max_cache,
            "evictable_size": max_cache - start - recent, "snapkv_window_size": prompt_len,
            "max_tokens_per_seq": max_cache + block - 1}


def blocks_per_seq(prompt_len: int, gen_len: int, sizes: dict[str, int] | None, block: int = BLOCK) -> int:
    """KV blocks one sequence can hold at once: its whole length with a full cache; with eviction the larger of
    the whole prompt (nothing is evicted before the prompt is in) and the evicted size plus the block filling."""
    full = ceil_block(prompt_len + gen_len, block) // block
    if sizes is None:
        return full
    return min(full, max(ceil_block(prompt_len + 1, block), sizes["max_cache_size"] + block) // block)


def kv_bytes_per_token(cfg: Any, precision: str) -> int:
    """K and V bytes of one token over all layers. u8 adds fp32 scales and zero points: per channel per block for
    K, per token for V (the CPU plugin's layout; SmolLM2 measured 13680 B/token u8, 23040 f16)."""
    if precision != "u8":
        return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * KV_BYTES[precision]
    k = cfg.head_dim + 2 * 4 * cfg.head_dim // BLOCK
    v = cfg.head_dim + 2 * 4
    return cfg.n_layers * cfg.n_kv_heads * (k + v)


def num_kv_blocks(batch: int, prompt_len: int, gen_len: int, sizes: dict[str, int] | None) -> int:
    """The pipeline's whole cache: every sequence's worst case plus one spare block each (a block the scheduler
    finds missing would preempt a sequence and recompute it, which the child reports as a failure)."""
    return batch * (blocks_per_seq(prompt_len, gen_len, sizes) + 1)


def ir_dir(model: str) -> Path:
    from benchmarks.model_formats import formats_root
    from flexgen_h2o.weights import default_store_path
    return formats_root() / f"{default_store_path(model).name}-ov-fp32"


def export_ir(model: str, log: Path | None = None) -> tuple[Path, str | None]:
    """The OpenVINO IR of `model`, exported once from its HF folder with the venv's optimum-cli into a temp
    folder renamed into place. The `.ready` marker names the HF folder's own marker, so a rebuilt HF folder (a
    re-converted store) re-exports. Returns (folder, None) or (folder, one-line reason)."""
    from benchmarks.model_formats import hf_folder
    hf = hf_folder(model)
    want = (hf / ".ready").read_text().strip()
    dest = ir_dir(model)
    marker = dest / ".ready"
    if marker.is_file() and marker.read_text().strip() == want:
        return dest, None
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.with_name(dest.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)      # two suites at once would both export into one folder
        if marker.is_file() and marker.read_text().strip() == want:
            return dest, None
        tmp = dest.with_name(dest.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        cli = venv_dir() / "bin" / "optimum-cli"
        # a local folder names no task (optimum cannot infer one offline); with-past: the KV-cache model
        cmd = [str(cli), "export", "openvino", "--model", str(hf), "--task", "text-generation-with-past",
               "--weight-format", "fp32", str(tmp)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if log is not None:
            log.write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
        if proc.returncode != 0 or not (tmp / "openvino_model.xml").is_file():
            return dest, f"openvino IR export: {venvs.last_line(proc.stdout + proc.stderr)}"
        (tmp / ".ready").write_text(want + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    return dest, None


class OpenVINO(System):
    kv_grows = False              # every KV block is allocated before the first step (num_kv_blocks)
    runs_chat = True

    def __init__(self, kv_precision: str = "u8", budget_pct: int | None = None, mode: str = "SUM",
                 window: int | None = None) -> None:
        # OpenVINO's spelling for the child; the base class's kv_precision ("u8", "fp16") reads kv_dtype_bytes
        self.ov_kv_precision, self.budget_pct = kv_precision, budget_pct
        # the aggregation mode and the SnapKV window of an evicting variant (None: as long as the prompt; 0: no
        # window, every query from the first adds its scores)
        self.mode, self.window = mode, window
        variant = {("SUM", None): "", ("NORM_SUM", 0): "-normsum"}.get((mode, window), "-snapkv")
        self.name = "openvino" + (f"-evict-{budget_pct}{variant}" if budget_pct else "") + \
            ("" if kv_precision == "u8" else f"-{kv_precision}")
        self.kv_dtype_bytes = KV_BYTES[kv_precision]
        self.kv_fixed_tokens = budget_pct is not None
        self._ids: dict[str, Path] = {}

    def skip_reason(self, w: Workload) -> str | None:
        if w.dummy or w.model_config().family != "llama":
            return "openvino runs the IR exported from a real Llama-family HF folder; this workload is a dummy OPT"
        return None

    def python(self) -> str:
        return str(venv_python())

    _prepared: dict[str, str | None] = {}      # "venv" and each model's IR -> failure reason, shared by the variants

    def prepare(self, w: Workload, env: dict[str, str], out: Path) -> str | None:
        done = OpenVINO._prepared
        if "venv" not in done:
            done["venv"] = ensure_venv(log=out / "openvino_venv.log")
        if done["venv"]:
            return done["venv"]
        if w.model not in done:
            try:
                _, done[w.model] = export_ir(w.model, log=out / f"openvino_export_{w.model}.log")
            except (OSError, ValueError) as e:         # no store, or not a Llama store
                done[w.model] = f"openvino IR export: {e}"
        if done[w.model]:
            return done[w.model]
        if w.is_chat:                                 # the job's own ids.json
            return None
        ids = out / f"prompt_ids_{w.name}.json"
        if not ids.is_file():
            from benchmarks.systems.kvpress import write_prompt_ids
            write_prompt_ids(w, w.max_batch, ids)
        self._ids[w.name] = ids
        return None

    def sizes(self, prompt_len: int) -> dict[str, int] | None:
        if self.budget_pct is None:
            return None
        sizes = eviction_sizes(prompt_len, self.budget_pct)
        return sizes if self.window is None else {**sizes, "snapkv_window_size": self.window}

    def chat_sizes(self, w: Workload) -> dict[str, int] | None:
        """Eviction sized by the job's mean prompt, every prompt query scored (the longest prompt's)."""
        sizes = self.sizes(w.job.mean_len)
        return None if sizes is None or self.window is not None else {**sizes, "snapkv_window_size": w.prompt_len}

    def chat_batch(self, w: Workload) -> tuple[Candidate | None, str]:
        per_block = BLOCK * kv_bytes_per_token(w.model_config(), self.ov_kv_precision)
        sizes = self.chat_sizes(w)

        def need(b: int) -> int:
            return OV_BASE_BYTES + b * OV_SEQ_BYTES + num_kv_blocks(b, w.prompt_len, w.gen_len, sizes) * per_block
        return largest_fitting(need, w, f"{OV_BASE_BYTES / GIB:.2f} GiB + {self.ov_kv_precision} KV blocks for "
                                        f"prompt {w.prompt_len} + gen {w.gen_len} per sequence")

    def command(self, w: Workload, c: Candidate, gen_len: int, json_path: Path, work: Path) -> list[str]:
        sizes = self.chat_sizes(w) if w.is_chat else self.sizes(w.prompt_len)
        args = [str(CHILD), "--ir", str(ir_dir(w.model)), "--batch", str(c.batch),
                "--kv-precision", self.ov_kv_precision,
                "--num-kv-blocks", str(num_kv_blocks(c.batch, w.prompt_len, gen_len, sizes)), "--json", str(json_path)]
        if w.is_chat:
            args += ["--chat", str(w.job.ids_json)]
        else:
            args += ["--ids", str(self._ids[w.name]), "--gen-len", str(gen_len), "--warmup", str(int(not w.cold_disk))]
        if sizes is not None:
            args += ["--evict-start", str(sizes["start_size"]), "--evict-recent", str(sizes["recent_size"]),
                     "--evict-max", str(sizes["max_cache_size"]), "--snapkv-window", str(sizes["snapkv_window_size"]),
                     "--evict-mode", self.mode]
        return args

    def kv_growth_bytes(self, w: Workload, batch: int, tokens: int) -> int:
        """A probe allocates blocks for its own gen length; the full run `tokens` more per sequence, unless
        eviction caps the cache (then the prompt alone sizes it)."""
        sizes = self.sizes(w.prompt_len)
        probe_gen = w.gen_len - tokens
        extra = blocks_per_seq(w.prompt_len, w.gen_len, sizes) - blocks_per_seq(w.prompt_len, probe_gen, sizes)
        return batch * extra * BLOCK * kv_bytes_per_token(w.model_config(), self.ov_kv_precision)

    def child_metrics(self, raw: dict[str, Any], c: Candidate) -> dict[str, Any]:
        keep = ("prefill_s", "decode_s", "peak_rss_bytes", "step_times_s", "kv_precision", "inference_precision",
                "num_kv_blocks", "kv_cache_bytes", "kv_bytes_per_token", "kv_tokens_per_seq",
                "kv_tokens_per_seq_last_step", "eviction", "max_cache_usage", "prefill_steps",
                "max_num_batched_tokens", "openvino_version", "openvino_genai_version", "threads")
        out = {k: raw.get(k) for k in keep}
        # bytes the allocated cache holds per sequence (what RSS carries), not only what the tokens fill
        out["kv_bytes_per_seq"] = raw["kv_cache_bytes"] / c.batch if raw.get("kv_cache_bytes") else None
        return out
