"""The LRU behind the server's per-voice caches: a use keeps an entry, the least recently used one leaves."""

from serving.engine.lru import LRU


def test_the_least_recently_used_entry_is_dropped():
    cache = LRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "a" is now the most recent
    cache.put("c", 3)
    assert list(cache) == ["a", "c"] and cache.get("b") is None
    cache.put("a", 4)  # a new value is a use too
    cache.put("d", 5)
    assert dict(cache) == {"a": 4, "d": 5}
