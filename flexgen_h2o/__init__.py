"""flexgen_h2o: offloaded batch generation for OPT and Llama with a fixed-size H2O KV cache.

    from flexgen_h2o import LLM, OffloadPolicy, EvictionConfig
    llm = LLM("smollm2-135m", eviction=EvictionConfig(policy="h2o", hh_ratio=0.1))
    print(llm.chat(["Why is the sky blue?"], max_new_tokens=64)[0].text)

Names are imported on first use (PEP 562), so `python -m flexgen_h2o.run --help` and its flag errors stay fast.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "LLM": "flexgen_h2o.api", "Completion": "flexgen_h2o.api",
    "OffloadPolicy": "flexgen_h2o.config", "GenerationConfig": "flexgen_h2o.config",
    "GenerationResult": "flexgen_h2o.config", "ConfigError": "flexgen_h2o.config",
    "EvictionConfig": "flexgen_h2o.kv.budget", "Engine": "flexgen_h2o.engine",
    "PreflightError": "flexgen_h2o.planner.preflight", "auto_offload": "flexgen_h2o.calibrate",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flexgen_h2o' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
