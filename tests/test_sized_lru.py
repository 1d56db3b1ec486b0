"""The bounded cache behind row orders, reads with owned rows and shared footers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from streamshard.plan.sized_lru import SizedLRU


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from("gp"), st.integers(0, 9), st.integers(0, 40)), max_size=60),
       max_size=st.integers(0, 100), max_items=st.one_of(st.none(), st.integers(1, 5)))
def test_the_cache_keeps_the_most_recent_entries_within_its_bounds(ops, max_size, max_items):
    """Against a plain list of recent entries: the same entries kept, newest last, within the bounds
    (the newest one always kept), and the total size always their sum."""
    cache: SizedLRU[int, bytes] = SizedLRU(max_size, len, max_items)
    model: list[tuple[int, bytes]] = []  # oldest first
    for op, key, size in ops:
        if op == "g":
            want = next((v for k, v in model if k == key), None)
            assert cache.get(key) == want
            if want is not None:  # now the most recent
                model = [(k, v) for k, v in model if k != key] + [(key, want)]
        else:
            value = bytes(size)
            cache.put(key, value)
            model = [(k, v) for k, v in model if k != key] + [(key, value)]
            while len(model) > 1 and (sum(len(v) for _, v in model) > max_size
                                      or (max_items is not None and len(model) > max_items)):
                model.pop(0)
            assert cache.get(key) == value  # the newest stays, whatever its size
            model = [(k, v) for k, v in model if k != key] + [(key, value)]
        assert len(cache) == len(model)
        assert cache.total == sum(len(v) for _, v in model)
