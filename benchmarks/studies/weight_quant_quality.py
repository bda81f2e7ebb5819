"""Weight compression's effect on the logits: the engine with fp16, int8 and int4 weights on the same real text.

Per model, the engine (full cache, fp32 KV, so only the weights differ) prefills N windows of Lee news text and
teacher-forces a continuation (`forced=`); every forced step's logits are kept. Against the fp16 run, each
compressed run reports the mean KL(p_fp16 || p_quant) in nats over all those positions and the share of
positions whose argmax agrees; on real weights also the perplexity of the forced continuation.

Read with care: SmolLM2's weights shipped here were already 4-bit (the bundled GGUF is Q4_1: every layer matrix
in groups of 32 along the input dimension, the embedding Q8_0), so its rows say little about a model trained in
fp16. Re-quantizing at int4 in Q4_1's own groups of 32 (the control row) is near exact, and int8-g64 nearly so;
int4-g64 is a real second rounding (two 16-level grids forced onto one). The OPT shapes have random N(0, 0.02)
weights: their logits are near uniform, so KL there measures how the rounding noise of random matrices
propagates, not a language model's quality, and their top-1 agreement is the argmax of near ties. Embedding
tables (and heads tied to them, as both models' are) stay fp16; `packed_share` says what fraction of the
parameters was compressed. Inputs are SmolLM2's token ids for both models (its 49152 ids all lie inside OPT's
50272-row table). The engine runs its torch ops (equal to the compiled kernels to fp32 rounding).

    python -m benchmarks.studies.weight_quant_quality --out benchmarks/results/quant-quality
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # before torch loads OpenMP
# values, not speed: the torch ops (equal to the compiled kernels to fp32 rounding) need no kernel build
os.environ.setdefault("FLEXGEN_H2O_FUSED_ATTENTION", "0")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

REAL = "smollm2-135m"          # the one model with real weights; the others are dummy (random) weights


def windows(n: int, context: int, continuation: int) -> tuple[list[list[int]], list[list[int]]]:
    """n Lee-news windows as (contexts, continuations) in SmolLM2's token ids."""
    from flexgen_h2o.eval.data import perplexity_items
    from flexgen_h2o.loader import load_model
    tok = load_model(REAL, progress=False).tokenizer
    items = perplexity_items(tok, "lee", n, context, continuation)
    return [c for c, _ in items], [f for _, f in items]


def forced_logprobs(loaded: Any, bits: int | None, group: int, contexts: list[list[int]], forced: list[list[int]],
                    batch: int) -> tuple[Tensor, dict]:
    """Log-probabilities (windows, steps, vocab) of every forced step, and the run's facts (seconds, what the
    compressed format packed)."""
    from flexgen_h2o.config import GenerationConfig, OffloadPolicy
    from flexgen_h2o.engine import Engine
    from flexgen_h2o.weights.placement import packed_names
    offload = OffloadPolicy(gpu_batch_size=batch, kv_dtype="float32", weight_bits=bits, group_size=group)
    t0 = time.perf_counter()
    engine = Engine(loaded.config, loaded.read, offload=offload, locate=loaded.locate)
    steps = len(forced[0])
    out = torch.empty(len(contexts), steps, loaded.config.vocab_size)

    def keep(step: int, seq_ids: list[int], logits: Tensor) -> None:
        out[seq_ids, step] = torch.log_softmax(logits.float().cpu(), dim=-1)
    engine.on_step_logits = keep
    engine.generate(contexts, GenerationConfig(max_new_tokens=steps, stop_at_eos=False), forced=forced)
    specs = [s for layer in engine.layers for s in layer.weight_specs()]
    packed = packed_names(engine.layers) if bits else set()
    share = sum(s.numel for s in specs if s.name in packed) / sum(s.numel for s in specs)
    engine.release()
    return out, {"seconds": time.perf_counter() - t0, "packed_matrices": len(packed), "packed_share": share}


def compare(ref: Tensor, test: Tensor, forced: Tensor) -> dict:
    """KL(ref || test) per position (nats), top-1 agreement, and both perplexities of the forced tokens."""
    kl = (ref.exp() * (ref - test)).sum(-1)                                      # (windows, steps)
    agree = (ref.argmax(-1) == test.argmax(-1)).float()
    nll = -test.gather(-1, forced[..., None])[..., 0]
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "kl_window_mean": kl.mean(1).tolist(),
            "top1_agree": float(agree.mean()), "ppl": math.exp(float(nll.mean())),
            "ppl_window": [math.exp(x) for x in nll.mean(1).tolist()]}


def markdown(rows: list[dict]) -> str:
    lines = ["| model | weights | packed share | mean KL(fp16 ‖ q) nats | max KL | top-1 agree | ppl (forced) |\n",
             "|---|---|---|---|---|---|---|\n"]
    for r in rows:
        ppl = f"{r['ppl']:.3f}" if r["model"] == REAL else "-"
        lines.append(f"| {r['model']} | {r['weights']} | {r['packed_share']:.2f} | {r['kl_mean']:.2e} | "
                     f"{r['kl_max']:.2e} | {r['top1_agree']:.4f} | {ppl} |\n")
    return "".join(lines)


CAVEAT = ("SmolLM2's shipped weights were already 4-bit (Q4_1 GGUF, groups of 32 along the input dim, embedding "
          "Q8_0), so these rows say little about fp16-trained weights: int4 in Q4_1's own groups of 32 re-quantizes "
          "near exactly (control row), while int4-g64 is a second, coarser rounding. The OPT rows use random "
          "N(0, 0.02) weights whose logits are near uniform: their KL is the rounding noise of random matrices, "
          "not a language model's quality loss, and their top-1 agreement compares near ties.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.weight_quant_quality",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=[REAL, "opt-125m"],
                   help="smollm2-135m (real weights) and OPT shapes (dummy weights), e.g. opt-1.3b")
    p.add_argument("--windows", type=int, default=8, help="Lee-news windows")
    p.add_argument("--context", type=int, default=256, help="prefilled tokens per window")
    p.add_argument("--continuation", type=int, default=64, help="teacher-forced tokens per window")
    p.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    p.add_argument("--group", type=int, default=64, help="values per group along each matrix's input dim")
    p.add_argument("--control-group", type=int, default=32,
                   help="smollm2-135m only: int4 also in groups of this size, Q4_1's 32 (0: skip)")
    p.add_argument("--batch", type=int, default=8, help="gpu_batch_size: windows per decode batch")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/quant-quality"))
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    from flexgen_h2o.loader import load_model
    t0 = time.perf_counter()
    contexts, forced = windows(a.windows, a.context, a.continuation)
    forced_ids = torch.tensor(forced)
    rows = []
    for name in a.models:
        loaded = load_model(name, dummy_weights=name != REAL, progress=False)
        if max(max(c) for c in contexts + forced) >= loaded.config.vocab_size:
            raise SystemExit(f"{name}'s vocabulary ({loaded.config.vocab_size}) is smaller than SmolLM2's ids")
        ref, info = forced_logprobs(loaded, None, 64, contexts, forced, a.batch)
        rows.append({"model": name, "weights": "fp16", **info, **compare(ref, ref, forced_ids)})
        cases = [(bits, a.group) for bits in a.bits]
        if name == REAL and a.control_group:           # Q4_1's own grouping: re-quantizing should be near exact
            cases.append((4, a.control_group))
        for bits, group in cases:
            test, info = forced_logprobs(loaded, bits, group, contexts, forced, a.batch)
            rows.append({"model": name, "weights": f"int{bits}-g{group}", **info, **compare(ref, test, forced_ids)})
            del test
        for r in rows[-1 - len(cases):]:
            print(f"{name} {r['weights']}: KL {r['kl_mean']:.2e}, top-1 {r['top1_agree']:.4f}, ppl {r['ppl']:.3f} "
                  f"({r['seconds']:.0f} s)", flush=True)
        del ref
    result = {"command": shlex.join(["python", "-m", "benchmarks.studies.weight_quant_quality",
                                     *(argv if argv is not None else sys.argv[1:])]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "args": {k: str(v) for k, v in vars(a).items()}, "caveat": CAVEAT,
              "text": f"{a.windows} Lee-news windows, {a.context} tokens prefilled + {a.continuation} forced, "
                      "SmolLM2 token ids", "kv": "full cache, fp32",
              "kernels": "torch ops" if os.environ.get("FLEXGEN_H2O_FUSED_ATTENTION") == "0" else "compiled",
              "positions": a.windows * a.continuation, "rows": rows, "seconds": time.perf_counter() - t0}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "weights.json").write_text(json.dumps(result, indent=2))
    print("\n" + markdown(rows) + "\n" + CAVEAT + f"\nwrote {a.out / 'weights.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
