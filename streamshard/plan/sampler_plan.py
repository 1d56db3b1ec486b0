"""Index arithmetic behind ``ElasticSampler``: node subsets, epoch order, dealing and resize folds.

Pure planning (numpy only, no torch, no state). Everything is arithmetic on positions; nothing
per sample is stored:

* **Node subsets.** ``range(n)`` is put in a fixed order that depends on ``seed`` only (a
  :class:`Permutation`, or the identity when ``shuffle=False``) and cut into ``num_nodes``
  contiguous blocks, the first ``n % num_nodes`` one sample larger. Node ``j`` owns block ``j``
  for the whole run, so a node-local cache stays valid from epoch to epoch.
* **Epoch order.** Each (seed, epoch, node) gets its own permutation of the node's block; the
  epoch's *pool* is the concatenation of the nodes' shuffled blocks.
* **Dealing.** The ``L = num_replicas // num_nodes`` local ranks of node ``j`` take the node's
  positions round robin: local rank ``l`` gets positions ``l, l + L, l + 2L, ...``. After every
  replica has consumed ``k`` samples, each node has consumed exactly the first ``k * L``
  positions of its block: the progress of a whole epoch is one number per node layout.
* **Equal counts.** Every replica gets ``c`` samples: ``ceil(rest / L)`` of the largest node's
  rest with ``drop_last=False``, ``floor(rest / L)`` of the smallest node's with ``drop_last=True``.
  Padding wraps around to the start of the node's own order (repeats of the node's first
  samples, so padding never leaves the node); ``drop_last`` drops each node's tail. Padding and
  dropping stay below ``num_replicas`` samples per epoch.
* **Resizing.** Re-dealing the rest of an epoch to ``L'`` local ranks just continues from the
  consumed offset with the new stride, node by node. When ``num_nodes`` changes, the nodes'
  unconsumed suffixes are concatenated into a new pool that is cut into the new nodes' blocks
  (each new node takes mostly the samples of one or two old nodes, in their shuffled order); a
  position in the new pool maps back to the old one arithmetically, so the state only records
  ``[num_nodes, offset]`` per earlier layout of the epoch (a *layout*).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .permutation import Permutation, mix_seed

__all__ = ["Segment", "max_offset", "pool_size", "remaining", "sample_ids"]

# Domain tags so the sampler's shuffles share no seed with other users of mix_seed.
_NODE_SPLIT_TAG, _EPOCH_ORDER_TAG = 0x53414D504C4552, 0x45504F4348


def _blocks(size: int, parts: int) -> tuple[int, int]:
    """``size`` cut into ``parts`` contiguous blocks: ``(small, big_count)``.

    The first ``big_count`` blocks hold ``small + 1`` items, the rest ``small``.
    """
    return divmod(size, parts)


def _block_start(j: Any, small: int, big: int) -> Any:
    return j * small + np.minimum(j, big)


def _block_of(q: np.ndarray, small: int, big: int) -> np.ndarray:
    """Which block each position ``q`` falls in (the inverse of :func:`_blocks`)."""
    edge = big * (small + 1)
    return np.where(q < edge, q // (small + 1), big + (q - edge) // max(small, 1))


def max_offset(size: int, nodes: int) -> int:
    """The largest block of a pool of ``size`` cut over ``nodes``: where every node is done."""
    small, big = _blocks(size, nodes)
    return small + (big > 0)


def remaining(size: int, nodes: int, offset: int) -> int:
    """Pool size left when every node has consumed the first ``offset`` positions of its block."""
    small, big = _blocks(size, nodes)
    return big * max(0, small + 1 - offset) + (nodes - big) * max(0, small - offset)


def pool_size(n: int, layouts: Sequence[tuple[int, int]]) -> int:
    """Size of the pool left after the epoch's earlier ``(num_nodes, offset)`` layouts."""
    size = n
    for nodes, offset in layouts:
        size = remaining(size, nodes, offset)
    return size


def _to_parent(q: np.ndarray, size: int, nodes: int, offset: int) -> np.ndarray:
    """Positions in the pool of unconsumed suffixes -> positions in the pool they came from."""
    if q.size == 0:
        return q
    small, big = _blocks(size, nodes)
    rest = small - offset  # the suffixes are blocks of the same shape: `big` of them one longer
    node = _block_of(q, rest, big)
    within = q - _block_start(node, rest, big)
    return _block_start(node, small, big) + offset + within


def _epoch_ids(q: np.ndarray, n: int, nodes: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Positions in an epoch's first pool -> sample ids (node blocks, shuffled per epoch)."""
    if not shuffle:
        return q
    small, big = _blocks(n, nodes)
    node = _block_of(q, small, big)
    start = _block_start(node, small, big)
    within = q - start
    for j in np.unique(node).tolist():
        mask = node == j
        order = Permutation(small + (j < big), mix_seed(_EPOCH_ORDER_TAG, seed, epoch, j))
        within[mask] = order[within[mask]]
    return Permutation(n, mix_seed(_NODE_SPLIT_TAG, seed))[start + within]


def sample_ids(q: np.ndarray, n: int, layouts: Sequence[tuple[int, int]], nodes: int,
               seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Positions in the current pool -> sample ids, folded back through every earlier layout.

    ``nodes`` is the current node count: it cuts the epoch's first pool when there are no
    earlier ``layouts``.
    """
    sizes = [n]
    for layout_nodes, offset in layouts[:-1]:
        sizes.append(remaining(sizes[-1], layout_nodes, offset))
    for (layout_nodes, offset), size in zip(reversed(layouts), reversed(sizes)):
        q = _to_parent(q, size, layout_nodes, offset)
    first_nodes = layouts[0][0] if layouts else nodes
    return _epoch_ids(q, n, first_nodes, seed, epoch, shuffle)


@dataclass(frozen=True)
class Segment:
    """The current stretch of an epoch: one node layout, one replica count, a start offset."""

    pool: int  # size of this layout's pool
    nodes: int
    local: int  # replicas per node
    offset: int  # positions of each node's block consumed before this segment
    drop_last: bool

    @property
    def per_replica(self) -> int:
        """Samples each replica yields in this segment."""
        small, big = _blocks(self.pool, self.nodes)
        if self.drop_last:
            return max(0, small - self.offset) // self.local
        return math.ceil(max(0, small + (big > 0) - self.offset) / self.local)

    def offset_after(self, steps: int) -> int:
        """Each node's consumed offset once every replica has taken ``steps`` samples here."""
        return min(self.offset + steps * self.local, max_offset(self.pool, self.nodes))

    def positions(self, node: int, local_rank: int, steps: np.ndarray) -> np.ndarray:
        """Pool positions of ``local_rank`` on ``node`` at the given steps (padding wrapped)."""
        small, big = _blocks(self.pool, self.nodes)
        size = small + (node < big)
        p = self.offset + local_rank + self.local * steps
        if size == 0:  # fewer samples than nodes: borrow from the whole pool
            return p % self.pool
        return _block_start(node, small, big) + np.where(p < size, p, p % size)
