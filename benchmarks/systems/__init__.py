"""The systems the suite compares, by name. Each adapter module holds one system (and, for the peers that need
one, the child program that runs a case); `base.py` holds what they share."""
from __future__ import annotations

import fnmatch

from benchmarks.systems.base import RESULT_KEYS, Candidate, System, rates

__all__ = ["RESULT_KEYS", "Candidate", "System", "rates", "all_systems", "select_systems"]


def all_systems() -> dict[str, System]:
    """Every system, in table order: ours first, then the peers."""
    from benchmarks.systems.accelerate import Accelerate
    from benchmarks.systems.deepspeed import DeepSpeed
    from benchmarks.systems.flexgen import FlexGen
    from benchmarks.systems.hf_generate import HFGenerate
    from benchmarks.systems.kvpress import KVPress, KVPressDecoding
    from benchmarks.systems.llamacpp import LlamaCpp
    from benchmarks.systems.openvino import OpenVINO
    from benchmarks.systems.ours import Ours
    from benchmarks.systems.vllm import VLLM
    out: list[System] = [Ours(None), Ours(10), Ours(20), Ours(40)]
    # the chat workload's synchronous blocks (--no-refill): ours-norefill-full, ours-norefill-h2o-20
    out += [Ours(pct, refill=False) for pct in (None, 20)] + [HFGenerate(), Accelerate()]
    # compressed KV and weights (issue 34): ours-kv4-h2o-20, ours-kv8-full, ours-w4-h2o-20, ...
    out += [Ours(pct, kv_bits=bits) for bits in (4, 8) for pct in (None, 20)]
    out += [Ours(pct, weight_bits=bits) for bits in (4, 8) for pct in (None, 20)]
    out += [KVPress(p, b) for p in ("observed", "streaming") for b in (10, 20, 40)] + [KVPressDecoding(20)]
    # openvino, openvino-f16, openvino-evict-20, openvino-evict-20-f16
    out += [OpenVINO(kv, b) for b in (None, 20) for kv in ("u8", "f16")]
    # its newer scorers at the same budget: openvino-evict-20-normsum, openvino-evict-20-snapkv
    out += [OpenVINO("u8", 20, "NORM_SUM", window=0), OpenVINO("u8", 20, "NORM_SUM", window=8)]
    out += [VLLM(), VLLM(inproc=True)]
    out += [LlamaCpp(kind) for kind in ("f16", "q8_0", "q4_0")]     # llamacpp-f16, llamacpp-q8_0, llamacpp-q4_0
    out += [DeepSpeed(), FlexGen()]
    return {s.name: s for s in out}


def select_systems(patterns: list[str] | None, default: list[str] | tuple[str, ...], known: list[str]) -> list[str]:
    """Names from --systems: an exact name, a family prefix (`ours-h2o` -> ours-h2o-10/20/40, `kvpress`), or a
    glob (`kvpress-*-20`); without --systems, the workload's default list. Order follows `known`."""
    if not patterns:
        return [n for n in known if n in default]
    picked: set[str] = set()
    for pat in patterns:
        hits = [n for n in known if n == pat or n.startswith(pat + "-") or fnmatch.fnmatchcase(n, pat)]
        if not hits:
            raise SystemExit(f"error: no system matches {pat!r}; known: {', '.join(known)}")
        picked.update(hits)
    return [n for n in known if n in picked]
