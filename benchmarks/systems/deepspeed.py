"""`deepspeed`: ZeRO-Inference (ZeRO stage 3 with parameter offload) on transformers `generate`, as in
DeepSpeedExamples' zero_inference and FlexGen's `benchmark/hf_ds/hf_opt.py`. GPU only: on a machine without CUDA
the suite shows this row as skipped ("needs a CUDA GPU").

Parameters are offloaded to CPU memory for the RAM workloads and to NVMe (`offload_param.device = "nvme"`,
under the suite's work folder) for the disk workloads; the model is the workload's: SmolLM2 from our store, or
the OPT shape with random fp16 weights. Timing as the Accelerate peer: prefill = `generate(max_new_tokens=1)`,
decode = a full `generate` minus that. Written to run on a CUDA machine (scripts/gpu_bench.sh); it has not run
on the CPU-only development machines.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.systems.base import Candidate, System  # noqa: E402
from benchmarks.systems.gpu_check import gpu_skip_reason  # noqa: E402
from benchmarks.workloads import Workload  # noqa: E402


class DeepSpeed(System):
    name = "deepspeed"
    kv_grows = True
    kv_dtype_bytes = 2

    def skip_reason(self, w: Workload) -> str | None:
        return gpu_skip_reason("deepspeed", "pip install deepspeed")

    def command(self, w: Workload, c: Candidate, gen_len: int, json_path: Path, work: Path) -> list[str]:
        return ["-m", "benchmarks.systems.deepspeed", "--model", w.model, "--batch", str(c.batch),
                "--prompt-len", str(w.prompt_len), "--gen-len", str(gen_len), "--offload",
                "nvme" if w.cold_disk else "cpu", "--nvme-path", str(work / "ds_nvme"), "--json", str(json_path)]

    def child_metrics(self, raw: dict[str, Any], c: Candidate) -> dict[str, Any]:
        return {k: raw[k] for k in ("prefill_s", "decode_s", "peak_rss_bytes", "peak_gpu_bytes", "kv_bytes_per_seq",
                                    "kv_tokens_per_seq", "step_times_s")}


def build_model(model: str, dtype: Any) -> tuple[Any, Any]:
    """(HF model on CPU, the engine's ModelConfig): SmolLM2's real weights, or an OPT shape with random weights."""
    from flexgen_h2o.models import resolve_model
    cfg = resolve_model(model)
    if cfg.family == "llama":
        from benchmarks.systems.hf_generate import load_smollm2
        return load_smollm2("cpu", dtype)[0], cfg
    from transformers import AutoModelForCausalLM

    from benchmarks.systems.accelerate_child import hf_config
    # from_config (not the constructor) is where transformers enters deepspeed.zero.Init under ZeRO-3
    return AutoModelForCausalLM.from_config(hf_config(cfg), dtype=dtype).eval(), cfg


def run_child(a: argparse.Namespace) -> dict[str, Any]:
    # deepspeed.initialize wants a (one-process) process group; set here, in the child only, so the suite's
    # process (and every other system's environment) never looks distributed
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", "29517")):
        os.environ.setdefault(k, v)
    import deepspeed
    import torch
    from transformers.integrations import HfDeepSpeedConfig

    from flexgen_h2o.frontends.corpus import benchmark_prompts
    from flexgen_h2o.loader import fallback_tokenizer
    from flexgen_h2o.metrics import peak_rss_bytes

    from flexgen_h2o.models import resolve_model
    cfg = resolve_model(a.model)
    h = cfg.hidden_size
    zero: dict[str, Any] = {"stage": 3, "stage3_prefetch_bucket_size": 2 * h * h,
                            "stage3_param_persistence_threshold": h, "stage3_max_live_parameters": 2 * h * h}
    if a.offload == "nvme":
        Path(a.nvme_path).mkdir(parents=True, exist_ok=True)
        zero["offload_param"] = {"device": "nvme", "nvme_path": a.nvme_path, "pin_memory": True,
                                 "buffer_count": 5, "buffer_size": 2 * (1 << 30)}
    else:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    ds_config = {"fp16": {"enabled": True}, "zero_optimization": zero, "steps_per_print": 2000,
                 "train_batch_size": a.batch, "wall_clock_breakdown": False}
    # before the model exists, so that ZeRO-3 partitions (and offloads) each parameter as it is created: built
    # first, an OPT-30B would sit whole in host memory (60 GB fp16) before DeepSpeed ever saw it
    keep = HfDeepSpeedConfig(ds_config)                     # noqa: F841  (must stay alive for ZeRO-3)
    model, _ = build_model(a.model, torch.float16)
    engine = deepspeed.initialize(model=model, config_params=ds_config)[0]
    engine.module.eval()
    tok = fallback_tokenizer()
    ids = torch.tensor(benchmark_prompts(tok, a.batch, a.prompt_len, cfg.vocab_size), device="cuda")

    def timed(n: int) -> tuple[float, Any]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = engine.module.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                         min_new_tokens=n, do_sample=False, pad_token_id=cfg.pad_id)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    timed(1)                                                # warm-up (kernels, allocator)
    prefill_s, _ = timed(1)
    full_s, out = timed(a.gen_len)
    tokens = a.prompt_len + out.shape[1] - ids.shape[1] - 1
    return {"batch": a.batch, "prefill_s": prefill_s, "decode_s": max(full_s - prefill_s, 1e-9), "step_times_s": [],
            "peak_rss_bytes": peak_rss_bytes(), "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
            "kv_bytes_per_seq": tokens * cfg.kv_bytes_per_token(2), "kv_tokens_per_seq": tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.systems.deepspeed", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="opt-1.3b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--offload", choices=("cpu", "nvme"), default="cpu")
    p.add_argument("--nvme-path", default="/tmp/ds_nvme")
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    Path(a.json).write_text(json.dumps(run_child(a), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
