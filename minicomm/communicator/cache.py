"""The one cache type of the communicator: a dict with a bound on its size."""
from __future__ import annotations


class BoundedCache(dict):
    """A dict of at most ``limit`` entries: ``put`` of a new key into a full cache first drops
    the oldest entry (insertion order). Lookups are dict's own (``get``, ``in``, ``[]``), so a
    repeated call pays nothing for the bound; only ``put`` (a first call) evicts.

    >>> plans = BoundedCache(1024); plans.put(key, plan)
    """
    __slots__ = ("limit",)

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def put(self, key, value):
        """Store ``value`` under ``key`` (evicting the oldest entry if full); returns ``value``."""
        if key not in self and len(self) >= self.limit:
            del self[next(iter(self))]
        self[key] = value
        return value
