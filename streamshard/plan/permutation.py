"""Random-access pseudorandom permutations of ``range(n)`` in O(1) memory.

A :class:`Permutation` is a keyed bijection, not an array: ``p[i]`` is computed on demand, so a
permutation of 10**12 rows costs a few hundred bytes. The planner uses it to order units and the
rows inside a unit for each (seed, epoch).

Design (why it is a bijection for every ``n``):

* The domain is rounded up to ``2**k`` with ``k = max(2, bit_length(n - 1))``, so it is less than
  twice ``n`` (the balanced even-``k`` choice would be up to four times ``n`` and cost twice the
  work on sizes such as 2**32 + 1).
* On ``2**k`` we run an unbalanced Feistel network: the index is split into a high half of
  ``ceil(k/2)`` bits and a low half of ``floor(k/2)`` bits, and each round XORs one half with a
  keyed hash of the other, alternating halves. Each round is its own inverse, so the network is a
  bijection of ``range(2**k)`` whatever the round function, and the inverse runs the rounds
  backwards.
* Cycle walking maps it onto ``range(n)``: re-encrypt while the result is ``>= n``. The walk from
  an in-range start stays on that start's cycle and stops at the next in-range point, which is a
  bijection of ``range(n)``. Only the still out-of-range elements are re-processed; the expected
  number of passes is below 2 because ``2**k < 2 * n``.
* The round function is a multiply-xorshift-multiply hash of ``half ^ key`` (the shape of the
  splitmix64 finaliser, whose constants it uses, minus the first xorshift: with an input of at most
  31 bits the top half of ``half ^ key`` is key alone, so that step adds nothing), keeping the top bits of the last product: those
  depend on every input bit, so no masking of weak low bits is needed. Round keys come from
  :func:`mix_seed` over (seed, n) feeding a splitmix64 stream, so every size and seed gets
  unrelated keys.
* Rounds: 6 for domains of 2**10 and up (4 rounds leave a measurable XOR-differential bias between
  inputs that differ in the high half; 6 do not, see ``benchmarks/RESULTS.md``),
  rising by 3 per bit below that to 29 at 2**2, because a half with few values mixes little per
  round (n = 5 needs about 16 rounds before its 120 orders are equally likely over seeds); small
  domains mean small arrays, so the extra rounds cost microseconds.

All arithmetic is on uint64 with wrap-around (numpy arrays wrap silently; the scalar path masks
Python ints to 64 bits), so results are identical across runs, processes and platforms.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from .validate import check_int

__all__ = ["Permutation", "mix_seed"]

MAX_N = 2**62
_MASK64 = 2**64 - 1
# splitmix64 constants (Steele, Lea & Flood 2014): the golden-ratio increment and the finaliser.
_GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
# Fixed tags so that a permutation's round keys differ from any other use of mix_seed.
_SEED_IV = 0x5354524D53484152  # ASCII "STRMSHAR"
_PERM_TAG = 0x5045524D5554  # ASCII "PERMUT"
MIN_ROUNDS = 6
# Rounds are max(MIN_ROUNDS, _ROUND_BUDGET - 3 * k) for a 2**k domain: 29 at k=2, 6 from k=10 up.
_ROUND_BUDGET = 35
# Elements per block in the vectorised path: the work arrays stay in L2 yet each numpy call
# has enough elements to hide its ~1 us overhead (measured: 2**15 beats 2**13 and 2**17).
_BLOCK = 1 << 15
# Below this many out-of-range entries a block stops walking and defers them to one global pass,
# because numpy's per-call overhead would dominate such small arrays.
_STRAGGLERS = _BLOCK // 8

_U_M1 = np.uint64(_M1)
_U_M2 = np.uint64(_M2)


def _mix64(z: int) -> int:
    """splitmix64 finaliser on a Python int: a bijection of the 64-bit integers."""
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def _round_keys(base: int, rounds: int) -> tuple[int, ...]:
    """Independent-looking 64-bit round keys: the splitmix64 stream started at ``base``."""
    return tuple(_mix64((base + (r + 1) * _GAMMA) & _MASK64) for r in range(rounds))


def mix_seed(*keys: int) -> int:
    """Hash non-negative integers (each < 2**64) into one 64-bit seed.

    Chains the splitmix64 finaliser: ``h = mix64((h ^ key) + GAMMA)`` per key, then mixes in the
    key count. Pure integer arithmetic, so it is the same on every platform and process (unlike
    ``hash()``), and it is order-sensitive. For a fixed prefix, distinct last keys always give
    distinct seeds (each step is a bijection), so ``mix_seed(seed, epoch)`` never collides
    across epochs.
    """
    h = _SEED_IV
    for position, key in enumerate(keys):
        key = check_int(key, f"keys[{position}]", 0, _MASK64)
        h = _mix64(((h ^ key) + _GAMMA) & _MASK64)
    return _mix64(h ^ len(keys))


class Permutation:
    """A pseudorandom bijection of ``range(n)`` keyed by ``seed``, evaluated on demand.

    ``p[i]`` maps an int to an int and an integer numpy array (any shape) to an int64 array of
    the same shape; ``p.inverse(j)`` undoes it. The object holds a few round keys whatever ``n``
    is; a scalar lookup is expected O(1) and an array lookup needs working memory in proportion
    to the request (at most about twice its size), never to ``n``. Indices must lie in ``[0, n)``: negative indices raise IndexError instead of wrapping,
    because a wrapped shuffle index is almost always a planning bug.
    """

    __slots__ = ("_n", "_seed", "_low_bits", "_high_bits", "_rounds", "_keys", "_ukeys")

    def __init__(self, n: int, seed: int) -> None:
        self._n = check_int(n, "n", 0, MAX_N)
        self._seed = check_int(seed, "seed", 0, _MASK64)
        k = max(2, (self._n - 1).bit_length())
        self._low_bits = k // 2
        self._high_bits = k - self._low_bits
        self._rounds = max(MIN_ROUNDS, _ROUND_BUDGET - 3 * k)
        self._keys = _round_keys(mix_seed(_PERM_TAG, self._seed, self._n), self._rounds)
        self._ukeys = tuple(np.uint64(key) for key in self._keys)

    @property
    def n(self) -> int:
        """Size of the permuted range."""
        return self._n

    @property
    def seed(self) -> int:
        """The 64-bit key this permutation was built from."""
        return self._seed

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"Permutation(n={self._n}, seed={self._seed})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Permutation):
            return NotImplemented
        return (self._n, self._seed) == (other._n, other._seed)

    def __hash__(self) -> int:
        return hash((Permutation, self._n, self._seed))

    def __getitem__(self, i: Any) -> Any:
        """The position ``i`` is sent to: an int for an int, an int64 array for an array."""
        return self._apply(i, forward=True)

    def inverse(self, j: Any) -> Any:
        """The index ``i`` with ``self[i] == j``; same input forms as ``__getitem__``."""
        return self._apply(j, forward=False)

    # -- dispatch and validation ------------------------------------------------------------

    def _apply(self, index: Any, forward: bool) -> Any:
        if isinstance(index, np.ndarray):
            return self._apply_array(index, forward)
        if isinstance(index, (bool, np.bool_)):
            raise TypeError(f"index must be an integer or an integer numpy array, got bool {index!r}")
        try:
            scalar = operator.index(index)
        except TypeError:
            raise TypeError(
                "index must be an integer or an integer numpy array, "
                f"got {type(index).__name__}"
            ) from None
        if not 0 <= scalar < self._n:
            raise IndexError(f"index {scalar} out of range for Permutation of n={self._n}")
        return self._walk_scalar(scalar, forward)

    def _apply_array(self, index: np.ndarray, forward: bool) -> np.ndarray:
        if index.dtype.kind not in "iu":
            raise TypeError(f"index array must have an integer dtype, got {index.dtype}")
        if index.size == 0:
            return np.empty(index.shape, dtype=np.int64)
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= self._n:
            bad = low if low < 0 else high
            raise IndexError(f"index {bad} out of range for Permutation of n={self._n}")
        flat = np.ascontiguousarray(index).reshape(-1)
        # Non-negative int64 reinterprets as uint64 for free; other dtypes need a converting copy.
        flat = flat.view(np.uint64) if flat.dtype.itemsize == 8 else flat.astype(np.uint64)
        out = np.empty(flat.shape, dtype=np.uint64)
        self._walk_array(flat, out, forward)
        return out.view(np.int64).reshape(index.shape)

    # -- scalar path (Python ints, masked to 64 bits) -----------------------------------------

    def _walk_scalar(self, x: int, forward: bool) -> int:
        x = self._rounds_scalar(x, forward)
        while x >= self._n:
            x = self._rounds_scalar(x, forward)
        return x

    def _rounds_scalar(self, x: int, forward: bool) -> int:
        low_bits, high_bits = self._low_bits, self._high_bits
        high, low = x >> low_bits, x & ((1 << low_bits) - 1)
        order = range(self._rounds) if forward else range(self._rounds - 1, -1, -1)
        for r in order:
            if r % 2 == 0:
                high ^= _round_scalar(low, self._keys[r], high_bits)
            else:
                low ^= _round_scalar(high, self._keys[r], low_bits)
        return (high << low_bits) | low

    # -- vectorised path (uint64 arrays, processed in cache-sized blocks) ----------------------

    def _walk_array(self, flat: np.ndarray, out: np.ndarray, forward: bool) -> None:
        """``out[i] = self[flat[i]]`` (or the inverse) for in-range uint64 indices."""
        domain = 1 << (self._low_bits + self._high_bits)
        if domain <= 2 * flat.size:
            self._walk_by_table(flat, out, forward, domain)
            return
        work = _Workspace(min(_BLOCK, flat.size))
        stragglers = []
        for start in range(0, flat.size, _BLOCK):
            block = out[start : start + _BLOCK]
            self._rounds_array(flat[start : start + _BLOCK], block, forward, work)
            # Walk while the block is still in cache; defer the last few to one global pass.
            left = self._walk_in_place(block, forward, until=_STRAGGLERS)
            if left.size:
                stragglers.append(left + start)
        if stragglers:
            self._walk_in_place(out, forward, until=0, pending=np.concatenate(stragglers))

    def _walk_by_table(self, flat: np.ndarray, out: np.ndarray, forward: bool, domain: int) -> None:
        """Encrypt the whole ``2**k`` domain once, then cycle-walk by table lookups.

        Used when the request is at least half the domain (``p[arange(n)]`` always is): the
        rounds then cost no more than encrypting the request, and each walking pass becomes one
        gather instead of a full Feistel pass, which matters most for small ``n``.
        """
        table = np.arange(domain, dtype=np.uint64)
        self._rounds_blocks(table, forward)
        limit = np.uint64(self._n)
        np.take(table, flat.view(np.int64), out=out)  # indices < 2**62: the view is exact
        pending = np.flatnonzero(out >= limit)
        while pending.size:
            again = table[out[pending]]
            out[pending] = again
            pending = pending[again >= limit]

    def _walk_in_place(
        self,
        values: np.ndarray,
        forward: bool,
        until: int,
        pending: "np.ndarray | None" = None,
    ) -> np.ndarray:
        """Cycle-walk the entries of ``values`` that are ``>= n`` until at most ``until`` remain.

        Only the out-of-range entries are gathered and re-encrypted, so each pass costs in
        proportion to what is left. Returns the positions still out of range.
        """
        limit = np.uint64(self._n)
        if pending is None:
            pending = np.flatnonzero(values >= limit)
        while pending.size > until:
            again = values[pending]
            self._rounds_blocks(again, forward)
            values[pending] = again
            pending = pending[again >= limit]
        return pending

    def _rounds_blocks(self, values: np.ndarray, forward: bool) -> None:
        """One pass of the Feistel network over ``values`` in place, block by block."""
        work = _Workspace(min(_BLOCK, values.size))
        for start in range(0, values.size, _BLOCK):
            block = values[start : start + _BLOCK]
            self._rounds_array(block, block, forward, work)

    def _rounds_array(
        self, x: np.ndarray, out: np.ndarray, forward: bool, work: "_Workspace"
    ) -> None:
        size = x.size
        high, low, tmp, shifted = (buf[:size] for buf in work.buffers)
        np.right_shift(x, np.uint64(self._low_bits), out=high)
        np.bitwise_and(x, np.uint64((1 << self._low_bits) - 1), out=low)
        order = range(self._rounds) if forward else range(self._rounds - 1, -1, -1)
        for r in order:
            if r % 2 == 0:
                _round_array(low, self._ukeys[r], self._high_bits, high, tmp, shifted)
            else:
                _round_array(high, self._ukeys[r], self._low_bits, low, tmp, shifted)
        np.left_shift(high, np.uint64(self._low_bits), out=out)
        np.bitwise_or(out, low, out=out)


class _Workspace:
    """Scratch uint64 arrays reused across blocks, so the hot loop allocates nothing."""

    __slots__ = ("buffers",)

    def __init__(self, size: int) -> None:
        self.buffers = tuple(np.empty(size, dtype=np.uint64) for _ in range(4))


def _round_scalar(half: int, key: int, width: int) -> int:
    """Keyed hash of ``half`` reduced to ``width`` bits (top bits of the last product)."""
    z = ((half ^ key) * _M1) & _MASK64
    z = ((z ^ (z >> 32)) * _M2) & _MASK64
    return z >> (64 - width)


def _round_array(
    half: np.ndarray,
    key: np.uint64,
    width: int,
    target: np.ndarray,
    tmp: np.ndarray,
    shifted: np.ndarray,
) -> None:
    """``target ^= F(half)`` in place; the array twin of :func:`_round_scalar` (7 numpy calls)."""
    np.bitwise_xor(half, key, out=tmp)
    np.multiply(tmp, _U_M1, out=tmp)
    np.right_shift(tmp, np.uint64(32), out=shifted)
    np.bitwise_xor(tmp, shifted, out=tmp)
    np.multiply(tmp, _U_M2, out=tmp)
    np.right_shift(tmp, np.uint64(64 - width), out=tmp)
    np.bitwise_xor(target, tmp, out=target)
