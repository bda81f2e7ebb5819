"""`flexgen`: the `flexgen==0.1.8` package itself (FMInference/FlexGen @ 19753bc), OPT shapes with dummy weights
(`--path _DUMMY_`), the workload's placement as its six-int `--percent`. GPU only: FlexGen allocates pinned
memory and CUDA streams in its constructors, so without CUDA the row is skipped ("needs a CUDA
GPU"). Written for scripts/gpu_bench.sh; it has not run on the CPU-only development machines.

Child: `python -m benchmarks.systems.flexgen --model opt-1.3b ... --json F` calls `flexgen.flex_opt.run_flexgen`
in-process with its tokenizer load patched out (it fetches `facebook/opt-30b` from the Hub, which offline
machines cannot reach): the stub returns our first Lee-news window as the prompt, which FlexGen repeats for every
sequence as it does with its own test prompt. Throughput comes from its own 5-line log (the same definitions),
peak GPU memory from its "peak gpu mem" line, peak RSS from this process's VmHWM.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.systems.base import Candidate, System  # noqa: E402
from benchmarks.systems.gpu_check import gpu_skip_reason  # noqa: E402
from benchmarks.workloads import Workload  # noqa: E402

LOG_FIELDS = {"prefill_s": r"prefill latency: ([\d.]+) s", "decode_s": r"decode latency: ([\d.]+) s",
              "peak_gpu_gib": r"peak gpu mem: ([\d.]+) GB"}


class FlexGen(System):
    name = "flexgen"
    kv_grows = False           # FlexGen allocates the whole prompt + gen cache up front
    kv_dtype_bytes = 2

    def skip_reason(self, w: Workload) -> str | None:
        reason = gpu_skip_reason("flexgen", "pip install flexgen==0.1.8")
        if reason is None and w.model_config().family != "opt":
            return "flexgen 0.1.8 runs OPT models only (its Llama port is unmerged)"
        return reason

    def command(self, w: Workload, c: Candidate, gen_len: int, json_path: Path, work: Path) -> list[str]:
        return ["-m", "benchmarks.systems.flexgen", "--model", w.model, "--gbs", str(c.gbs), "--num-gpu-batches",
                str(c.num_batches), "--prompt-len", str(w.prompt_len), "--gen-len", str(gen_len), "--percent",
                *map(str, w.percent), "--offload-dir", str(work / "flexgen_offload"), "--json", str(json_path)]

    def child_metrics(self, raw: dict[str, Any], c: Candidate) -> dict[str, Any]:
        return {k: raw[k] for k in ("prefill_s", "decode_s", "peak_rss_bytes", "peak_gpu_bytes", "kv_bytes_per_seq",
                                    "kv_tokens_per_seq", "step_times_s")}


def parse_log(text: str) -> dict[str, float]:
    """The numbers of FlexGen's benchmark log (write_benchmark_log), by field."""
    out = {}
    for key, pattern in LOG_FIELDS.items():
        m = re.search(pattern, text)
        if m is None:
            raise ValueError(f"FlexGen log has no {key!r} line:\n{text}")
        out[key] = float(m.group(1))
    return out


class _StubTokenizer:
    """Stands in for AutoTokenizer's OPT tokenizer: our prompt ids, no Hub access."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __call__(self, prompts: list[str], padding: str = "max_length", max_length: int = 32) -> Any:
        return argparse.Namespace(input_ids=[self.ids[:max_length]])

    def batch_decode(self, ids: Any, skip_special_tokens: bool = True) -> list[str]:
        return [""] * len(ids)


def run_child(a: argparse.Namespace) -> dict[str, Any]:
    import flexgen.flex_opt as fo

    from flexgen_h2o.frontends.corpus import benchmark_prompts
    from flexgen_h2o.loader import fallback_tokenizer
    from flexgen_h2o.metrics import peak_rss_bytes
    from flexgen_h2o.models import resolve_model

    cfg = resolve_model(a.model)
    ids = benchmark_prompts(fallback_tokenizer(), 1, a.prompt_len, cfg.vocab_size)[0]
    fo.AutoTokenizer = argparse.Namespace(from_pretrained=lambda *x, **k: _StubTokenizer(ids))
    parser = argparse.ArgumentParser()
    fo.add_parser_arguments(parser)
    log = Path(a.json).with_suffix(".flexgen.log")
    args = parser.parse_args(["--model", f"facebook/{cfg.name}", "--path", "_DUMMY_", "--offload-dir",
                              a.offload_dir, "--prompt-len", str(a.prompt_len), "--gen-len", str(a.gen_len),
                              "--gpu-batch-size", str(a.gbs), "--num-gpu-batches", str(a.num_gpu_batches),
                              "--percent", *a.percent, "--log-file", str(log)]
                             + (["--compress-weight"] if a.compress_weight else [])
                             + (["--compress-cache"] if a.compress_cache else []))
    Path(a.offload_dir).mkdir(parents=True, exist_ok=True)
    fo.run_flexgen(args)
    got = parse_log(log.read_text())
    n = a.gbs * a.num_gpu_batches
    tokens = a.prompt_len + a.gen_len
    return {"batch": n, "prefill_s": got["prefill_s"], "decode_s": got["decode_s"], "step_times_s": [],
            "peak_rss_bytes": peak_rss_bytes(), "peak_gpu_bytes": int(got["peak_gpu_gib"] * (1 << 30)),
            "kv_bytes_per_seq": tokens * cfg.kv_bytes_per_token(2), "kv_tokens_per_seq": tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.systems.flexgen", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="opt-1.3b")
    p.add_argument("--gbs", type=int, default=1)
    p.add_argument("--num-gpu-batches", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--percent", nargs=6, default=["100", "0", "100", "0", "100", "0"])
    p.add_argument("--offload-dir", default="/tmp/flexgen_offload")
    p.add_argument("--compress-weight", action="store_true", help="FlexGen's 4-bit group-wise weights")
    p.add_argument("--compress-cache", action="store_true", help="FlexGen's 4-bit group-wise KV cache")
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    Path(a.json).write_text(json.dumps(run_child(a), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
