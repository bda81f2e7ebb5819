"""`--percent auto` for the CLI: this machine's rates (cached; `--calibrate` measures them again), the search, the
chosen plan and its prediction printed before the run, the measurement beside it after."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from flexgen_h2o.calibrate import WEIGHT_FORMATS, cached, rates
from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.memory.offload_dir import sweep_stale
from flexgen_h2o.models import ModelConfig
from flexgen_h2o.planner.cost import page_cache_room, predict
from flexgen_h2o.planner.plan import Plan
from flexgen_h2o.planner.preflight import Machine, PreflightError
from flexgen_h2o.planner.search import describe, search, tok_s

SHOWN = 3          # runner-up plans printed under the chosen one


def machine_rates(args: argparse.Namespace, cfg: ModelConfig, formats: tuple[str, ...] | None = None
                  ) -> dict[str, Any]:
    """This machine's rates with cfg's own matrices timed (in `formats`; default all the search tries)."""
    # FLEXGEN_H2O_CALIBRATE_SMOKE=1: shorter timings (the CLI tests check the wiring, not the rates)
    return rates(Path(os.path.expanduser(args.offload_dir)), refresh=args.calibrate,
                 smoke=os.environ.get("FLEXGEN_H2O_CALIBRATE_SMOKE") == "1",
                 say=(lambda s: None) if args.no_progress else print, model=cfg, formats=formats or WEIGHT_FORMATS)


def choose(args: argparse.Namespace, cfg: ModelConfig, eviction: EvictionConfig, backend: Any,
           base: OffloadPolicy, *, prompt_len: int, gen_len: int, n_prompts: int, dummy_store_bytes: int,
           why: str) -> tuple[OffloadPolicy, Any]:
    """The best-predicted plan that fits (PreflightError with the numbers when none does) and its prediction."""
    root = os.path.expanduser(args.offload_dir)
    sweep_stale(root)                  # a killed run's folders would count against the free disk
    rates = machine_rates(args, cfg)
    device_type = "cuda" if backend.is_cuda else "cpu"
    found = search(cfg, eviction, base, rates, prompt_len=prompt_len, gen_len=gen_len, n_prompts=n_prompts,
                   device_type=device_type, machine=Machine.probe(backend), offload_root=root,
                   store_dir=root if dummy_store_bytes else None, dummy_store_bytes=dummy_store_bytes,
                   real_weights=not args.dummy_weights)
    if not found:
        raise PreflightError(f"preflight: {cfg.name} fits no placement this search tries ({why}): every tier split, "
                             f"GPU batch 1-1024 and compression were tried for prompt {prompt_len} + gen {gen_len}; "
                             f"a smaller --prompt-len/--gen-len or an H2O budget (--hh-ratio) needs less")
    best = found[0]
    print(f"auto placement ({why}; rates of this machine from {rates.get('date', '?')}):")
    print(f"  chosen:  {describe(best)}")
    for cand in found[1:1 + SHOWN]:
        print(f"  also:    {describe(cand)}")
    chosen = (("weights", best.offload.weight_bits, base.weight_bits), ("KV", best.offload.kv_bits, base.kv_bits))
    squeezed = [f"{what} to int{bits}" for what, bits, asked in chosen if bits and bits != asked]
    if squeezed:     # compression changes the output (less than eviction, but it does): say so
        print(f"  note: the chosen plan compresses {' and '.join(squeezed)}, which changes the text a little "
              f"(docs/compression.md); give the placement yourself to keep fp16")
    return best.offload, best.prediction


def predict_if_calibrated(args: argparse.Namespace, est: Any, checked: Any, n_prompts: int,
                          gen_len: int | None = None) -> Any:
    """The cost model's prediction of a run whose placement was given, when this machine's rates are cached
    (nothing is measured for it); else None. gen_len: the length a benchmark reports (its --cut-gen-len steps
    are projected to it), where the plan was made for the cut."""
    plan = est.plan
    if not args.calibrate and cached(Path(os.path.expanduser(args.offload_dir))) is None:
        return None                    # (rates() reads the small cache file again: not worth threading through)
    if gen_len and gen_len != plan.gen_len:
        plan = Plan.for_shape(plan.model, plan.offload, plan.eviction, prompt_len=plan.prompt_len, gen_len=gen_len,
                              n_seqs=plan.n_seqs, device_type=plan.device_type,
                              compute_itemsize=plan.compute_itemsize)
    off = plan.offload
    fmt = off.weight_format.name if off.weight_format.quantized else "fp16"
    rates = machine_rates(args, plan.model, (fmt,))        # the model timed itself once, if not yet
    return predict(plan, rates, n_prompts=n_prompts, free_ram=page_cache_room(checked),
                   peak_bytes={c.resource: c.need for c in checked or []})


def report(prediction: Any, metrics: dict) -> str:
    """`predicted X tok/s, measured Y` for the run's summary, and the prediction into its metrics JSON."""
    measured = metrics.get("total_tok_s", 0.0)
    metrics["predicted"] = prediction.as_dict()
    ratio = prediction.total_tok_s / measured if measured else float("inf")
    ram = prediction.peak_bytes.get("RAM")
    rss = metrics.get("peak_rss_bytes")
    mem = f"; peak RSS predicted {ram / 2**30:.2f} GiB, measured {rss / 2**30:.2f}" if ram and rss else ""
    return (f"cost model: predicted {tok_s(prediction.total_tok_s)} tok/s, measured {tok_s(measured)} "
            f"(predicted / measured {ratio:.2f}){mem}")
