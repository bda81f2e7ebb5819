"""Where does H2O's perplexity gap come from? A bug check against the masked reference, then ablations.

    python scripts/ppl_gap.py                                   # 4 Wikipedia windows of 448 + 64, 20 % budget
    python scripts/ppl_gap.py --corpus lee --windows 8 --context 1792 --continuation 256 --skip-reference

1. Bug check: the engine's H2O (real eviction, fp32 KV) and tests/reference/h2o_masked.py (transformers' own
   Llama with the full cache and the rule re-derived on Python sets) teacher-force the same continuations.
   Equal per-token NLLs (to fp32 rounding) mean the measured perplexity is the algorithm's, not a position or
   score bug of the engine.
2. Ablations at the same total budget, on the engine: H2O's heavy/recent split, H2O with 4 attention sinks,
   and the baselines (local, sink). They show which part of the kept set the quality depends on.
Prints one table; --json writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from flexgen_h2o.config import GenerationConfig, OffloadPolicy  # noqa: E402
from flexgen_h2o.engine import Engine  # noqa: E402
from flexgen_h2o.eval import data  # noqa: E402
from flexgen_h2o.kv import EvictionConfig  # noqa: E402
from flexgen_h2o.loader import load_model  # noqa: E402


def nll_of(logits: list[torch.Tensor], targets: list[int]) -> list[float]:
    return [-float(torch.log_softmax(lg.float(), -1)[t]) for lg, t in zip(logits, targets)]


def engine_nll(engine: Engine, prompts, conts, ev: EvictionConfig, shared) -> list[list[float]]:
    steps: dict[int, list[torch.Tensor]] = {}
    engine.on_step_logits = lambda t, seqs, lg: [steps.setdefault(s, []).append(lg[r].clone())
                                                  for r, s in enumerate(seqs)]
    engine.generate(prompts, GenerationConfig(max_new_tokens=len(conts[0]), stop_at_eos=False), forced=conts,
                    eviction=ev, prefilled=shared)
    engine.on_step_logits = None
    return [nll_of(steps[i], c) for i, c in enumerate(conts)]


def kept_deciles(engine: Engine, context: int, recent: int) -> list[float]:
    """Where the kept prompt tokens that are not in the final recent window sit at the end of the run: share
    per tenth of the context, over every (sequence, layer, KV head)."""
    counts = [0] * 10
    for caches in engine.last_caches:
        for split in caches.values():
            for cache in split.caches:
                pos = cache.pos[cache.pos >= 0]
                pos = pos[pos < context - recent]            # prompt tokens outside the last window
                for d in (pos * 10 // context).tolist():
                    counts[d] += 1
    total = sum(counts) or 1
    return [c / total for c in counts]


def ppl(rows: list[list[float]]) -> float:
    flat = [x for r in rows for x in r]
    return math.exp(sum(flat) / len(flat))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/ppl_gap.py", description=__doc__.split("\n")[0])
    p.add_argument("--corpus", choices=("wiki", "lee"), default="wiki")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--context", type=int, default=448)
    p.add_argument("--continuation", type=int, default=64)
    p.add_argument("--budget", type=float, default=0.2, help="share of context + continuation kept")
    p.add_argument("--skip-reference", action="store_true", help="ablations only (the reference is slow)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    loaded = load_model("smollm2-135m", progress=False)
    items = data.perplexity_items(loaded.tokenizer, a.corpus, a.windows, a.context, a.continuation)
    prompts, conts = [p for p, _ in items], [c for _, c in items]
    slots = round(a.budget * (a.context + a.continuation))
    half = slots // 2
    rules = {
        "full": EvictionConfig(policy="full"),
        f"h2o (heavy {half} + recent {slots - half})": EvictionConfig(policy="h2o", kv_budget=slots),
        f"h2o heavy {slots // 4} + recent {slots - slots // 4}": EvictionConfig(
            policy="h2o", hh_size=slots // 4, recent_size=slots - slots // 4),
        f"h2o heavy {3 * slots // 4} + recent {slots - 3 * slots // 4}": EvictionConfig(
            policy="h2o", hh_size=3 * slots // 4, recent_size=slots - 3 * slots // 4),
        "h2o + 4 sinks": EvictionConfig(policy="h2o", kv_budget=slots, sink_size=4),
        "h2o-port": EvictionConfig(policy="h2o-port", kv_budget=slots),
        "sink (4 + window)": EvictionConfig(policy="sink", kv_budget=slots),
        "local (window)": EvictionConfig(policy="local", kv_budget=slots),
    }
    engine = Engine(loaded.config, loaded.read, offload=OffloadPolicy(gpu_batch_size=len(prompts),
                                                                      kv_dtype="float32"))
    shared = engine.prefill(prompts)
    results = {}
    for name, ev in rules.items():
        results[name] = engine_nll(engine, prompts, conts, ev, shared)
        if name.startswith("h2o (heavy"):
            deciles = kept_deciles(engine, a.context, slots - half)
    engine.close()
    out = {"corpus": a.corpus, "windows": a.windows, "context": a.context, "continuation": a.continuation,
           "slots": slots, "ppl": {k: ppl(v) for k, v in results.items()}, "h2o_kept_by_context_decile": deciles}
    h2o_key = next(k for k in rules if k.startswith("h2o (heavy"))
    if not a.skip_reference:
        from benchmarks.hf_cache import load_smollm2
        from tests.reference.h2o_masked import reference_generate
        model, _ = load_smollm2("cpu", torch.float32)
        ids, forced = torch.tensor(prompts), torch.tensor(conts)
        _, logits = reference_generate(model, ids, None, (0, half, slots - half), rule="exact",
                                       max_new_tokens=len(conts[0]), forced=forced)
        ref = [nll_of([lg[i] for lg in logits], c) for i, c in enumerate(conts)]
        diff = max(abs(x - y) for r, e in zip(ref, results[h2o_key]) for x, y in zip(r, e))
        out["reference_h2o_ppl"], out["engine_vs_reference_max_nll_diff"] = ppl(ref), diff
    full = out["ppl"]["full"]
    print(f"{a.corpus}: {a.windows} windows of {a.context} + {a.continuation} tokens, {slots} slots "
          f"({100 * a.budget:.0f} %)")
    for k, v in out["ppl"].items():
        print(f"  {k:34s} ppl {v:8.3f}  ({v / full:.3f}x full)")
    print("  h2o's kept prompt tokens outside the recent window, by tenth of the context: "
          + " ".join(f"{100 * x:.0f}%" for x in deciles))
    if "reference_h2o_ppl" in out:
        print(f"  masked reference, exact H2O         ppl {out['reference_h2o_ppl']:8.3f}; largest per-token NLL "
              f"difference from the engine {out['engine_vs_reference_max_nll_diff']:.2e}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
