"""`ValueHolder`: a one-slot box for the schedule's staging buffers (FlexGen's ValueHolder).

Storing into a full slot or popping an empty one is a schedule ordering bug, so it raises at once instead of
silently overwriting a buffer that is still in use.
"""
from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")
_EMPTY = object()


class HolderStateError(AssertionError):
    """A store into a full slot, or a pop/peek of an empty one."""


class ValueHolder(Generic[T]):
    __slots__ = ("name", "_value")

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._value: object = _EMPTY

    @property
    def is_full(self) -> bool:
        return self._value is not _EMPTY

    def store(self, value: T) -> None:
        if self._value is not _EMPTY:
            raise HolderStateError(f"holder {self.name!r}: store into a full slot (still holds {self._value!r:.80})")
        self._value = value

    def pop(self) -> T:
        value = self.peek()
        self._value = _EMPTY
        return value

    def peek(self) -> T:
        if self._value is _EMPTY:
            raise HolderStateError(f"holder {self.name!r}: read of an empty slot")
        return self._value  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"ValueHolder({self.name!r}, {'full' if self.is_full else 'empty'})"
