"""Specification of the blend schedule: exact counts, fairness, bijection, random access."""

from __future__ import annotations

import hashlib
import tracemalloc
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamshard.plan import blend_export
from streamshard.plan.blend_schedule import MAX_SAMPLES, BlendSchedule, blend_counts

HUGE = 2 * 10**12


def hamilton_reference(weights: list[float], n: int) -> list[int]:
    """Textbook largest remainder with exact fractions; ties to the lower index."""
    total = sum(Fraction(w) for w in weights)
    quotas = [Fraction(w) * n / total for w in weights]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda k: (-(quotas[k] - counts[k]), k))
    for k in by_remainder[: n - sum(counts)]:
        counts[k] += 1
    return counts


def megatron_greedy(weights: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: at position i pick argmax of w_k * (i + 1) - count_k."""
    w = np.asarray(weights, np.float64) / np.sum(weights)
    taken = np.zeros(len(w), np.int64)
    corpus, index = np.empty(n, np.int64), np.empty(n, np.int64)
    for i in range(n):
        k = int(np.argmax(w * (i + 1) - taken))
        corpus[i], index[i] = k, taken[k]
        taken[k] += 1
    return corpus, index


def max_prefix_error(corpus: np.ndarray, counts: np.ndarray) -> float:
    """max over prefixes m and corpora k of |taken_k(m) - m * count_k / N|.

    Between two samples of a corpus the error is linear in m, so it peaks just before or just
    after one of its samples; checking those 2N points covers every prefix."""
    n = len(corpus)
    order = np.argsort(corpus, kind="stable")
    pos = order.astype(np.int64)
    rank = np.arange(n) - np.searchsorted(corpus[order], corpus[order])
    c = counts[corpus[order]]
    before = np.abs(rank * n - pos * c)
    after = np.abs((rank + 1) * n - (pos + 1) * c)
    return float(max(before.max(initial=0), after.max(initial=0))) / max(n, 1)


def assert_exact_fair_schedule(sched: BlendSchedule) -> tuple[np.ndarray, np.ndarray]:
    """Whole-schedule invariants; returns the materialised schedule."""
    corpus, index = sched.export_megatron()
    counts = sched.counts
    assert np.array_equal(np.bincount(corpus, minlength=len(counts)), counts)
    for k in np.flatnonzero(counts):  # each corpus read in order 0, 1, 2, ... exactly once
        assert np.array_equal(index[corpus == k], np.arange(counts[k]))
    assert max_prefix_error(corpus, counts) <= 2.0
    return corpus, index


weights_strategy = st.lists(
    st.one_of(st.just(0.0), st.floats(1e-6, 1e6), st.integers(1, 100).map(float)), min_size=1, max_size=1000
).filter(lambda w: sum(w) > 0)


# --- blend_counts -----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(weights=weights_strategy, n=st.integers(0, 10**13))
def test_blend_counts_is_exact_largest_remainder(weights: list[float], n: int) -> None:
    counts = blend_counts(weights, n)
    assert counts.dtype == np.int64 and counts.sum() == n
    assert counts.tolist() == hamilton_reference(weights, n)


def test_blend_counts_ties_go_to_lower_index_and_zero_weights_get_nothing() -> None:
    assert blend_counts([1, 1, 1], 1).tolist() == [1, 0, 0]
    assert blend_counts([1, 1, 1], 2).tolist() == [1, 1, 0]
    assert blend_counts([0, 2, 0, 2], 5).tolist() == [0, 3, 0, 2]
    assert blend_counts(np.array([0.7, 0.3]), 10).tolist() == [7, 3]


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([1.0, -0.5], r"weights\[1\] is negative"),
        ([1.0, 2.0, float("nan")], r"weights\[2\] is NaN"),
        ([float("inf"), 1.0], r"weights\[0\] is infinite"),
        ([0.0, 0.0], "all zero"),
        ([], "empty"),
        ([[1.0, 2.0]], "1-D"),
        ({"a": 1.0}, "sequence"),
        (["x"], "numbers"),
    ],
)
def test_bad_weights_raise_value_error_naming_the_problem(weights: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        blend_counts(weights, 10)
    with pytest.raises(ValueError, match=message):
        BlendSchedule(weights, 10)


def test_bad_arguments_name_the_argument() -> None:
    with pytest.raises(ValueError, match="n must be"):
        blend_counts([1.0], -1)
    with pytest.raises(ValueError, match="num_samples"):
        BlendSchedule([1.0], -5)
    with pytest.raises(TypeError, match="num_samples"):
        BlendSchedule([1.0], 10.0)
    with pytest.raises(ValueError, match="order"):
        BlendSchedule([1.0], 10, order="greedy")
    with pytest.raises(ValueError, match="seed"):
        BlendSchedule([1.0], 10, seed=-1)
    sched = BlendSchedule([1.0, 2.0], 10)
    with pytest.raises(IndexError, match="out of range"):
        sched.lookup(10)
    with pytest.raises(IndexError, match="out of range"):
        sched.lookup(np.array([0, -1]))
    with pytest.raises(TypeError, match="integer dtype"):
        sched.lookup(np.array([0.0]))
    with pytest.raises(ValueError, match="span"):
        sched.export_megatron(range(0, 10, 2))
    with pytest.raises(ValueError, match="span"):
        sched.export_megatron(11)


# --- the fair order ---------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(weights=weights_strategy, n=st.one_of(st.integers(0, 40), st.integers(0, 6000)))
def test_fair_order_is_exact_in_order_and_within_two_samples_of_every_prefix_share(
    weights: list[float], n: int
) -> None:
    assert_exact_fair_schedule(BlendSchedule(weights, n))


@settings(max_examples=25, deadline=None)
@given(weights=weights_strategy, n=st.integers(1, 3000), data=st.data())
def test_random_access_equals_sequential(weights: list[float], n: int, data: st.DataObject) -> None:
    sched = BlendSchedule(weights, n)
    corpus, index = sched.export_megatron()
    shuffled = np.random.default_rng(data.draw(st.integers(0, 2**32))).permutation(n)
    c, i = sched.lookup(shuffled)
    assert np.array_equal(c, corpus[shuffled]) and np.array_equal(i, index[shuffled])
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    c, i = sched.export_megatron(range(start, stop))
    assert np.array_equal(c, corpus[start:stop]) and np.array_equal(i, index[start:stop])
    p = data.draw(st.integers(0, n - 1))
    assert sched[p] == (int(corpus[p]), int(index[p]))
    assert np.array_equal(sched.prefix_counts(p), np.bincount(corpus[:p], minlength=len(weights)))


@pytest.mark.parametrize("seed", range(6))
def test_fair_order_matches_megatron_greedy_counts_and_beats_its_bound(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 60))
    weights = rng.pareto(1.0, k) + 1e-3  # heavy-tailed, like real corpus mixes
    n = int(rng.integers(k, 4000))
    greedy_corpus, greedy_index = megatron_greedy(weights, n)
    greedy_counts = np.bincount(greedy_corpus, minlength=k)
    sched = BlendSchedule(weights, n)
    corpus, _ = assert_exact_fair_schedule(sched)
    # Both are within one sample of the quota, so they differ by at most one per corpus.
    quota = weights / weights.sum() * n
    assert np.all(np.abs(greedy_counts - quota) < 1 + 1e-9)
    assert np.all(np.abs(sched.counts - greedy_counts) <= 1)
    assert max_prefix_error(corpus, sched.counts) <= max(2.0, max_prefix_error(greedy_corpus, greedy_counts))
    for c in range(k):  # greedy also reads each corpus in order; same contract as ours
        assert np.array_equal(greedy_index[greedy_corpus == c], np.arange(greedy_counts[c]))


@pytest.mark.parametrize("n", [1, 37, 999, 1000, 1001, 20011, 200_000])
@pytest.mark.parametrize("shape", ["pareto", "uniform", "geometric"])
def test_thousand_corpora_whole_schedule_is_fair(n: int, shape: str) -> None:
    rng = np.random.default_rng(n)
    weights = {
        "pareto": rng.pareto(0.7, 1000) + 1e-4,
        "uniform": rng.random(1000),
        "geometric": 0.97 ** np.arange(1000.0),
    }[shape]
    assert_exact_fair_schedule(BlendSchedule(weights, n))


def test_dominant_corpus_among_many_tiny_ones_stays_fair() -> None:
    # The case that breaks "rank by ideal time": hundreds of 1-sample corpora due at one instant.
    weights = [1000.0] + [1.0] * 999
    sched = BlendSchedule(weights, 5000)
    assert_exact_fair_schedule(sched)


def test_more_corpora_than_int16_still_look_up_but_refuse_megatron_export() -> None:
    sched = BlendSchedule(np.ones(40_000), 100_000)
    corpus, index = sched.lookup(np.arange(100_000))
    assert np.array_equal(np.bincount(corpus), sched.counts)
    assert corpus.max() > np.iinfo(np.int16).max and index.max() == 2
    with pytest.raises(ValueError, match="int16"):
        sched.export_megatron(10)


def test_zero_samples_and_single_corpus() -> None:
    empty = BlendSchedule([1.0, 2.0], 0)
    c, i = empty.export_megatron()
    assert c.size == 0 and i.size == 0 and len(empty) == 0
    single = BlendSchedule([0.0, 3.0, 0.0], 7)
    c, i = single.export_megatron()
    assert c.tolist() == [1] * 7 and i.tolist() == list(range(7))


# --- huge schedules ---------------------------------------------------------------------------


def test_huge_schedule_random_positions_are_consistent() -> None:
    rng = np.random.default_rng(7)
    weights = rng.random(1000)
    sched = BlendSchedule(weights, HUGE)
    positions = np.unique(rng.integers(0, HUGE, 20000))
    corpus, index = sched.lookup(positions)
    assert np.all((index >= 0) & (index < sched.counts[corpus]))
    for k in np.unique(corpus):  # sorted positions give increasing indices within each corpus
        assert np.all(np.diff(index[corpus == k]) > 0)
    # The vectorised walk (float estimate + exact correction) agrees with exact Python-int counts.
    for p in positions[:: len(positions) // 20]:
        c, i = sched.lookup(int(p))
        before, after = sched.prefix_counts(int(p)), sched.prefix_counts(int(p) + 1)
        assert before[c] == i and after[c] == i + 1 and after.sum() == p + 1
    start = HUGE - 5000
    c, i = sched.export_megatron(range(start, HUGE))
    c2, i2 = sched.lookup(np.arange(start, HUGE)[::-1])
    assert np.array_equal(c, c2[::-1]) and np.array_equal(i, i2[::-1])
    assert np.array_equal(sched.prefix_counts(start) + np.bincount(c, minlength=1000), sched.counts)


def test_construction_memory_does_not_depend_on_num_samples() -> None:
    weights = np.random.default_rng(3).random(1000)
    peaks = []
    for n in (10**6, HUGE):  # both give every corpus a positive count, so the same tree shape
        tracemalloc.start()
        BlendSchedule(weights, n)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 1.2 * peaks[0] + 100_000 and peaks[1] < 5_000_000


# --- Megatron export --------------------------------------------------------------------------

# sha256 (first 16 hex digits) of the exported (int16, int64) arrays, recorded with the export that
# placed each corpus by its own chain of int64 mul-divs (before the two-tier float64 placement).
RECORDED_EXPORTS = {
    "uniform": (lambda: np.random.default_rng(0).random(1000), 2 * 10**9, range(10**9, 10**9 + 3 * 10**6),
                "647de3b932f1b54b"),
    "pareto": (lambda: np.random.default_rng(1).pareto(0.7, 1000) + 1e-4, 10**7, range(10**6), "dc3a61767e6c320d"),
    "geometric": (lambda: 0.97 ** np.arange(1000.0), 10**7, range(5 * 10**6, 6 * 10**6), "943ba295634bce5b"),
    "three": (lambda: [0.2, 0.3, 0.5], 10**6, range(10**6), "1cc3ee8a690718b6"),
    "huge": (lambda: np.random.default_rng(7).random(1000), HUGE, range(HUGE - 10**5, HUGE), "a72df6378cb0f9ab"),
}


@pytest.mark.parametrize("case", sorted(RECORDED_EXPORTS))
def test_export_is_bit_identical_to_the_recorded_arrays(case: str) -> None:
    weights, n, span, expected = RECORDED_EXPORTS[case]
    corpus, index = BlendSchedule(weights(), n).export_megatron(span)
    digest = hashlib.sha256(corpus.astype("<i2").tobytes() + index.astype("<i8").tobytes()).hexdigest()
    assert (corpus.dtype, index.dtype, digest[:16]) == (np.int16, np.int64, expected)


many_weights_strategy = st.integers(30, 400).flatmap(  # enough corpora for clusters
    lambda k: st.lists(st.floats(1e-3, 1e3), min_size=k, max_size=k)
)
sizes_strategy = st.one_of(st.integers(1, 10**5), st.integers(10**5, 10**10), st.integers(2**40, MAX_SAMPLES))


@settings(max_examples=80, deadline=None)
@given(weights=st.one_of(weights_strategy, many_weights_strategy), n=sizes_strategy, data=st.data())
def test_export_equals_the_walk_down_across_superchunks_windows_and_runs(
    weights: list[float], n: int, data: st.DataObject
) -> None:
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start, min(n, start + 20_000)))
    with pytest.MonkeyPatch.context() as tiny:  # tiny tiles: small schedules cross every boundary
        for name, value in (("_SUPER", 1 << 12), ("_WINDOW", 1 << 9), ("_RUN", 1 << 10), ("_CLUSTER", 4)):
            tiny.setattr(blend_export, name, value)
        sched = BlendSchedule(weights, n)
        corpus, index = sched.export_megatron(range(start, stop))
    c, i = sched.lookup(np.arange(start, stop)[::-1])  # descending: walks down, not the export's path
    assert np.array_equal(corpus, c[::-1]) and np.array_equal(index, i[::-1])
    counts = np.bincount(corpus, minlength=len(weights))
    assert np.array_equal(sched.prefix_counts(start) + counts, sched.prefix_counts(stop))


def test_export_at_full_tile_sizes_agrees_with_lookup_and_prefix_counts() -> None:
    sched = BlendSchedule(np.random.default_rng(11).random(1000), 2 * 10**9)
    start, stop = 123_456_789, 123_456_789 + 2 * blend_export._SUPER + 54_321  # three superchunks
    corpus, index = sched.export_megatron(range(start, stop))
    probe = np.unique(np.random.default_rng(12).integers(start, stop, 100_000))[::-1]
    c, i = sched.lookup(probe)
    assert np.array_equal(corpus[probe - start], c) and np.array_equal(index[probe - start], i)
    counts = np.bincount(corpus, minlength=1000)
    assert np.array_equal(sched.prefix_counts(start) + counts, sched.prefix_counts(stop))


# --- the shuffled order -----------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(weights=weights_strategy, n=st.integers(0, 3000), seed=st.integers(0, 2**64 - 1))
def test_shuffled_order_is_a_deterministic_permutation_of_the_fair_one(
    weights: list[float], n: int, seed: int
) -> None:
    fair = BlendSchedule(weights, n).export_megatron()
    shuffled = BlendSchedule(weights, n, seed=seed, order="shuffled")
    c, i = shuffled.export_megatron()
    key = lambda ci: np.sort(ci[0].astype(np.int64) << 32 | ci[1])  # noqa: E731
    assert np.array_equal(key((c, i)), key(fair))
    again = BlendSchedule(weights, n, seed=seed, order="shuffled").lookup(np.arange(n))
    assert np.array_equal(again[0], c) and np.array_equal(again[1], i)


def test_shuffled_order_depends_on_the_seed_and_mixes_corpora() -> None:
    a = BlendSchedule([1.0, 1.0], 1000, seed=1, order="shuffled").export_megatron()[0]
    b = BlendSchedule([1.0, 1.0], 1000, seed=2, order="shuffled").export_megatron()[0]
    fair = BlendSchedule([1.0, 1.0], 1000).export_megatron()[0]
    assert not np.array_equal(a, b) and not np.array_equal(a, fair)
    runs = np.count_nonzero(np.diff(a)) + 1
    assert 400 < runs < 600  # a uniform interleave of two halves has ~n/2 runs, the fair one n
