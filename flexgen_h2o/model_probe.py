"""A model's own decode cost, timed once per model shape and weight format (the cost model's decode rates).

Machine rates on synthetic shapes (calibrate.py) predicted a run's decode steps too fast (`docs/planner.md`
"The machine's rates"): what a real layer does between its matrix products
(norms, rotary, the KV write and its scores, the gathers of live rows, dispatch) is no FLOP count, and a model's
matrices run at their own speed. So the probe runs the real engine on the model itself cut to 1 block and to
3 or more (its own widths, heads, MLP and weight format, a 512-token vocabulary), all in RAM, at each decode row
count, and takes the difference: seconds per block per decode step (the window's attention beyond its 16-token
prompt is the cost model's to add). Median step. The larger cut holds more weight bytes than the last-level
cache, as a whole model does: blocks that stay in the cache time a decode step too fast (`docs/planner.md`).
The prompt pass stays on the machine rates: timed on one short prompt the probe's GEMMs ran at far fewer rows
than a run's prefill chunks.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from flexgen_h2o.config import GenerationConfig, OffloadPolicy
from flexgen_h2o.engine import Engine
from flexgen_h2o.formats import storage_format
from flexgen_h2o.models import all_specs, build_layers
from flexgen_h2o.planner.cost import PROBE_PROMPT, PROBE_ROWS, probe_shapes
from flexgen_h2o.quant import PackedMatrix
from flexgen_h2o.weights import DummyStore

LLC_BYTES = 64 << 20                      # rotate among more weight bytes than this (calibrate.py does too)
PROBE_STEPS = 8                           # decode steps timed per run (after the first, which is dropped)
PROBE_VOCAB = 512
MAX_COPIES = 64                           # copies of a block's matrices rotated past the LLC (measure_matrices)
STOP_S = 0.3                              # row counts stop once a 1-block step takes this long (compute-bound
                                          # there: the cost model scales the largest timed one by rows)


def median_time(fn: Callable[[], Any], min_s: float, sync: Callable[[], None] = lambda: None) -> float:
    """Median single-call time over at least 5 calls lasting min_s in all (after a warm-up call): what a run
    meets, where the best of back-to-back calls would over-rate it."""
    fn()
    sync()
    times: list[float] = []
    while sum(times) < min_s or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def packed_weight(w: torch.Tensor, fmt_name: str, device: torch.device) -> Any:
    """A matrix as the engine stages it in a storage format: an fp16 tensor or a PackedMatrix."""
    fmt = storage_format(fmt_name)
    if fmt.quantized:
        return PackedMatrix(fmt.pack(w).to(device), w.shape[1], fmt.quant_for(w.shape[1]))
    return w.to(device, torch.float16)


def _block_params(cfg: Any) -> int:
    return sum(s.numel for layer in build_layers(cfg.replace(n_layers=1)) if layer.kind in ("attn", "mlp")
               for s in layer.weight_specs())


def probe_blocks(cfg: Any, fmt_name: str) -> int:
    """Blocks of the probe's larger model: 3, or enough that their weights pass the last-level cache, at most
    the model's own."""
    per_block = storage_format(fmt_name).nbytes(_block_params(cfg))
    return max(2, min(cfg.n_layers, max(3, 1 + math.ceil(LLC_BYTES / per_block))))


def fits(cfg: Any, fmt_name: str, ram_available: int) -> bool:
    """Whether the probe's two engines (1 + probe_blocks blocks, fp16 as loaded) take at most half the RAM."""
    return (1 + probe_blocks(cfg, fmt_name)) * 2 * _block_params(cfg) <= ram_available // 2


def _engine(cfg: Any, blocks: int, fmt_name: str, rows: int, device: str) -> Any:
    small = cfg.replace(n_layers=blocks, vocab_size=min(cfg.vocab_size, PROBE_VOCAB))
    bits = None if fmt_name == "fp16" else int(fmt_name[3])
    return Engine(small, DummyStore(all_specs(build_layers(small))).read, device=device,
                  offload=OffloadPolicy(gpu_batch_size=rows, weight_bits=bits))


def _step_s(engine: Any, rows: int) -> float:
    out = engine.generate([[5 + i % 7] * PROBE_PROMPT for i in range(rows)],
                          GenerationConfig(max_new_tokens=PROBE_STEPS + 2, stop_at_eos=False))
    steps = sorted(out.metrics["step_times_s"][1:])
    return steps[len(steps) // 2]


def measure_block(cfg: Any, fmt_name: str, rows_list: tuple[int, ...], device: str = "cpu",
                  say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """What one transformer block (attention + MLP) adds to a decode step at each row count ("decode_s"; row
    counts past STOP_S are not timed): the larger cut's median step minus the 1-block model's, per extra block."""
    t0 = time.perf_counter()
    many = probe_blocks(cfg, fmt_name)
    times: dict[int, dict[int, float]] = {1: {}, many: {}}
    for blocks in (1, many):
        engine = _engine(cfg, blocks, fmt_name, max(rows_list), device)     # a block of fewer prompts: fewer rows
        try:
            for rows in rows_list if blocks == 1 else list(times[1]):
                times[blocks][rows] = _step_s(engine, rows)
                if blocks == 1 and times[1][rows] > STOP_S:
                    break
        finally:
            engine.close()
    out = {"decode_s": {str(rows): max(1e-6, (times[many][rows] - times[1][rows]) / (many - 1))
                        for rows in times[many]}}
    say(f"  {cfg.name} {fmt_name}: a block's decode step (1 vs {many} blocks, {len(times[many])} row counts) timed "
        f"in {time.perf_counter() - t0:.0f} s")
    return out


def measure_matrices(cfg: Any, fmt_name: str, kernels: Any, device: torch.device, dtype: torch.dtype,
                     sync: Callable[[], None], min_s: float) -> dict[str, float]:
    """GFLOP/s of one transformer block's matrices (the model's own input widths, planner/cost.probe_shapes) in
    one weight format at decode rows, called in sequence as a layer calls them, copies rotated past the
    last-level cache, median call (the LM head and embeddings are priced at this rate)."""
    shapes = probe_shapes(cfg)
    gen = torch.Generator().manual_seed(0)
    one = [(torch.randn(n, k, generator=gen) * 0.02) for n, k in shapes]
    block = [packed_weight(w, fmt_name, device) for w in one]
    nbytes = sum(w.rows.nbytes if hasattr(w, "rows") else w.nbytes for w in block)
    # at most MAX_COPIES: a block under LLC_BYTES / MAX_COPIES (1 MiB; SmolLM2's int4 block is 1.9 MB) is a toy
    # model whose own run keeps every weight in the cache anyway, and packing thousands of its copies is slow
    n_copies = min(MAX_COPIES, LLC_BYTES // max(1, nbytes))
    copies = [block] + [[packed_weight(w, fmt_name, device) for w in one] for _ in range(n_copies)]
    flops = sum(2 * n * k for n, k in shapes)
    out = {}
    for rows in PROBE_ROWS:
        xs = {k: torch.randn(rows, k, device=device, dtype=dtype) for _, k in shapes}
        it = iter(range(1 << 62))

        def layer() -> None:
            for w in copies[next(it) % len(copies)]:
                kernels.linear(xs[w.shape[1]], w)
        out[str(rows)] = rows * flops / median_time(layer, min_s, sync) / 1e9
    return out
