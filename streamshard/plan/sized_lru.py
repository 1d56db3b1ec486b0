"""The most recently used entries, bounded by their total size: what the caches of plans, schedules and
footers keep (row orders, reads with their owned rows, footer bytes), each sized in its own unit."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SizedLRU(Generic[K, V]):
    """Entries by key, the least recently used dropped first once their sizes sum past ``max_size`` (or
    they number more than ``max_items``). The newest entry stays even when it alone is over the bound:
    its caller is about to use it. Not thread-safe: callers that share one hold their own lock."""

    def __init__(self, max_size: int, size: Callable[[V], int], max_items: int | None = None) -> None:
        self.max_size, self.max_items = max_size, max_items
        self._size = size
        self._entries: OrderedDict[K, V] = OrderedDict()
        self.total = 0  # sum of the entries' sizes

    def get(self, key: K) -> V | None:
        """The entry (now the most recently used), or None."""
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` as the most recently used entry, then drop the oldest while over the bounds."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.total -= self._size(old)
        self._entries[key] = value
        self.total += self._size(value)
        while len(self._entries) > 1 and (
                self.total > self.max_size or (self.max_items is not None and len(self._entries) > self.max_items)):
            self.total -= self._size(self._entries.popitem(last=False)[1])

    def clear(self) -> None:
        self._entries.clear()
        self.total = 0

    def __len__(self) -> int:
        return len(self._entries)
