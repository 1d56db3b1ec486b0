"""Specification of streamshard.plan.permutation: a keyed, random-access bijection of range(n)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamshard.plan.permutation import MAX_N, Permutation, mix_seed

REPO = Path(__file__).resolve().parents[1]
SEEDS = st.integers(min_value=0, max_value=2**64 - 1)
# Sizes where a balanced-Feistel or off-by-one domain choice tends to break: tiny ranges, powers
# of two and their neighbours, and 65,537 / 262,145 (2**16 + 1, 2**18 + 1).
EDGE_SIZES = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 127, 128, 129, 255, 256, 257,
              1023, 1024, 1025, 4095, 4096, 4097, 65535, 65536, 65537, 262143, 262144, 262145,
              1_000_003]
HUGE_SIZES = [2**31 + 1, 2**32 - 1, 2**32, 2**32 + 1, 2**33 + 1, 10**12, 2**62 - 1, 2**62]


def assert_bijection(n: int, seed: int) -> None:
    """p maps arange(n) onto arange(n) exactly once, and inverse undoes it."""
    p = Permutation(n, seed)
    ids = np.arange(n, dtype=np.int64)
    image = p[ids]
    assert image.dtype == np.int64
    assert np.array_equal(np.sort(image), ids), f"not a bijection for n={n}, seed={seed}"
    assert np.array_equal(p.inverse(image), ids)


def sample_indices(n: int, rng: np.random.Generator, size: int = 20_000) -> np.ndarray:
    """Distinct random indices in range(n) plus both ends and the middle."""
    edges = np.array([0, 1, n // 2, n - 2, n - 1], dtype=np.int64)
    drawn = rng.integers(0, n, size=size, dtype=np.int64)
    return np.unique(np.concatenate([edges[(edges >= 0) & (edges < n)], drawn]))


# -- bijection -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", EDGE_SIZES)
def test_bijective_on_edge_sizes(n):
    for seed in (0, 1, 2**64 - 1):
        assert_bijection(n, seed)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(min_value=1, max_value=2_000_000), seed=SEEDS)
def test_bijective_for_any_size_and_seed(n, seed):
    assert_bijection(n, seed)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(min_value=1, max_value=300), seed=SEEDS)
def test_bijective_on_small_sizes_via_scalar_access(n, seed):
    p = Permutation(n, seed)
    image = [p[i] for i in range(n)]
    assert sorted(image) == list(range(n))
    assert [p.inverse(j) for j in image] == list(range(n))


@pytest.mark.parametrize("n", HUGE_SIZES)
def test_huge_sizes_round_trip_on_samples(n):
    rng = np.random.default_rng(n % 2**32)
    ids = sample_indices(n, rng)
    p = Permutation(n, 12345)
    image = p[ids]
    assert image.dtype == np.int64
    assert image.min() >= 0 and image.max() < n
    assert np.unique(image).size == ids.size  # distinct inputs never collide
    assert np.array_equal(p.inverse(image), ids)
    # The image must spread over the whole range, not just its low part.
    assert image.max() > n // 2


def test_empty_and_single_element_ranges():
    empty = Permutation(0, 3)
    assert len(empty) == 0
    assert empty[np.arange(0)].shape == (0,)
    one = Permutation(1, 3)
    assert one[0] == 0 and one.inverse(0) == 0
    assert one[np.zeros((2, 3), dtype=np.int64)].tolist() == [[0] * 3] * 2


# -- access forms ----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(n=st.integers(min_value=1, max_value=MAX_N), seed=SEEDS, data=st.data())
def test_scalar_access_matches_vectorised(n, seed, data):
    indices = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=20))
    p = Permutation(n, seed)
    image = p[np.array(indices, dtype=np.int64)]
    assert [p[i] for i in indices] == image.tolist()
    assert [p.inverse(j) for j in image.tolist()] == indices
    assert all(type(p[i]) is int for i in indices[:3])


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
                                   np.int64, np.uint64])
def test_any_integer_dtype_gives_the_same_int64_result(dtype):
    p = Permutation(100, 9)
    ids = np.arange(100)
    assert np.array_equal(p[ids.astype(dtype)], p[ids])
    assert p[ids.astype(dtype)].dtype == np.int64


def test_array_shape_is_preserved_and_strides_do_not_matter():
    p = Permutation(10**6, 4)
    grid = np.arange(24, dtype=np.int64).reshape(2, 3, 4) * 1000
    assert p[grid].shape == (2, 3, 4)
    assert np.array_equal(p[grid].ravel(), p[grid.ravel()])
    transposed = grid.T  # non-contiguous view
    assert np.array_equal(p[transposed], p[transposed.copy()])
    assert p[np.empty((0, 5), dtype=np.int32)].shape == (0, 5)
    assert p.inverse(p[grid]).tolist() == grid.tolist()
    assert grid.tolist() == (np.arange(24).reshape(2, 3, 4) * 1000).tolist()  # input untouched


def test_numpy_integer_scalars_are_scalars():
    p = Permutation(1000, 2)
    assert p[np.int64(7)] == p[7] and type(p[np.uint32(7)]) is int


@pytest.mark.parametrize("forward", [True, False])
def test_sparse_and_dense_requests_agree(forward):
    # Two array strategies exist: a sparse request (under half the 2**k domain) runs the rounds
    # on its own elements block by block; a dense one (such as arange(n)) encrypts the domain
    # once and walks by lookup. n = 2**20 + 1 has a domain of about 2n, so half of all entries
    # cycle-walk, and 200,000 indices span several blocks.
    n = 2**20 + 1
    p = Permutation(n, 77)
    apply = p.__getitem__ if forward else p.inverse
    dense = apply(np.arange(n, dtype=np.int64))
    ids = np.random.default_rng(0).integers(0, n, size=200_000, dtype=np.int64)  # with repeats
    assert np.array_equal(apply(ids), dense[ids])
    assert [apply(int(i)) for i in ids[:50]] == dense[ids[:50]].tolist()


# -- determinism and keys --------------------------------------------------------------------


def test_same_seed_same_output_in_another_process():
    cases = [(65537, 5), (2**32 + 1, 2**64 - 1), (10**12, 0)]
    ids = [0, 1, 2, 3, 1000, 65536]
    script = (
        "import json, sys, numpy as np\n"
        "from streamshard.plan.permutation import Permutation, mix_seed\n"
        "cases, ids = json.loads(sys.argv[1])\n"
        "out = [Permutation(n, s)[np.array(ids)].tolist() for n, s in cases]\n"
        "print(json.dumps([out, mix_seed(1, 2, 2**64 - 1)]))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps([cases, ids])],
        capture_output=True, text=True, check=True, env=env, cwd=REPO,
    )
    theirs, their_seed = json.loads(done.stdout)
    ours = [Permutation(n, s)[np.array(ids)].tolist() for n, s in cases]
    assert theirs == ours
    assert their_seed == mix_seed(1, 2, 2**64 - 1)


def test_equal_arguments_give_equal_permutations():
    a, b = Permutation(10**9, 42), Permutation(10**9, 42)
    ids = np.arange(0, 10**9, 9973, dtype=np.int64)
    assert np.array_equal(a[ids], b[ids])
    assert a == b and hash(a) == hash(b) and a != Permutation(10**9, 43)


@pytest.mark.parametrize("n", [1000, 65537, 10**6])
def test_different_seeds_give_unrelated_permutations(n):
    ids = np.arange(min(n, 100_000), dtype=np.int64)
    base = Permutation(n, 0)[ids]
    for seed in (1, 2, 2**63, 2**64 - 1):
        other = Permutation(n, seed)[ids]
        # Unrelated permutations agree on about one position in n.
        assert np.mean(base == other) < 0.02
        assert abs(np.corrcoef(base, other)[0, 1]) < 5 / math.sqrt(ids.size)


def test_different_sizes_give_unrelated_permutations():
    ids = np.arange(10_000, dtype=np.int64)
    a, b = Permutation(2**20, 3)[ids], Permutation(2**20 - 1, 3)[ids]
    assert np.mean(a == b) < 0.01


# -- statistical quality ---------------------------------------------------------------------


def chi_square(counts: np.ndarray, weights: np.ndarray | None = None) -> float:
    """Pearson's statistic of ``counts`` against cell probabilities ``weights`` (default equal)."""
    weights = np.ones(counts.size) if weights is None else np.asarray(weights, dtype=np.float64)
    expected = counts.sum() * weights / weights.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def chi_square_limit(df: int) -> float:
    """About the 99.99th percentile of chi-square(df) (Wilson-Hilferty, z = 3.72)."""
    return df * (1 - 2 / (9 * df) + 3.72 * math.sqrt(2 / (9 * df))) ** 3


def test_positions_are_uncorrelated_and_neighbours_scatter():
    n = 200_000
    ids = np.arange(n, dtype=np.int64)
    image = Permutation(n, 2024)[ids].astype(np.float64)
    rho = np.corrcoef(ids, image)[0, 1]  # Spearman: both are already ranks
    assert abs(rho) < 5 / math.sqrt(n)
    assert np.mean(np.abs(np.diff(image)) == 1) < 20 / n
    fixed = int(np.sum(image == ids))
    assert fixed < 10  # a random permutation has Poisson(1) fixed points


@pytest.mark.parametrize("n", [5, 10, 64, 1000, 2**20 + 1])
def test_first_element_lands_uniformly_over_seeds(n):
    seeds = range(3000)
    buckets = min(n, 20)
    landing = np.array([Permutation(n, s)[0] * buckets // n for s in seeds])
    counts = np.bincount(landing, minlength=buckets)
    edges = -(-np.arange(buckets + 1) * n // buckets)  # bucket b holds ceil(b*n/B) .. ceil((b+1)*n/B)-1
    assert chi_square(counts, weights=np.diff(edges)) < chi_square_limit(buckets - 1)


def test_all_orders_of_a_tiny_range_are_equally_likely_over_seeds():
    # n = 5 needs about 16 rounds before its 120 orders are equally likely; with the 6 rounds
    # that suffice for large domains this fails clearly.
    n, seeds = 5, 5000
    orders = [tuple(Permutation(n, s)[np.arange(n)].tolist()) for s in range(seeds)]
    _, counts = np.unique(np.array(orders), axis=0, return_counts=True)
    assert counts.size == math.factorial(n)
    assert chi_square(counts) < chi_square_limit(counts.size - 1)


def test_index_pairs_differing_in_high_bits_have_unbiased_xor():
    # Few-round Feistel networks leak here: inputs differing in the high half map to outputs
    # whose XOR is biased. Over many seeds the XOR of the two images must look uniform.
    n, seeds = 2**12, 3000
    xors = np.array([(lambda p: p[0] ^ p[64])(Permutation(n, s)) for s in range(seeds)])
    # Top 8 bits of the XOR; cell 0 is dropped because a XOR of distinct values is never 0.
    counts = np.bincount(xors >> 4, minlength=256)[1:]
    assert chi_square(counts) < chi_square_limit(254)


# -- mix_seed --------------------------------------------------------------------------------


def test_mix_seed_is_a_64_bit_order_sensitive_hash():
    assert mix_seed(1, 2) != mix_seed(2, 1)
    assert mix_seed(0) != mix_seed() != mix_seed(0, 0)
    assert mix_seed(7, 8) == mix_seed(7, 8)
    for value in (mix_seed(), mix_seed(2**64 - 1), mix_seed(3, 2**64 - 1, 0)):
        assert type(value) is int and 0 <= value < 2**64


def test_mix_seed_never_collides_across_epochs_of_one_seed():
    seeds = {mix_seed(123, epoch) for epoch in range(20_000)}
    assert len(seeds) == 20_000


@settings(max_examples=200, deadline=None)
@given(keys=st.lists(st.integers(0, 2**64 - 1), max_size=4), last=st.integers(0, 2**64 - 1),
       other=st.integers(0, 2**64 - 1))
def test_mix_seed_is_injective_in_the_last_key(keys, last, other):
    same = mix_seed(*keys, last) == mix_seed(*keys, other)
    assert same == (last == other)


def test_mix_seed_accepts_numpy_integers():
    assert mix_seed(np.int64(5), np.uint64(2**64 - 1)) == mix_seed(5, 2**64 - 1)


@pytest.mark.parametrize("bad", [-1, 2**64])
def test_mix_seed_rejects_out_of_range_keys(bad):
    with pytest.raises(ValueError, match=r"keys\[1\]"):
        mix_seed(0, bad)


@pytest.mark.parametrize("bad", [1.0, "3", None, True])
def test_mix_seed_rejects_non_integers(bad):
    with pytest.raises(TypeError, match=r"keys\[0\]"):
        mix_seed(bad)


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [-1, 2**62 + 1, 2**64])
def test_size_out_of_range_is_rejected(n):
    with pytest.raises(ValueError, match="n must be"):
        Permutation(n, 0)


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_seed_out_of_range_is_rejected(seed):
    with pytest.raises(ValueError, match="seed must be"):
        Permutation(10, seed)


@pytest.mark.parametrize("args", [(10.0, 0), ("10", 0), (10, 0.5), (10, None), (True, 0)])
def test_non_integer_arguments_are_rejected(args):
    with pytest.raises(TypeError, match="n must be|seed must be"):
        Permutation(*args)


@pytest.mark.parametrize("index", [10, 11, -1, -10, 2**70])
def test_out_of_range_scalar_index_names_index_and_size(index):
    p = Permutation(10, 0)
    for method in (p.__getitem__, p.inverse):
        with pytest.raises(IndexError, match=rf"index {index} .*n=10"):
            method(index)


def test_negative_indices_do_not_wrap_around():
    with pytest.raises(IndexError):
        Permutation(10, 0)[np.array([0, -1])]


def test_out_of_range_array_index_names_the_offender():
    p = Permutation(10, 0)
    with pytest.raises(IndexError, match=r"index 12 .*n=10"):
        p[np.array([[1, 12], [3, 4]])]
    with pytest.raises(IndexError, match=r"index 2\*\*64-1|index 18446744073709551615"):
        p.inverse(np.array([2**64 - 1], dtype=np.uint64))


def test_any_index_into_an_empty_range_is_out_of_range():
    with pytest.raises(IndexError, match="n=0"):
        Permutation(0, 0)[0]


@pytest.mark.parametrize("index", [1.0, "1", None, [1, 2], np.array([1.0]), np.array([True])])
def test_non_integer_indices_are_rejected(index):
    with pytest.raises(TypeError):
        Permutation(10, 0)[index]
