"""A bounded cache that committer threads may share.

The committer keeps what never changes once written (manifests, manifest lists, side files,
table versions) in bounded caches. With ``coordination.commit_parallelism`` above 1 several
threads commit tables at once through one committer, and an unguarded "evict the oldest, then
insert" (or cachetools' LRUCache, documented as not thread-safe) loses a race: two threads
evict the same key and one fails with KeyError. Reading or decoding a missing value happens
outside the lock (two threads may both decode it: harmless, the value is immutable).
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from cachetools import LRUCache

_K = TypeVar("_K")
_V = TypeVar("_V")


class SharedCache(Generic[_K, _V]):
    """A least-recently-used cache of at most ``maxsize`` entries, safe across threads."""

    def __init__(self, maxsize: int) -> None:
        self._cache: LRUCache[_K, _V] = LRUCache(maxsize)
        self._lock = threading.Lock()

    def get(self, key: _K) -> _V | None:
        with self._lock:
            return self._cache.get(key)

    def put(self, key: _K, value: _V) -> None:
        with self._lock:
            self._cache[key] = value

    def pop(self, key: _K) -> _V | None:
        with self._lock:
            return self._cache.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)
