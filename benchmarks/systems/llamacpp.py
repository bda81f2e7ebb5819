"""llama.cpp as a peer: `llama-batched-bench`, built from the source `llama-cpp-python` vendors
(`benchmarks.systems.llamacpp_build`), on the embedded SmolLM2 GGUF requantized once per type.

- `llamacpp-f16`: the GGUF as F16. The embedded file is Q4_1; its values dequantized are exactly what our store
  holds in fp16, so both systems multiply the same weights.
- `llamacpp-q8_0`, `llamacpp-q4_0`: `llama-quantize`'s Q8_0 and Q4_0 (its default mix: a user's Q4_0 file keeps
  some tensors at higher precision), beside our int8 and int4 weights.

Each case: `llamacpp_child.py` runs `llama-batched-bench -npp P -ntg G-1 -npl B -fa on -t T`, one sequence per
prompt (no shared prompt), on random token ids (its own generator; throughput does not depend on the ids), and
reads its JSONL line: the prompt pass's seconds are prefill_s, the G-1 decode steps' seconds decode_s, so the
rates are FlexGen's, as for every system (`base.rates`: the prompt pass yields the first token). The KV cache
(f16, llama.cpp's default) is allocated up front for `-c = B x ctx_per_seq`, so RSS does not grow as tokens are
generated; a shorter probe allocates less (`kv_growth_bytes`). The context per sequence is rounded up to 256
tokens, llama.cpp's padding. No per-step times: batched-bench reports its phases only.

`make test` and the quick suite never build llama.cpp: without a build its rows are skipped with the command that
builds it. A full suite run builds it once (about 18 minutes on 2 cores) in `prepare`.
"""
from __future__ import annotations

import fcntl
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.systems import llamacpp_build as build
from benchmarks.systems.base import Candidate, System
from benchmarks.workloads import Workload

CHILD = Path(__file__).resolve().parent / "llamacpp_child.py"
GGUF_TYPES = {"f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0"}
CTX_PAD = 256


def ctx_per_seq(prompt_len: int, gen_len: int) -> int:
    return -(-(prompt_len + gen_len) // CTX_PAD) * CTX_PAD


def gguf_dir() -> Path:
    from benchmarks.model_formats import formats_root
    return formats_root() / f"smollm2-135m-gguf-{build.VERSION}"


def quantized_gguf(kind: str, log: Path | None = None) -> tuple[Path, str | None]:
    """The embedded GGUF requantized to `kind` once (`llama-quantize --allow-requantize`), written to a temp name
    and renamed, so a killed run leaves no half file under the final name. (path, None) or (path, reason)."""
    from flexgen_h2o.weights.embedded import embedded_gguf_path
    dest = gguf_dir() / f"SmolLM2-135M-Instruct.{GGUF_TYPES[kind]}.gguf"
    if dest.is_file():
        return dest, None
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dest.is_file():
            return dest, None
        tmp = dest.with_suffix(".partial")
        cmd = [str(build.tool_path("llama-quantize")), "--allow-requantize", str(embedded_gguf_path()), str(tmp),
               GGUF_TYPES[kind]]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if log is not None:
            log.write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
        if proc.returncode != 0 or not tmp.is_file():
            tmp.unlink(missing_ok=True)
            return dest, f"llama-quantize {GGUF_TYPES[kind]}: {build.last_line(proc.stdout + proc.stderr)}"
        tmp.rename(dest)
    return dest, None


class LlamaCpp(System):
    kv_grows = False              # the whole context's KV is allocated before the first step
    kv_dtype_bytes = 2            # f16 K and V, llama.cpp's default cache type

    def __init__(self, kind: str = "f16") -> None:
        self.kind = kind
        self.name = f"llamacpp-{kind}"
        self._gguf: Path | None = None

    def skip_reason(self, w: Workload) -> str | None:
        if w.model != "smollm2-135m":
            return "llama.cpp runs the embedded SmolLM2 GGUF; this workload's model has no GGUF here"
        if w.is_smoke:                # the quick suite and make test never build it (module doc)
            return build.missing_reason()
        return None

    _built: list[str | None] = []     # one build attempt per suite run, shared by the three variants

    def prepare(self, w: Workload, env: dict[str, str], out: Path) -> str | None:
        if not LlamaCpp._built:
            LlamaCpp._built.append(build.ensure_build(say=lambda m: print(f"  {m}", flush=True)))
        if LlamaCpp._built[0]:
            return LlamaCpp._built[0]
        self._gguf, why = quantized_gguf(self.kind, log=out / f"llamacpp_quantize_{self.kind}.log")
        return why

    def resident_weight_bytes(self, cfg: Any, offloaded_bytes: float) -> float:
        """It multiplies the file's own blocks (F16, Q8_0, Q4_0): the roofline reads the GGUF's bytes."""
        return float(self._gguf.stat().st_size) if self._gguf else super().resident_weight_bytes(cfg, 0)

    def command(self, w: Workload, c: Candidate, gen_len: int, json_path: Path, work: Path) -> list[str]:
        return [str(CHILD), "--bench", str(build.tool_path("llama-batched-bench")), "--model", str(self._gguf),
                "--prompt-len", str(w.prompt_len), "--gen-len", str(gen_len), "--batch", str(c.batch),
                "--ctx", str(c.batch * ctx_per_seq(w.prompt_len, gen_len)), "--json", str(json_path)]

    def kv_growth_bytes(self, w: Workload, batch: int, tokens: int) -> int:
        """The probe allocated the context of its own gen length; the full run allocates more."""
        extra = ctx_per_seq(w.prompt_len, w.gen_len) - ctx_per_seq(w.prompt_len, w.gen_len - tokens)
        return batch * extra * w.model_config().kv_bytes_per_token(self.kv_dtype_bytes)

    def child_metrics(self, raw: dict[str, Any], c: Candidate) -> dict[str, Any]:
        keep = ("prefill_s", "decode_s", "peak_rss_bytes", "kv_bytes_per_seq", "n_ctx", "n_batch", "n_ubatch",
                "flash_attn", "threads", "gguf_type", "bench_line")
        return {k: raw.get(k) for k in keep}
