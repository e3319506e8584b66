"""A least-recently-used map bounded by its entries and by the bytes of what it holds.

The proxy's memories of what it learned (forms, texts known to be in their form, the embedded
store's remembered values) are written once per request that teaches something new: bounded by
count alone, an application whose texts change every request would fill them with texts never
seen again, however long each one is. ``SizedLRU`` drops the least recently written entries past
either bound.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
_ABSENT = object()


class SizedLRU(Generic[K, V]):
    """At most ``entries`` entries of at most ``max_bytes`` in all, as ``size(key, value)``
    counts them; the least recently put (or touched) go first."""

    __slots__ = ("_bytes", "_items", "_size", "entries", "max_bytes")

    def __init__(self, *, entries: int, max_bytes: int, size: Callable[[K, V], int]) -> None:
        self.entries = entries
        self.max_bytes = max_bytes
        self._size = size
        self._items: OrderedDict[K, V] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    @property
    def bytes(self) -> int:
        """What the entries weigh now."""
        return self._bytes

    def get(self, key: K, *, touch: bool = False) -> V | None:
        """The value of ``key`` (``touch``: marked as just used), or None."""
        value = self._items.get(key)
        if value is not None and touch:
            self._items.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        """Hold ``value`` under ``key`` as the most recent; an entry heavier than ``max_bytes``
        is not held (and the one it replaces is gone)."""
        self.pop(key)
        weight = self._size(key, value)
        if weight > self.max_bytes:
            return
        self._items[key] = value
        self._bytes += weight
        while len(self._items) > self.entries or self._bytes > self.max_bytes:
            old_key, old = self._items.popitem(last=False)
            self._bytes -= self._size(old_key, old)

    def pop(self, key: K) -> V | None:
        """Drop ``key``; its value, or None."""
        value = self._items.pop(key, _ABSENT)
        if value is _ABSENT:
            return None
        self._bytes -= self._size(key, value)  # type: ignore[arg-type]  # _ABSENT ruled out
        return value  # type: ignore[return-value]  # likewise

    def clear(self) -> None:
        self._items.clear()
        self._bytes = 0
