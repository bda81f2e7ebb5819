"""H2O for transformers users: `model.generate(..., cache=H2OCache(...))`.

    from flexgen_h2o.hf import H2OCache, enable_h2o
    enable_h2o(model)                    # or from_pretrained(..., attn_implementation="flexgen_h2o")
    out = model.generate(**inputs, cache=H2OCache(hh_ratio=0.1), max_new_tokens=64)

Importing this package registers the "flexgen_h2o" attention with transformers. The eviction rules are the
engine's (flexgen_h2o.kv); see docs/hf.md.
"""
from __future__ import annotations

from flexgen_h2o.hf.attention import enable_h2o, h2o_attention, padding_mask, prompt_attention, register
from flexgen_h2o.hf.cache import ATTN_NAME, H2OCache, H2OLayer

register()

__all__ = ["ATTN_NAME", "H2OCache", "H2OLayer", "enable_h2o", "h2o_attention", "padding_mask", "prompt_attention",
           "register"]
