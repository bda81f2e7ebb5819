"""Fixtures of the accuracy harness's tests."""
from __future__ import annotations

import pytest

from flexgen_h2o.loader import fallback_tokenizer


@pytest.fixture(scope="module")
def tok():
    """SmolLM2's converted tokenizer (the harness's items are its tokens)."""
    t = fallback_tokenizer()
    if t is None:
        pytest.skip("SmolLM2's tokenizer is not converted yet (make run)")
    return t
