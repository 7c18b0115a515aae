"""What a process reads or builds once and reuses across the units it runs (a stage's shared settings, a pass's
queries, a loaded model, an opened index): one keyed cache with one eviction rule, the ``size`` entries used last.

It sits below every layer (storage, retrieval, stages use it) and imports nothing of diffret.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class KeyedCache(Generic[K, V]):
    """Values by key, built on first use: :meth:`get` returns the value of ``key``, making it when absent, and keeps
    the ``size`` entries used last (the least recently used one goes first, before a new one is made). Safe to share
    between threads (a value two threads make at once is made twice; the later one is kept).

    >>> cache = KeyedCache(size=2)
    >>> cache.get("a", lambda: 1), cache.get("b", lambda: 2), cache.get("a", lambda: 0)
    (1, 2, 1)
    >>> cache.get("c", lambda: 3)  # "b" was used last of the others: it goes
    3
    >>> sorted(cache.keys())
    ['a', 'c']
    """

    def __init__(self, size: int = 1) -> None:
        if size < 1:
            raise ValueError(f"a cache holds at least one entry, not {size}")
        self.size = size
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K, make: Callable[[], V]) -> V:
        """The value of ``key``: the cached one, else ``make()``, kept. Room is made before it is made (the entries
        used least recently go first), so a cache of one loaded model never holds two."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            while len(self._items) >= self.size:
                self._items.popitem(last=False)
        value = make()
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return value

    def pop(self, key: K) -> V | None:
        """Forget ``key`` (its value, or None)."""
        with self._lock:
            return self._items.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def keys(self) -> list[K]:
        with self._lock:
            return list(self._items)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
