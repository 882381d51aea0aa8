"""A dict that keeps only its most recently used entries: the server's caches of work done per voice."""

from __future__ import annotations

from collections import OrderedDict


class LRU(OrderedDict):
    """At most `capacity` entries; `get` and `put` mark an entry as used, `put` drops the least recently used."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def get(self, key, default=None):
        if key not in self:
            return default
        self.move_to_end(key)
        return self[key]

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.capacity:
            self.popitem(last=False)
