"""kvpress (NVIDIA) as a peer: ObservedAttentionPress (accumulated observed attention, its H2O-like press) and
StreamingLLMPress (sinks + recent window), at the same KV budgets as ours-h2o.

kvpress 0.5.x pins transformers < 5.3, which would downgrade the main environment, so it lives in its own
virtualenv (ANCHORS §6.5), created on first use under ~/.cache/flexgen_h2o/venvs/kvpress with the main
environment's exact torch build (same kernels, so the comparison measures the algorithms). The case runs
`kvpress_child.py` with that venv's interpreter; the child reads SmolLM2 from our converted store (fp16 .npy +
manifest) and the prompt ids from a file the parent writes, so its inputs are the very tokens ours and hf get.

Budget mapping: ours-h2o-20 keeps 20 % of the prompt (10 % heavy + 10 % recent); kvpress-*-20 runs with
compression_ratio 0.8, which keeps 20 % of the prompt. kvpress compresses at prefill only, so its cache then
grows by one token per decode step; ours stays fixed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.systems import venvs
from benchmarks.systems.base import Candidate, System
from benchmarks.workloads import Workload

KVPRESS_SPEC = "kvpress==0.5.5"          # the version ANCHORS §6.5 checked on this machine kind
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

    _venv_reason: list[str | None] = []       # one attempt per suite run, shared by the six variants

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
