"""Where a decode step's time goes: torch's profiler over a few decode steps of our engine, ops grouped by kind,
beside the roofline bound of the same step (issue 8: "what limits it, profiled, not guessed").

Decode (default): one prefill (Engine.prefill, not profiled), one warm-up decode, then one decode of `--steps`
steps timed without the profiler and one under it. Each case decodes from the same prefill at the same batch, so
only the cache rule differs. `--phase prefill`: the prompt pass instead (generate one token, timed once without
and once under the profiler, after a warm-up), per case, since H2O's prefill also accumulates scores. The ops
fall into groups (each compiled kernel of kernels/csrc, profiled as a range `csrc::<name>`; GEMM, attention, KV
eviction bookkeeping, copies and casts, element-wise, other) by name; the table gives each group's self CPU time
per unit and its share, and on a CPU the wall time no op accounts for (Python, thread wake-ups) (`--device
cuda`: its own kernels' GPU time, and a Chrome trace). A decode profile also holds generate's one-time setup
(committing the kept prompt rows), spread over the steps.

    python -m benchmarks.studies.profile_decode --batch 54 --prompt-len 2048 --out benchmarks/results/profile_decode
    python -m benchmarks.studies.profile_decode --phase prefill --batch 4 --out benchmarks/results/profile_prefill
    # --shapes: also the GEMM calls by input shape, with their FLOP rates (the profiler records shapes)
    python -m benchmarks.studies.profile_decode --phase prefill --batch 4 --cases h2o --shapes \
        --out benchmarks/results/profile_prefill_shapes
    # the disk512+128 shape: OPT-1.3B dummy weights read from files, a 103-slot H2O window as at 20 % of 512
    python -m benchmarks.studies.profile_decode --model opt-1.3b --dummy-weights --percent 0 0 100 0 100 0 --batch 58 \
        --prompt-len 128 --hh-size 51 --recent-size 51 --cases h2o --out benchmarks/results/profile_decode_disk
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # before torch loads OpenMP

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Callable  # noqa: E402

import numpy as np  # noqa: E402

# first matching group wins; names are aten op names as the profiler reports them
GROUPS: list[tuple[str, tuple[str, ...]]] = [
    # the compiled kernels (kernels/csrc), which profile as ranges of their own under named_kernels()
    ("kernel: linear (half_linear)", ("csrc::half_linear",)),
    ("kernel: attention", ("csrc::decode_attention", "csrc::scored_prompt_attention")),
    ("kernel: KV commit and eviction", ("csrc::commit_step",)),
    ("kernel: layer math (RMSNorm, SwiGLU, RoPE)", ("csrc::rms_norm_rows", "csrc::silu_mul_", "csrc::rope_rows")),
    ("GEMM (linear, matmul)", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul",
                               "aten::baddbmm")),
    ("attention (sdpa, softmax)", ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::softmax",
                                   "aten::_softmax", "aten::_safe_softmax", "aten::log_softmax")),
    ("select / gather / scatter (KV slots, eviction)", ("aten::topk", "aten::sort", "aten::argsort", "aten::gather",
                                                       "aten::scatter", "aten::index", "aten::masked",
                                                       "aten::take", "aten::argmax", "aten::argmin",
                                                       "aten::min", "aten::max", "aten::where")),
    ("copies and casts", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous",
                          "aten::cat", "aten::stack", "aten::empty", "aten::zeros", "aten::full",
                          "aten::fill_", "aten::zero_", "aten::resize_")),
    ("element-wise and reductions", ("aten::add", "aten::mul", "aten::sub", "aten::div", "aten::neg",
                                     "aten::pow", "aten::rsqrt", "aten::mean", "aten::sum", "aten::silu",
                                     "aten::relu", "aten::exp", "aten::cos", "aten::sin", "aten::layer_norm",
                                     "aten::native_layer_norm", "aten::eq", "aten::ne", "aten::lt", "aten::gt",
                                     "aten::ge", "aten::le", "aten::logical", "aten::bitwise", "aten::clamp",
                                     "aten::embedding", "aten::cumsum", "aten::maximum", "aten::minimum")),
]


KERNEL_PREFIX = "csrc::"
OUTSIDE = "outside any op (Python, thread wake-ups)"


def named_kernels(kernels):
    """`kernels` (a flexgen_h2o.kernels.Kernels) with each compiled function wrapped in a profiler range named
    csrc::<kernel>, so the profile times the kernels too (they are pybind functions, not torch ops, and would
    otherwise show only as the time between ops). Without a build: `kernels` itself."""
    import torch

    from flexgen_h2o.kernels import Kernels
    if kernels.ext is None:
        return kernels

    def named(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            with torch.profiler.record_function(KERNEL_PREFIX + name):
                return fn(*args, **kwargs)
        return call

    ext = SimpleNamespace(**{name: named(name, getattr(kernels.ext, name)) for name in dir(kernels.ext)
                             if not name.startswith("_") and callable(getattr(kernels.ext, name))})
    return Kernels(ext, layer_math=kernels.layer_math, gemm=kernels.gemm)


def group_of(op: str) -> str:
    for name, prefixes in GROUPS:
        if op.startswith(prefixes):
            return name
    return "other (views, Python-side ops)"


def grouped(rows: list[tuple[str, float, int]], steps: int) -> list[dict]:
    """(op, self CPU seconds, calls) -> per-group seconds and calls per step, largest first."""
    acc: dict[str, list[float]] = {}
    for op, self_s, calls in rows:
        g = acc.setdefault(group_of(op), [0.0, 0])
        g[0] += self_s
        g[1] += calls
    total = sum(v[0] for v in acc.values()) or 1.0
    return sorted(({"group": k, "ms_per_step": 1e3 * v[0] / steps, "calls_per_step": v[1] / steps,
                    "share": v[0] / total} for k, v in acc.items()), key=lambda r: -r["ms_per_step"])


def gemm_flops(op: str, shapes: list) -> float:
    """FLOPs of one call of a GEMM op from its input shapes (0 where the op or its shapes are not a GEMM's). An
    `out=` tensor comes after the two factors; addmm's added tensor comes before them. Not the profiler's
    `with_flops`: it counts 0 for the in-place addmm_ that the prompt attention accumulates with."""
    if op in ("aten::mm", "aten::bmm"):
        mats = shapes[:2]
    elif op in ("aten::addmm", "aten::addmm_", "aten::baddbmm"):
        mats = shapes[1:3]
    else:
        return 0.0
    if len(mats) != 2 or any(not isinstance(m, list) or len(m) not in (2, 3) for m in mats) \
            or mats[0][-1] != mats[1][-2]:
        return 0.0
    (*lead, m, k), n = mats[0], mats[1][-1]
    return 2.0 * m * k * n * (lead[0] if lead else 1)


def gemm_by_shape(prof, units: int, on_gpu: bool = False) -> list[dict]:
    """The GEMM ops grouped by input shape (the profile must record shapes), largest total first; timed as the
    groups are (self GPU time on a GPU), each op once, under the CPU op launching it."""
    from torch.autograd import DeviceType
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.device_type != DeviceType.CPU or group_of(e.key) != "GEMM (linear, matmul)":
            continue
        flops = gemm_flops(e.key, e.input_shapes)
        secs = (e.self_device_time_total if on_gpu else e.self_cpu_time_total) / 1e6
        rows.append({"op": e.key, "shapes": str(e.input_shapes), "ms_per_step": 1e3 * secs / units,
                     "calls_per_step": e.count / units,
                     "gflops": flops * e.count / secs / 1e9 if secs and flops else None})
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.profile_decode",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=54, help="sequences per decode step (one GPU batch)")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8, help="decode steps per timed / profiled call")
    p.add_argument("--phase", choices=["decode", "prefill"], default="decode")
    p.add_argument("--cases", nargs="+", default=["h2o", "full"], choices=["h2o", "h2o-avg", "full"])
    p.add_argument("--hh-size", type=int, default=204)
    p.add_argument("--recent-size", type=int, default=204)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-bits", type=int, choices=[4, 8], help="a compressed cache (--compress-cache)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the groups then sum each op's own GPU kernel "
                   "time (self device time), and a Chrome trace of the profiled call is written beside the table")
    p.add_argument("--dummy-weights", action="store_true",
                   help="deterministic random weights and random prompt ids (the OPT shapes: no weights offline)")
    p.add_argument("--percent", type=int, nargs=6, metavar="P",
                   help="weights, KV and activations placement, as the CLI's --percent (default: all resident); "
                        "weights with a disk share are read from a dummy store's files, as in the suite")
    p.add_argument("--machine-json", type=Path, help="the suite's machine.json: adds the step's roofline bound")
    p.add_argument("--shapes", action="store_true",
                   help="also record input shapes: a table of the GEMM calls by shape, with their FLOP rates")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/profile_decode"))
    return p


def step_bound(machine: dict, cfg, phase: str, batch: int, prompt_len: int, kv_tokens: float,
               kv_bytes_per_seq: float, disk_share: float = 0.0) -> dict:
    """The roofline of one profiled unit (a decode step, or the whole prompt pass). disk_share: the fraction of
    the weights homed on disk (fp16 files, counted as the suite counts them); the rest is resident (fp32)."""
    from benchmarks.machine import bound
    n = cfg.n_params()
    b = bound(machine, cfg, batch=batch, prompt_len=prompt_len, gen_len=2, kv_read_bytes_per_seq=kv_bytes_per_seq,
              offloaded_weight_bytes=n * 2 * disk_share, resident_weight_bytes=n * 4 * (1 - disk_share),
              kv_tokens=kv_tokens)
    if phase == "prefill":
        return {"bound_step_ms": 1e3 * b["prefill_s"], "bound_limit": b["prefill_limit"]}
    return {"bound_step_ms": 1e3 * b["decode_step_s"], "bound_limit": b["decode_limit"]}


def timed_call(engine, prompts, rule, prefilled, a: argparse.Namespace):
    """One call of the phase: returns (a function running it, a function reading its unit times in seconds)."""
    from flexgen_h2o.config import GenerationConfig
    if a.phase == "prefill":
        gen = GenerationConfig(max_new_tokens=1, stop_at_eos=False)
        return (lambda: engine.generate(prompts, gen, eviction=rule)), (lambda res: [res.metrics["prefill_s"]])
    gen = GenerationConfig(max_new_tokens=a.steps + 1, stop_at_eos=False)
    return (lambda: engine.generate(prompts, gen, eviction=rule, prefilled=prefilled),
            lambda res: res.metrics["step_times_s"])


def offload_policy(a: argparse.Namespace):
    """One GPU batch of `a.batch`: everything resident unless --percent places it."""
    from flexgen_h2o.config import OffloadPolicy
    kv_bits = getattr(a, "kv_bits", None)             # the studies that share this setup have no --kv-bits
    if a.percent:
        return OffloadPolicy.from_percent(a.percent, gpu_batch_size=a.batch, num_gpu_batches=1, kv_bits=kv_bits)
    return OffloadPolicy(gpu_batch_size=a.batch, num_gpu_batches=1, kv_bits=kv_bits)


def setup(a: argparse.Namespace, offload_dir: str | None = None):
    """The model, one engine of one GPU batch of `a.batch`, `a.batch` Wikipedia windows of `a.prompt_len` tokens,
    and the cache rules (full; h2o and h2o-avg at a.hh_size + a.recent_size): what every profiled case shares."""
    import torch

    from flexgen_h2o.engine import Engine
    from flexgen_h2o.eval import data
    from flexgen_h2o.kv import EvictionConfig
    from flexgen_h2o.loader import load_model
    from benchmarks.studies.step_scaling import prompts_for
    torch.set_num_threads(a.threads)
    offload = offload_policy(a)
    model = load_model(a.model, dummy_weights=a.dummy_weights, dummy_on_disk=offload.tier_fractions("weights")[2] > 0,
                       progress=False)
    rules = {name: EvictionConfig(policy=name, hh_size=a.hh_size, recent_size=a.recent_size)
             for name in ("h2o", "h2o-avg")}
    rules["full"] = EvictionConfig()
    if a.dummy_weights:
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, model.config.vocab_size, (a.batch, a.prompt_len), generator=gen).tolist()
    else:
        prompts = prompts_for(data.corpus_stream(model.tokenizer, "wiki", a.prompt_len * 2), a.batch, a.prompt_len)
    engine = Engine(model.config, model.read, offload=offload, locate=model.locate, offload_dir=offload_dir,
                    device=a.device)
    return model, engine, prompts, rules


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    a.out.mkdir(parents=True, exist_ok=True)
    on_gpu = a.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    scratch = tempfile.TemporaryDirectory(prefix="profile_decode_")     # KV / activations with a disk share
    model, engine, prompts, rules = setup(a, offload_dir=scratch.name)
    cfg = model.config
    disk_share = engine.offload.tier_fractions("weights")[2]
    machine = json.loads(a.machine_json.read_text()) if a.machine_json else None
    report: dict = {"args": {k: str(v) for k, v in vars(a).items()}, "torch": torch.__version__, "cases": {}}
    try:
        kept = engine.prefill(prompts) if a.phase == "decode" else None
        for case in a.cases:
            run, units = timed_call(engine, prompts, rules[case], kept, a)
            run()                                                                       # warm-up
            plain = units(run())
            plain = plain[1:] if a.phase == "decode" else plain                       # step 0: prefill's logits
            plain_kernels, engine.kernels = engine.kernels, named_kernels(engine.kernels)
            try:
                with profile(activities=activities, record_shapes=a.shapes) as prof:
                    began = time.perf_counter()
                    profiled = units(run())
                    call_s = time.perf_counter() - began
            finally:
                engine.kernels = plain_kernels
            if on_gpu:
                prof.export_chrome_trace(str(a.out / f"trace_{case}.json"))
            # on a GPU the kernels also appear as rows of their own: count each once, under the op launching it
            rows = [(e.key, (e.self_device_time_total if on_gpu else e.self_cpu_time_total) / 1e6, e.count)
                    for e in prof.key_averages() if e.device_type == DeviceType.CPU]
            steps = len(profiled)                 # per-unit figures: the whole call's ops over its units
            top = sorted(rows, key=lambda r: -r[1])[:15]
            kv_tokens = (a.hh_size + a.recent_size + 1) if case != "full" else a.prompt_len + a.steps / 2
            entry = {"step_ms_median": 1e3 * float(np.median(plain)),
                     "step_ms_profiled_median": 1e3 * float(np.median(profiled[1:] or profiled)),
                     "groups": grouped(rows, steps),
                     "timed": "self GPU" if on_gpu else "self CPU",
                     # on a GPU, kernel time well under the wall time means the device waited (copies, host)
                     "busy_ms_per_step": 1e3 * sum(r[1] for r in rows) / steps,
                     # on a CPU, the call's wall time that no op (nor kernel range) accounts for
                     "outside_ms_per_step": None if on_gpu else 1e3 * (call_s - sum(r[1] for r in rows)) / steps,
                     "top_ops": [{"op": op, "ms_per_step": 1e3 * s / steps, "calls_per_step": c / steps}
                                 for op, s, c in top]}
            if a.shapes:
                entry["gemm_by_shape"] = gemm_by_shape(prof, steps, on_gpu)
            if machine:
                kv_bytes = kv_tokens * cfg.kv_bytes_per_token(2)                             # fp16 K and V
                entry.update(step_bound(machine, cfg, a.phase, a.batch, a.prompt_len, kv_tokens, kv_bytes,
                                        disk_share))
            report["cases"][case] = entry
    finally:
        engine.close()
        scratch.cleanup()
    (a.out / "results.json").write_text(json.dumps(report, indent=2))
    md = markdown(report, a)
    (a.out / "results.md").write_text(md)
    print(md)
    return 0


def markdown(report: dict, a: argparse.Namespace) -> str:
    unit = "decode step" if a.phase == "decode" else "prompt pass"
    lines = [f"# Profile per {unit}: {a.model}, batch {a.batch}, prompt {a.prompt_len}", ""]
    for case, e in report["cases"].items():
        bound = (f", roofline bound {e['bound_step_ms']:.1f} ms ({e['bound_limit']}): measured / bound "
                 f"{e['step_ms_median'] / e['bound_step_ms']:.2f}x") if "bound_step_ms" in e else ""
        lines += [f"## {case}: {unit} {e['step_ms_median']:.1f} ms (under the profiler "
                  f"{e['step_ms_profiled_median']:.1f} ms){bound}", "",
                  f"{e['timed']} time of all ops: {e['busy_ms_per_step']:.1f} ms per {unit}"
                  + (f"; {OUTSIDE}: {e['outside_ms_per_step']:.1f} ms (the profiled call's wall time less its "
                     f"ops' self time, per {unit})" if e.get("outside_ms_per_step") is not None else ""), "",
                  f"| group | ms per {unit} | calls per {unit} | share of {e['timed']} |", "|---|---|---|---|"]
        lines += [f"| {g['group']} | {g['ms_per_step']:.1f} | {g['calls_per_step']:.0f} | {100 * g['share']:.0f} % |"
                  for g in e["groups"]]
        lines += ["", f"| top op | ms per {unit} | calls per {unit} |", "|---|---|---|"]
        lines += [f"| `{o['op']}` | {o['ms_per_step']:.1f} | {o['calls_per_step']:.0f} |" for o in e["top_ops"]]
        if e.get("gemm_by_shape"):
            lines += ["", f"| GEMM op | input shapes | ms per {unit} | calls per {unit} | GFLOP/s |",
                      "|---|---|---|---|---|"]
            lines += [f"| `{g['op']}` | {g['shapes']} | {g['ms_per_step']:.1f} | {g['calls_per_step']:.0f} | "
                      + (f"{g['gflops']:.1f} |" if g["gflops"] else "- |") for g in e["gemm_by_shape"][:12]]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
