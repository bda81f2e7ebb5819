"""ValueHolder catches schedule ordering bugs loudly."""
from __future__ import annotations

import pytest

from flexgen_h2o.memory import HolderStateError, ValueHolder, holder_grid


def test_store_pop_clear():
    h = ValueHolder("w")
    assert not h.is_full
    h.store(1)
    assert h.is_full and h.peek() == 1
    with pytest.raises(HolderStateError, match="full slot"):
        h.store(2)
    assert h.pop() == 1
    with pytest.raises(HolderStateError, match="empty slot"):
        h.pop()
    h.store(3)
    h.clear()
    assert not h.is_full


def test_holder_grid():
    g = holder_grid(2, 3, name="kv")
    assert len(g) == 2 and len(g[1]) == 3 and isinstance(g[1][2], ValueHolder)
    g[0][0].store("x")
    assert not g[0][1].is_full and g[0][0].name == "kv[0][0]"
