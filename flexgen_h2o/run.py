"""`python -m flexgen_h2o.run`: generate with offloading and an H2O KV cache, print text, throughput, memory.

Without --prompt and with --prompt-len, it is FlexGen's benchmark: real corpus text cut to --prompt-len tokens
for a whole block. With --prompt (repeatable), it generates for those prompts. Bad input: one line, exit 2.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")        # spin-waiting made small ops 70x slower on busy VMs
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

from flexgen_h2o.config import ConfigError, GenerationConfig, OffloadPolicy  # noqa: E402

DEFAULT_PROMPTS = ("What is the capital of France?", "Write a short poem about the sea.",
                   "Explain in two sentences why the sky is blue.", "Give three tips for learning a language.")


def str2bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {v!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flexgen_h2o.run", allow_abbrev=False, description=__doc__)
    p.add_argument("--model", default="smollm2-135m", help="preset name, HF id, or local HF checkpoint folder")
    p.add_argument("--path", help="weight store folder (default ~/.cache/flexgen_h2o/<model>)")
    p.add_argument("--dummy-weights", action="store_true", help="deterministic random weights, nothing on disk")
    p.add_argument("--offload-dir", default=os.path.expanduser("~/flexgen_offload_dir"),
                   help="root for disk-tier files; each run uses its own subfolder, removed at exit")
    p.add_argument("--percent", nargs=6, type=float, default=[100, 0, 100, 0, 100, 0],
                   metavar=("W_GPU", "W_CPU", "CACHE_GPU", "CACHE_CPU", "ACT_GPU", "ACT_CPU"),
                   help="placement percents; disk takes the rest of each pair")
    p.add_argument("--gpu-batch-size", type=int, default=4)
    p.add_argument("--num-gpu-batches", type=int, default=1)
    p.add_argument("--overlap", type=str2bool, default=True)
    p.add_argument("--pin-weight", type=str2bool, default=True)
    p.add_argument("--cpu-cache-compute", action="store_true")
    p.add_argument("--sep-layer", type=str2bool, default=True)
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when present)")
    kv = p.add_argument_group("KV cache (H2O)")
    kv.add_argument("--hh-ratio", type=float, help="heavy hitters = int(r * prompt_len), as the H2O FlexGen port")
    kv.add_argument("--recent-ratio", type=float, help="recent window = int(r * prompt_len); default: --hh-ratio")
    kv.add_argument("--hh-size", type=int, help="heavy-hitter slots (overrides --hh-ratio)")
    kv.add_argument("--recent-size", type=int, help="recent slots (overrides --recent-ratio)")
    kv.add_argument("--sink-size", type=int, help="first tokens always kept (attention sinks)")
    kv.add_argument("--kv-budget", type=int, help="total slots, split evenly heavy/recent")
    kv.add_argument("--h2o-variant", choices=("exact", "port"), default="exact",
                    help="victim rule: exact H2O, or the FlexGen port's approximation")
    kv.add_argument("--policy", choices=("h2o", "local", "sink", "random"), default="h2o",
                    help="eviction policy when a budget is given")
    kv.add_argument("--full-cache", action="store_true", help="no eviction")
    kv.add_argument("--position-rolling", action="store_true",
                    help="Llama: rotate kept keys by their rank each step (runs past the context window)")
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few built-in questions")
    g.add_argument("--prompt-len", type=int, help="benchmark mode: corpus text cut to this many tokens")
    g.add_argument("--gen-len", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    o = p.add_argument_group("output")
    o.add_argument("--log-file", help="append FlexGen's 5-line log here")
    o.add_argument("--metrics-json", help="write the run's metrics as JSON")
    return p


def eviction_from_args(a: argparse.Namespace):
    from flexgen_h2o.kv import EvictionConfig
    sizes = dict(hh_ratio=a.hh_ratio, recent_ratio=a.recent_ratio, hh_size=a.hh_size, recent_size=a.recent_size,
                 sink_size=a.sink_size, kv_budget=a.kv_budget)
    if a.full_cache or all(v is None for v in sizes.values()):
        return EvictionConfig(policy="full", position_rolling=a.position_rolling)
    policy = "h2o-port" if (a.policy == "h2o" and a.h2o_variant == "port") else a.policy
    return EvictionConfig(policy=policy, position_rolling=a.position_rolling, seed=a.seed, **sizes)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (ConfigError, ValueError, FileNotFoundError, OSError) as e:   # one line, exit 2, nothing written
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    import torch

    from flexgen_h2o.engine import Engine
    from flexgen_h2o.frontends.corpus import benchmark_prompts
    from flexgen_h2o.kv import describe
    from flexgen_h2o.loader import load_model
    from flexgen_h2o.metrics import GIB, flexgen_log, fmt_bytes, peak_rss_bytes, throughput
    from flexgen_h2o.models import ModelNameError
    from flexgen_h2o.weights import WeightStoreError

    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    offload = OffloadPolicy.from_percent(args.percent, gpu_batch_size=args.gpu_batch_size,
                                         num_gpu_batches=args.num_gpu_batches, overlap=args.overlap,
                                         pin_weight=args.pin_weight, cpu_cache_compute=args.cpu_cache_compute,
                                         sep_layer=args.sep_layer).validate()
    gen = GenerationConfig(max_new_tokens=args.gen_len, temperature=args.temperature, top_p=args.top_p,
                           top_k=args.top_k, seed=args.seed, stop=tuple(args.stop)).validate()
    eviction = eviction_from_args(args)
    try:
        loaded = load_model(args.model, path=args.path, dummy_weights=args.dummy_weights,
                            dummy_on_disk=offload.tier_fractions("weights")[2] > 0)
    except (ModelNameError, WeightStoreError) as e:
        raise ConfigError(str(e)) from None
    cfg, tok = loaded.config, loaded.tokenizer
    if args.prompt_len:
        if tok is None:
            raise ConfigError("benchmark mode needs a tokenizer: run `make run` once (it converts the embedded "
                              "model, whose tokenizer dummy-weight runs borrow)")
        prompts = benchmark_prompts(tok, offload.block_size, args.prompt_len, cfg.vocab_size)
        texts = None
    else:
        if tok is None:
            raise ConfigError(f"{args.model} has no tokenizer in its store; pass --prompt-len for a benchmark run")
        texts = args.prompt or list(DEFAULT_PROMPTS)
        if getattr(tok, "chat_template", None):
            prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False) for t in texts]
        else:
            prompts = [tok.encode(t) for t in texts]
    decode = (lambda ids: tok.decode(ids, skip_special_tokens=True)) if tok is not None else None
    prompt_len = max(len(p) for p in prompts)
    budget = eviction.resolve(prompt_len, gen.max_new_tokens)
    print(describe(budget, prompt_len, gen.max_new_tokens, cfg.kv_bytes_per_token() * len(prompts)))
    with Engine(cfg, loaded.read, offload=offload, eviction=eviction, device=args.device,
                offload_dir=args.offload_dir, decode=decode, locate=loaded.locate) as engine:
        result = engine.generate(prompts, gen)
        kv_bytes = sum(c.nbytes for caches in engine.last_caches for c in caches.values())
        tier_peaks = {name: tier.peak_bytes for name, tier in engine.tiers.items()}
    if texts is not None:
        for t, out in zip(texts, result.texts):
            print(f"\n>>> {t}\n{out.strip()}")
    m = result.metrics
    n_gen = max(len(t) for t in result.token_ids)
    rates = throughput(len(prompts), prompt_len, n_gen, m["prefill_s"], m["decode_s"])
    weights_by_tier = engine.weights.summary()
    metrics = {**m, **rates, "model": cfg.name, "block_size": len(prompts), "prompt_len": prompt_len,
               "gen_len": n_gen, "model_bytes": cfg.n_params() * 2, "kv_cache_bytes": kv_bytes,
               "full_cache_bytes": cfg.kv_bytes_per_token() * len(prompts) * (prompt_len + gen.max_new_tokens),
               "hidden_bytes": len(prompts) * prompt_len * cfg.hidden_size * 2,
               # resident weights are placed once, outside the tier pools: add them to the compute peak
               "peak_compute_bytes": tier_peaks.get("compute", 0) + weights_by_tier["compute"],
               "tier_peak_bytes": tier_peaks,
               "weights_by_tier": weights_by_tier, "weights_bytes_read": dict(engine.weights.bytes_read),
               "peak_rss_bytes": peak_rss_bytes(), "projected": False,
               "percent": list(offload.percent), "eviction": eviction.policy}
    print(f"\nthroughput: prefill {rates['prefill_tok_s']:.1f} tok/s | decode {rates['decode_tok_s']:.1f} tok/s | "
          f"total {rates['total_tok_s']:.1f} tok/s  (block {len(prompts)}, prompt {prompt_len}, gen {n_gen})")
    print("memory: " + " | ".join(f"{k} peak {fmt_bytes(v)}" for k, v in tier_peaks.items())
          + f" | KV cache {fmt_bytes(kv_bytes)} | process peak RSS {metrics['peak_rss_bytes'] / GIB:.2f} GiB")
    log = flexgen_log(metrics)
    print(log, end="")
    if args.log_file:
        with open(args.log_file, "a") as f:
            f.write(log)
    if args.metrics_json:
        with open(args.metrics_json, "w") as f:
            json.dump(metrics, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
