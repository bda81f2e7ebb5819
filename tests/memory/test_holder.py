"""ValueHolder catches schedule ordering bugs loudly."""
from __future__ import annotations

import pytest

from flexgen_h2o.memory import HolderStateError, ValueHolder


def test_store_peek_pop():
    h = ValueHolder("w")
    assert not h.is_full
    h.store(1)
    assert h.is_full and h.peek() == 1
    with pytest.raises(HolderStateError, match="full slot"):
        h.store(2)
    assert h.pop() == 1
    with pytest.raises(HolderStateError, match="empty slot"):
        h.pop()
