"""`hf`: transformers `generate` with its default cache (DynamicCache) and attention (sdpa), fp32 on CPU.

Child: `python -m benchmarks.systems.hf_generate --model smollm2-135m --batch B --prompt-len P --gen-len G
--json F`. SmolLM2 is built as a LlamaForCausalLM from our converted store (the same real weights the
engine reads), prompts are the engine's benchmark prompts (Lee news windows of
exactly P tokens, no padding), greedy, EOS ignored so every sequence generates G tokens.
Timing: a LogitsProcessor stamps each generated token; prefill = generate start -> first token, each decode step
= the gap between consecutive stamps (FlexGen's split). A 32-token, 2-new-token warm-up runs first, as the
engine's benchmark mode does. Peak RSS is the process's VmHWM (loading included, as for every system).

The chat workload (`--chat IDS_JSON`): the job's prompts in order in fixed batches (left padding), greedy, stop
at EOS; a batch ends when its longest answer does (no refill). Batch 16 unless `--batch hf=N` says otherwise.
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
from benchmarks.workloads import Workload  # noqa: E402

GIB = 1 << 30
CHAT_BATCH = 16


class HFGenerate(System):
    name = "hf"
    kv_grows = True
    kv_dtype_bytes = 4            # the cache holds the fp32 compute dtype
    runs_chat = True

    def skip_reason(self, w: Workload) -> str | None:
        cfg = w.model_config()
        if w.cold_disk:
            need = cfg.n_params() * 4
            over = f"; its {need / GIB:.1f} GiB of fp32 weights exceed the budget" if need > w.budget_bytes else ""
            return ("plain generate keeps every weight in RAM, which a weights-on-disk workload rules out"
                    f"{over}; Accelerate's row is HF with disk offload")
        if w.dummy or cfg.family != "llama" or w.model != "smollm2-135m":
            return "the hf peer loads SmolLM2's real weights only"
        return None

    def chat_batch(self, w: Workload) -> tuple[Candidate | None, str]:
        b = min(CHAT_BATCH, w.max_batch)
        return Candidate(b, b), f"fixed batches of {b} prompts in order; --batch hf=N sets another"

    def command(self, w: Workload, c: Candidate, gen_len: int, json_path: Path, work: Path) -> list[str]:
        head = ["-m", "benchmarks.systems.hf_generate", "--model", w.model, "--batch", str(c.batch)]
        if w.is_chat:
            return head + ["--chat", str(w.job.ids_json), "--json", str(json_path)]
        return head + ["--prompt-len", str(w.prompt_len), "--gen-len", str(gen_len), "--json", str(json_path)]

    def child_metrics(self, raw: dict[str, Any], c: Candidate) -> dict[str, Any]:
        return {k: raw[k] for k in ("prefill_s", "decode_s", "peak_rss_bytes", "peak_gpu_bytes", "kv_bytes_per_seq",
                                    "kv_tokens_per_seq", "step_times_s", "attn_implementation")}


def load_smollm2(device: str, dtype: Any) -> tuple[Any, Any]:
    """SmolLM2 as a LlamaForCausalLM from our converted store, filled one tensor at a time: building a whole
    state dict first would double the loading peak that the budget counts."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from flexgen_h2o.loader import load_model
    loaded = load_model("smollm2-135m", progress=False)
    c = loaded.config
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.n_layers,
                      intermediate_size=c.ffn_size, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                      head_dim=c.head_dim, max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps,
                      tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                      bos_token_id=c.bos_id, eos_token_id=c.eos_id, pad_token_id=c.pad_id)
    model = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():       # the tied lm_head is the embedding parameter
            param.copy_(torch.from_numpy(np.array(loaded.read(name.removeprefix("model.")))))
    return model.to(device).eval(), loaded.tokenizer


def run_child(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

    from flexgen_h2o.frontends.corpus import benchmark_prompts
    from flexgen_h2o.metrics import peak_rss_bytes

    if a.model != "smollm2-135m":
        raise SystemExit(f"error: the hf peer loads smollm2-135m only, not {a.model}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32    # fp16 matmul is ~500x slower on CPU
    model, tok = load_smollm2(device, dtype)
    ids = torch.tensor(benchmark_prompts(tok, a.batch, a.prompt_len, model.config.vocab_size), device=device)

    class Clock(LogitsProcessor):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            if device == "cuda":
                torch.cuda.synchronize()
            self.stamps.append(time.perf_counter())
            return scores

    def generate(x: Any, n: int, cache: Any, clock: Any = None) -> Any:
        with torch.inference_mode():
            return model.generate(x, attention_mask=torch.ones_like(x), past_key_values=cache, max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=2, eos_token_id=None,
                                  logits_processor=LogitsProcessorList([clock] if clock else []))

    if a.warmup:
        generate(ids[:, :32], 2, DynamicCache())
    clock, cache = Clock(), DynamicCache()
    t0 = time.perf_counter()
    out = generate(ids, a.gen_len, cache, clock)
    s = clock.stamps
    layers = getattr(cache, "layers", [])
    kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)
    return {"batch": a.batch, "prompt_len": a.prompt_len, "gen_len": out.shape[1] - ids.shape[1],
            "prefill_s": s[0] - t0, "decode_s": s[-1] - s[0], "step_times_s": [y - x for x, y in zip(s, s[1:])],
            "peak_rss_bytes": peak_rss_bytes(),
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
            "kv_bytes_per_seq": kv_bytes / a.batch, "kv_tokens_per_seq": layers[0].keys.shape[2] if layers else 0,
            "attn_implementation": model.config._attn_implementation, "threads": torch.get_num_threads()}


def run_chat(a: argparse.Namespace) -> dict[str, Any]:
    """The chat job in fixed batches: per prompt the generated token count (EOS counted) and "eos" or
    "length", the generation time and the process's VmHWM."""
    import torch

    from flexgen_h2o.metrics import peak_rss_bytes
    job = json.loads(Path(a.chat).read_text())
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
            lengths.append(row.index(eos) + 1 if eos in row[:n] else min(len(row), n))
            finish.append("eos" if eos in row[:n] else "length")
        batches.append({"size": len(chunk), "width": width, "steps": len(new[0]), "s": time.perf_counter() - tb})
    return {"batch": a.batch, "prompts": len(prompts), "lengths": lengths, "finish": finish,
            "load_s": t0 - t_load, "gen_s": time.perf_counter() - t0, "batches": batches,
            "peak_rss_bytes": peak_rss_bytes(), "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.systems.hf_generate", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--chat", metavar="IDS_JSON", help="the chat workload's job (benchmarks/chat_job.py) instead")
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    Path(a.json).write_text(json.dumps(run_chat(a) if a.chat else run_child(a), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
