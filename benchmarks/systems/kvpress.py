"""kvpress (NVIDIA) as a peer: ObservedAttentionPress (accumulated observed attention, its H2O-like press) and
StreamingLLMPress (sinks + recent window), at the same KV budgets as ours-h2o.

kvpress 0.5.x pins transformers < 5.3, which would downgrade the main environment, so it lives in its own
virtualenv, created on first use under ~/.cache/flexgen_h2o/venvs/kvpress with the main
environment's exact torch build (same kernels, so the comparison measures the algorithms). The case runs
`kvpress_child.py` with that venv's interpreter; the child reads SmolLM2 from our converted store (fp16 .npy +
manifest) and the prompt ids from a file the parent writes, so its inputs are the very tokens ours and hf get.

Budget mapping: ours-h2o-20 keeps 20 % of the prompt (10 % heavy + 10 % recent); kvpress-*-20 runs with
compression_ratio 0.8, which keeps 20 % of the prompt. Those presses compress at prefill only, so their cache then
grows by one token per decode step; ours stays fixed. `kvpress-decoding-20` (KVPressDecoding) is kvpress's
decode-time eviction at ours' exact slot count, so its cache stays fixed too.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.systems import venvs
from benchmarks.systems.base import Candidate, System
from benchmarks.workloads import Workload

KVPRESS_SPEC = "kvpress==0.5.5"          # the version the suite's runs used (docs/suite.md "Systems")
CHILD = Path(__file__).resolve().parent / "kvpress_child.py"
PRESSES = {"observed": "ObservedAttentionPress", "streaming": "StreamingLLMPress"}


def venv_dir() -> Path:
    return venvs.venv_root("kvpress")


def venv_python(root: Path | None = None) -> Path:
    return venvs.venv_python(root or venv_dir())


def recipe() -> list[list[str]]:
    return [[venvs.PY, "-m", "pip", "install", "--quiet", venvs.torch_pin()],
            [venvs.PY, "-m", "pip", "install", "--quiet", KVPRESS_SPEC, "transformers<5.3", "numpy"],
            [venvs.PY, "-c", "import kvpress, transformers, torch; print(kvpress.__name__, transformers.__version__)"]]


def ensure_venv(root: Path | None = None, log: Path | None = None) -> str | None:
    """The kvpress virtualenv, created once (benchmarks/systems/venvs.py). None when usable, else the reason."""
    return venvs.ensure_venv("kvpress", recipe(), root=root or venv_dir(), log=log)


def write_prompt_ids(w: Workload, n: int, path: Path) -> Path:
    """The engine's benchmark prompts (Lee news windows of exactly prompt_len tokens), the first n."""
    from flexgen_h2o.frontends.corpus import benchmark_prompts
    from flexgen_h2o.loader import load_tokenizer
    from flexgen_h2o.weights import default_store_path
    cfg = w.model_config()
    tok = load_tokenizer(default_store_path(w.model))
    if tok is None:
        raise RuntimeError(f"no tokenizer in the {w.model} store: run `make run` once")
    path.write_text(json.dumps(benchmark_prompts(tok, n, w.prompt_len, cfg.vocab_size)))
    return path


class KVPress(System):
    kv_grows = True               # compressed at prefill, then one more token per decode step
    kv_dtype_bytes = 4            # DynamicCache in the fp32 compute dtype

    def __init__(self, press: str, budget_pct: int) -> None:
        self.press, self.budget_pct = press, budget_pct
        self.name = f"kvpress-{press}-{budget_pct}"
        self._ids: dict[str, Path] = {}

    def skip_reason(self, w: Workload) -> str | None:
        if w.dummy or w.model_config().family != "llama":
            return "kvpress runs Llama-family models from our converted store; this workload is a dummy OPT"
        return None

    def python(self) -> str:
        return str(venv_python())

    _venv_reason: list[str | None] = []       # one attempt per suite run, shared by every variant

    def prepare(self, w: Workload, env: dict[str, str], out: Path) -> str | None:
        if not KVPress._venv_reason:
            KVPress._venv_reason.append(ensure_venv(log=out / "kvpress_venv.log"))
        if KVPress._venv_reason[0]:
            return KVPress._venv_reason[0]
        ids = out / f"prompt_ids_{w.name}.json"
        if not ids.is_file():
            write_prompt_ids(w, w.max_batch, ids)
        self._ids[w.name] = ids
        return None

    def command(self, w: Workload, c: Candidate, gen_len: int, json_path: Path, work: Path) -> list[str]:
        from flexgen_h2o.weights import default_store_path
        return [str(CHILD), "--store", str(default_store_path(w.model)), "--ids", str(self._ids[w.name]),
                "--batch", str(c.batch), "--gen-len", str(gen_len), "--press", PRESSES[self.press],
                "--compression-ratio", f"{1 - self.budget_pct / 100:g}", "--warmup", str(int(not w.cold_disk)),
                "--json", str(json_path)]

    def child_metrics(self, raw: dict[str, Any], c: Candidate) -> dict[str, Any]:
        return {k: raw[k] for k in ("prefill_s", "decode_s", "peak_rss_bytes", "kv_bytes_per_seq",
                                    "kv_tokens_per_seq", "step_times_s", "attn_implementation",
                                    "transformers_version", "kvpress_version")}


def h2o_budget(w: Workload, budget_pct: int) -> int:
    """The slots ours-h2o-{budget_pct} keeps per (sequence, KV head) after every step for this workload's prompt,
    from the engine's own Budget: 2 * int(prompt_len * pct / 200) (102 at prompt 512, 408 at 2048, 12 at the
    smoke's 64). While a step runs one more slot holds the new token (ours' capacity, kvpress' cache before the
    hook evicts), so both attend over budget + 1 tokens."""
    from flexgen_h2o.kv import EvictionConfig
    return EvictionConfig(policy="h2o", hh_ratio=budget_pct / 200).resolve(w.prompt_len, w.gen_len).budget


class KVPressDecoding(KVPress):
    """kvpress's decode-time eviction, its closest to H2O: PrefillDecodingPress(prefilling_press=
    ObservedAttentionPress, decoding_press=DecodingPress(ObservedAttentionPress)). The prefill press keeps exactly
    h2o_budget() tokens per KV head; then after every `compression_interval` decode steps the DecodingPress hook
    (it runs after each layer's attention) scores the cache with that layer's observed attention and keeps the top
    target_size, so the cache is bounded at ours' slot count.

    compression_interval = 1 (evict after every step), as H2O does: kvpress accepts it (`> 0` is its only check),
    the cache then never exceeds target + 1 inside a step and ends every step at target, and the cost is a topk +
    gather per layer per step (in Python, per layer), which the child times as decode_press_s: 2.7-3.2 s of a
    17-19 s decode (15-17 %) at batch 8, prompt 512, gen 32 on the 2-core VM. A longer interval would let the
    cache reach target + interval - 1 and evict in bursts; it would not score more: the scorer only sees the
    attention of the step that triggers the compression.

    ObservedAttentionPress is the scorer because it is the one kvpress ties to H2O and DecodingPress accepts any
    ScorerPress; it needs eager attention. Unlike H2O it keeps no running sum: each eviction scores the current
    query's attention only, divided by kvpress's prefill normalisation (n_tokens - i for key i, meant for causal
    prefill rows), which at q_len 1 favours recent keys: after 128 steps at prompt 512, 2/3 of layer 0's kept
    slots lay among the last 102 positions and the first 16, which the prefill press had kept, were nearly all
    gone (0.5 % of the kept slots, against 4.3 % without decoding eviction). No recent window is reserved.
    hidden_states_buffer_size = 0: this scorer reads the attention weights, never the buffered hidden states.
    """
    kv_grows = False             # bounded: evicted back to target_size after every compression_interval steps
    kv_fixed_tokens = True       # attends over target (+ the new token) at every step, as H2O does

    def __init__(self, budget_pct: int, scorer: str = "observed", compression_interval: int = 1) -> None:
        super().__init__(scorer, budget_pct)
        if compression_interval < 1:
            raise ValueError(f"compression_interval must be >= 1, got {compression_interval}")
        self.compression_interval = compression_interval
        self.name = f"kvpress-decoding-{budget_pct}"

    def target_size(self, w: Workload) -> int:
        return h2o_budget(w, self.budget_pct)

    def command(self, w: Workload, c: Candidate, gen_len: int, json_path: Path, work: Path) -> list[str]:
        args = super().command(w, c, gen_len, json_path, work)
        i = args.index("--compression-ratio")
        args[i:i + 2] = ["--target-size", str(self.target_size(w)), "--compression-interval",
                         str(self.compression_interval), "--hidden-states-buffer-size", "0"]
        return args

    def kv_growth_bytes(self, w: Workload, batch: int, tokens: int) -> int:
        """Between evictions the cache holds up to compression_interval - 1 tokens over its target, so a probe
        can miss at most that many rows per sequence (an upper bound); at interval 1 nothing grows."""
        rows = min(max(tokens, 0), self.compression_interval - 1)
        return batch * rows * w.model_config().kv_bytes_per_token(self.kv_dtype_bytes)

    def child_metrics(self, raw: dict[str, Any], c: Candidate) -> dict[str, Any]:
        return {**super().child_metrics(raw, c),
                **{k: raw[k] for k in ("target_size", "kv_tokens_max_decode", "kv_tokens_range", "decode_press_s",
                                       "press_config", "peak_rss_prefill_bytes")}}


KEEP_CHILD = Path(__file__).resolve().parent / "kvpress_keep_child.py"
KEEP_PRESSES = ("snapkv", "tova", "adakv-snapkv")


def keep_sets(ids: list[list[int]], press: str, compression_ratio: float, window_size: int = 64,
              kernel_size: int = 5, alpha_safeguard: float | None = None, store: Path | None = None,
              timeout_s: float = 1800.0) -> dict:
    """Which prompt keys kvpress's `press` (snapkv, tova, adakv-snapkv) keeps at prefill, per (prompt, layer, KV
    head), on SmolLM2 in fp32: the outside check of our eviction scorers. Runs kvpress_keep_child.py (one batch-1
    prefill per prompt) in the kvpress venv and returns its JSON: prompts[p]["kept"][layer][kv_head] (sorted
    indices), prompts[p]["scores"][layer][kv_head], n_kept, settings and versions (the child's docstring says
    what each press keeps). The prompts must share one length. The venv is not created here (that runs pip):
    call ensure_venv() first."""
    import os
    import subprocess
    import tempfile
    if press not in KEEP_PRESSES:
        raise ValueError(f"press must be one of {KEEP_PRESSES}, got {press!r}")
    py = venv_python()
    if not py.is_file():
        raise RuntimeError(f"no kvpress virtualenv at {venv_dir()}: run benchmarks.systems.kvpress.ensure_venv()")
    if store is None:
        from flexgen_h2o.weights import default_store_path
        store = default_store_path("smollm2-135m")
    with tempfile.TemporaryDirectory(prefix="kvpress_keep_") as tmp:      # removed on every exit path
        ids_path, out = Path(tmp) / "ids.json", Path(tmp) / "keep.json"
        ids_path.write_text(json.dumps([[int(t) for t in p] for p in ids]))
        cmd = [str(py), str(KEEP_CHILD), "--store", str(store), "--ids", str(ids_path), "--press", press,
               "--compression-ratio", repr(float(compression_ratio)), "--window-size", str(window_size),
               "--kernel-size", str(kernel_size), "--json", str(out)]
        if alpha_safeguard is not None:
            cmd += ["--alpha-safeguard", repr(float(alpha_safeguard))]
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"kvpress keep child ({press}) ran past {timeout_s:g} s") from e
        if proc.returncode != 0 or not out.is_file():
            tail = "\n".join(proc.stderr.strip().splitlines()[-20:]) or "(no stderr)"
            raise RuntimeError(f"kvpress keep child ({press}) failed with exit status {proc.returncode}:\n{tail}")
        return json.loads(out.read_text())
