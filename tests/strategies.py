"""Layouts and hypothesis strategies shared by the tests (no test module imports another)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from streamshard.plan.epoch_plan import Layout, PlanConfig

# One huge file, many tiny ones, an empty one, and row groups of wildly different sizes.
SKEWED_LAYOUT = [[900, 700, 1100]] + [[3]] * 12 + [[]] + [[0, 5, 0]] + [[40, 1, 250]]

rows_st = st.one_of(st.just(0), st.integers(1, 10_000), st.integers(1, 50))
layouts = st.lists(st.lists(rows_st, max_size=20), min_size=1, max_size=200)
@st.composite
def plan_configs(draw):
    shuffle = draw(st.booleans())
    return PlanConfig(
        unit=draw(st.sampled_from(["row_group", "file"])),
        shuffle=shuffle,
        seed=draw(st.integers(0, 2**64 - 1)),
        batch_size=draw(st.one_of(st.none(), st.integers(1, 4096))),
        uneven=draw(st.sampled_from(["pad", "drop"])),
        shuffle_window=draw(st.integers(1, 4)) if shuffle else 1,
    )


configs = plan_configs()
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_layout(files: list[list[int]]) -> Layout:
    rows = np.array([r for f in files for r in f], dtype=np.int64)
    file_of = np.repeat(np.arange(len(files)), [len(f) for f in files]).astype(np.int64)
    return Layout(rows, file_of)
