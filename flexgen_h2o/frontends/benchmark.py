"""Benchmark mode: FlexGen's runner (`docs/cli.md` "Benchmark mode") with real prompts and nothing projected by default.

One block of corpus text cut to exactly prompt_len tokens (FlexGen left-padded one short sentence instead),
a warm-up generate (32-token prompts, 2 new tokens: the prefill and one decode step; on a GPU also one prefill
chunk at the real length, warmup_blocks), then the measured run at
the full gen_len with EOS ignored, so every run generates exactly block x gen_len tokens. With --cut-gen-len
only that many tokens run and decode is projected with FlexGen's formula; the log then says `projected: True`.
Batch and prompt modes' metrics and summary lines (run_metrics, summary) use the same definitions.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from flexgen_h2o.config import GenerationConfig
from flexgen_h2o.engine import kv_bytes_read
from flexgen_h2o.frontends.corpus import benchmark_prompts, lee_articles
from flexgen_h2o.metrics import GIB, engine_metrics, fmt_bytes, peak_rss_bytes, reset_peak_rss, throughput
from flexgen_h2o.planner.memory import kv_slot_bytes

WARMUP_PROMPT_LEN = 32          # FlexGen's warm-up prompt length


def corpus_prompts(tokenizer: Any, n: int, prompt_len: int, vocab_size: int) -> tuple[list[list[int]], str]:
    """n prompts of prompt_len real tokens, and where they came from. Without a tokenizer (dummy weights
    before any model was converted) the corpus bytes stand in for token ids: real text statistics, and
    every id is inside the vocabulary."""
    if tokenizer is not None:
        return benchmark_prompts(tokenizer, n, prompt_len, vocab_size), "Lee news corpus, tokenized"
    data = "\n\n".join(lee_articles()).encode("utf-8")
    while len(data) < n * prompt_len:
        data += data
    ids = [b % vocab_size for b in data[:n * prompt_len]]
    return [ids[i * prompt_len:(i + 1) * prompt_len] for i in range(n)], "Lee news corpus as bytes (no tokenizer)"


def project_decode(step_times: list[float], gen_len: int) -> float:
    """FlexGen's project_decode_latency: the first two decode steps as measured, the mean of the rest for the
    remaining gen_len - 3 steps."""
    first, rest = step_times[:2], step_times[2:]
    if not rest:
        return sum(first) / max(len(first), 1) * (gen_len - 1)
    return sum(first) + sum(rest) / len(rest) * (gen_len - 1 - len(first))


def reset_peaks(engine: Any) -> None:
    """Start the measured window: free the warm-up's tensors, then peaks restart at the current use."""
    engine.release()
    for tier in engine.tiers.values():
        tier.reset_peak()
    engine.backend.reset_peak_memory()


def warmup_blocks(prompts: list[list[int]], llm: Any, device_type: str) -> list[list[list[int]]]:
    """The warm-up generates' prompts: FlexGen's, the whole block cut to 32 tokens (the real length where a
    ratio leaves no slot at 32). On a GPU first one prefill chunk at the real length: cuDNN's attention builds a
    plan per shape and the allocator grows to the prompt's transients, one-time costs that would otherwise land
    in the measured prefill (the DeepSpeed peer warms up with its whole block at the real length)."""
    prompt_len = len(prompts[0])
    short = min(prompt_len, WARMUP_PROMPT_LEN)
    try:
        llm.eviction.resolve(short, 2)
    except ValueError:
        short = prompt_len
    blocks = [[p[-short:] for p in prompts]]
    if device_type != "cpu" and short < prompt_len:
        rows = llm.offload.prefill_rows(min(len(prompts), llm.offload.gpu_batch_size), prompt_len, device_type)
        blocks.insert(0, prompts[:rows])
    return blocks


def run_benchmark(llm: Any, prompts: list[list[int]], *, gen_len: int, cut_gen_len: int | None,
                  sampling: dict, warmup: bool, weights_in_tiers: bool, show_sample: bool = False,
                  say: Callable[[str], None] = print) -> dict:
    """Warm up, run the block once, and return every metric (FlexGen's log fields included)."""
    engine, cfg = llm.engine, llm.config
    block, prompt_len = len(prompts), len(prompts[0])
    run_len = cut_gen_len or gen_len
    warmup_s = 0.0
    if warmup:
        t0 = time.perf_counter()
        for warm in warmup_blocks(prompts, llm, engine.device.type):
            engine.generate(warm, GenerationConfig(max_new_tokens=2, stop_at_eos=False))
        warmup_s = time.perf_counter() - t0
    reset_peaks(engine)
    load_peak_rss = peak_rss_bytes()          # loading and warm-up; then a window for the measured run alone
    rss_window = reset_peak_rss()
    read0 = dict(engine.weights.bytes_read)
    gen = GenerationConfig(max_new_tokens=run_len, stop_at_eos=False, **sampling).validate()
    result = engine.generate(prompts, gen)
    m = result.metrics
    kv_bytes = sum(c.nbytes for caches in engine.last_caches for c in caches.values())
    decode_s, projected = m["decode_s"], cut_gen_len is not None
    if projected:
        decode_s = project_decode(m["step_times_s"], gen_len)
    rates = throughput(block, prompt_len, gen_len, m["prefill_s"], decode_s)
    # the same slot accounting as the real cache (K, V, fp32 score, int32 position), every token kept
    full_cache_bytes = cfg.n_layers * block * (prompt_len + gen_len) * kv_slot_bytes(cfg, llm.offload.kv_format)
    metrics = {
        **{k: v for k, v in m.items() if k != "decode_s"}, **rates,
        "mode": "benchmark", "block_size": block, "gpu_batch_size": llm.offload.gpu_batch_size,
        "num_gpu_batches": llm.offload.num_gpu_batches, "prompt_len": prompt_len, "gen_len": gen_len,
        "executed_gen_len": run_len, "decode_s": decode_s, "measured_decode_s": m["decode_s"],
        "total_s": m["prefill_s"] + decode_s, "projected": projected, "warmup_s": warmup_s,
        **engine_metrics(llm, weights_in_tiers, kv_cache_bytes=kv_bytes, full_cache_bytes=full_cache_bytes,
                         hidden_bytes=block * prompt_len * cfg.hidden_size * 2),
        "weights_bytes_read": {k: v - read0.get(k, 0) for k, v in engine.weights.bytes_read.items()},
        # what the decode steps read of the KV (page selection: the pages read and their summaries)
        "kv_bytes_read": dict(kv_bytes_read(engine.last_caches)),
        "kv_bytes_read_per_step": m["kv_bytes_read"] / max(m["decode_steps"], 1),
        "peak_rss_bytes": max(load_peak_rss, peak_rss_bytes()),
        "peak_rss_run_bytes": peak_rss_bytes() if rss_window else None,
        "kv_slots_per_seq": engine.last_plan.capacity,
        "sample_text": result.texts[0] if result.texts else "",
    }
    if show_sample and result.texts and result.texts[0]:      # real weights: show that the text is real
        say(f"\nsample continuation of prompt 0: {' '.join(result.texts[0].split())[:160]!r}")
    say(f"\nthroughput: prefill {rates['prefill_tok_s']:.1f} tok/s | decode {rates['decode_tok_s']:.1f} tok/s | "
        f"total {rates['total_tok_s']:.1f} tok/s  (block {block}, prompt {prompt_len}, gen {gen_len}"
        f"{f', executed {run_len}, decode projected' if projected else ''})")
    say(memory_line(metrics))
    return metrics


def memory_line(m: dict) -> str:
    peaks = " | ".join(f"{k} peak {fmt_bytes(v)}" for k, v in m["tier_peak_bytes"].items())
    run = m.get("peak_rss_run_bytes")
    return (f"memory: {peaks} | KV cache {fmt_bytes(m['kv_cache_bytes'])} | process peak RSS "
            f"{m['peak_rss_bytes'] / GIB:.2f} GiB" + (f" (measured run {run / GIB:.2f} GiB)" if run else ""))


def sizes_line(cfg: Any, est: Any, block: int, prompt_len: int) -> str:
    """FlexGen's size line, with the real KV next to the full-cache size FlexGen printed alone."""
    fmt = est.plan.offload.weight_format
    return (f"model size: {fmt_bytes(est.model_bytes)} {fmt.name} | KV cache: "
            f"{fmt_bytes(est.kv_bytes)} real, {fmt_bytes(est.full_kv_bytes)} full cache | hidden size (prefill): "
            f"{fmt_bytes(block * prompt_len * cfg.hidden_size * 2)} (width {cfg.hidden_size})")


def run_metrics(llm: Any, t: dict, est: Any, mode: str, weights_in_tiers: bool, n_prompts: int) -> dict:
    """Batch and prompt modes: FlexGen's throughput definitions over real (unpadded) prompt tokens."""
    prefill_s, decode_s = t.get("prefill_s", 0.0), t.get("decode_s", 0.0)
    gen_tokens, prompt_tokens = t.get("generated_tokens", 0), t.get("prompt_tokens", 0)
    padded = t.get("padded_prompt_tokens", 0)
    return {"mode": mode, "prompts": n_prompts, "blocks": t.get("blocks", 0),
            "block_size": llm.offload.block_size, "prompt_tokens": prompt_tokens, "padded_prompt_tokens": padded,
            "padding_frac": 1 - prompt_tokens / padded if padded else 0.0, "generated_tokens": gen_tokens,
            "prefill_s": prefill_s, "decode_s": decode_s, "total_s": prefill_s + decode_s,
            "prefill_tok_s": prompt_tokens / max(prefill_s, 1e-9),
            "decode_tok_s": max(gen_tokens - n_prompts, 0) / max(decode_s, 1e-9),
            "total_tok_s": gen_tokens / max(prefill_s + decode_s, 1e-9), "projected": False,
            "kv_bytes_read_per_step": t.get("kv_bytes_read", 0) / max(t.get("decode_steps", 0), 1),
            # continuous refill: join passes, and the share of row-steps that held a prompt (None: blocks)
            "refill_joins": t.get("joins"), "row_occupancy": t.get("row_occupancy"),
            **engine_metrics(llm, weights_in_tiers, kv_cache_bytes=est.kv_bytes, full_cache_bytes=est.full_kv_bytes,
                             hidden_bytes=est.n_seqs * est.prompt_len * llm.config.hidden_size * 2),
            "peak_rss_bytes": peak_rss_bytes()}


def summary(m: dict) -> str:
    return (f"\nthroughput: prefill {m['prefill_tok_s']:.1f} tok/s | decode {m['decode_tok_s']:.1f} tok/s | total "
            f"{m['total_tok_s']:.1f} tok/s  ({m['prompts']} prompt(s) in {m['blocks']} block(s); {m['prompt_tokens']} "
            f"prompt tokens + {m['padding_frac']:.1%} padding; {m['generated_tokens']} generated)"
            + (f"\nrefill: {m['refill_joins']} join passes, rows busy {m['row_occupancy']:.1%} of decode steps"
               if m.get("refill_joins") is not None else ""))
