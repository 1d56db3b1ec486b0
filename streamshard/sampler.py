"""``ElasticSampler``: a map-style sampler with node-local shuffling and mid-epoch resizing.

The torch-facing edge: argument and state validation, the epoch/resume/resize state machine and
iteration. Which sample each replica gets is pure arithmetic in :mod:`streamshard.sampler_plan`
(node subsets, per-epoch order, dealing, and the fold of earlier node layouts after a resize).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from .permutation import MAX_N
from .sampler_plan import Segment, max_offset, pool_size, remaining, sample_ids
from .topology import resolve_rank_world

__all__ = ["ElasticSampler"]

STATE_VERSION = 1
_MAX_SEED = 2**64 - 1
# Indices computed per numpy call while iterating: enough to amortise numpy, small in memory.
_CHUNK = 1 << 14
_STATE_KEYS = ("version", "dataset_len", "seed", "shuffle", "drop_last", "epoch", "num_replicas",
               "num_nodes", "layouts", "offset", "segment_start", "yielded", "consumed")


# -- the sampler -----------------------------------------------------------------------------------


class ElasticSampler(Sampler[int]):
    """Sample indices of a map-style dataset for one replica of a data-parallel job.

    Guarantees, for every epoch:

    * every replica yields the same number of indices (``len(self)`` for a fresh epoch:
      ``ceil(n / num_replicas)``, or ``floor`` with ``drop_last=True``);
    * across all replicas each index in ``range(n)`` is yielded exactly once when
      ``n % num_replicas == 0``; otherwise ``drop_last=False`` repeats fewer than
      ``num_replicas`` indices (each node wraps around to the start of its own epoch order) and
      ``drop_last=True`` drops fewer than ``num_replicas`` (each node's tail). Only a node with
      no samples at all (``n < num_nodes``) pads from other nodes' samples;
    * node affinity: while ``num_nodes`` is unchanged, node ``j`` (ranks
      ``j * L .. (j + 1) * L - 1``, ``L = num_replicas // num_nodes``) receives the same subset
      of indices in every epoch; only the order within the node changes with the epoch;
    * determinism: the indices depend only on (dataset_len, seed, epoch, topology, shuffle,
      drop_last) and on where resizes happened.

    Resuming: :meth:`state_dict` is small, JSON-serialisable and identical on every replica of
    a synchronous job. :meth:`load_state_dict` (or :meth:`resize`) makes the *next* ``__iter__``
    continue the epoch; any other ``__iter__`` starts the current epoch from its beginning, like
    ``DistributedSampler``. ``set_epoch`` with a new epoch starts that epoch; with the current
    epoch it keeps a pending resume, so ``for e in range(start, E): set_epoch(e)`` resumes.

    Samples consumed: the sampler counts what it has *yielded*. A DataLoader with workers pulls
    indices ahead of training, so pass what training actually used, per replica, in this
    epoch: ``state_dict(consumed=batches_done * batch_size)`` (the same as setting
    ``state["consumed"]``; counts past the end of the epoch are clamped, so a short last batch
    is fine), or ``resize(..., consumed=...)``.

    Defaults: ``num_replicas``/``rank`` via :func:`streamshard.topology.resolve_rank_world`;
    ``num_nodes`` is ``num_replicas // LOCAL_WORLD_SIZE`` when torchrun's ``LOCAL_WORLD_SIZE``
    is set, else 1; ``node_rank`` is ``rank // (num_replicas // num_nodes)`` (torchrun numbers
    the ranks of a node contiguously). Bad arguments raise ValueError naming the argument.
    """

    def __init__(
        self,
        dataset_len: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        num_nodes: int | None = None,
        node_rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        self._n = _check_int(dataset_len, "dataset_len", 0, MAX_N)
        self._shuffle = _check_bool(shuffle, "shuffle")
        self._drop_last = _check_bool(drop_last, "drop_last")
        self._seed = _check_int(seed, "seed", 0, _MAX_SEED)
        if num_replicas is not None:
            _check_int(num_replicas, "num_replicas", 1, None)
        if rank is not None:
            _check_int(rank, "rank", 0, None)
        rank, num_replicas = resolve_rank_world(rank, num_replicas)
        if num_nodes is None:
            num_nodes = _nodes_from_env(num_replicas)
        self._set_topology(num_replicas, rank, num_nodes, node_rank)
        self._epoch = 0
        self._generation = 0  # bumped by every new pass or resize; older iterators stop counting
        self._start_epoch()
        self._resume_pending = False

    # -- public API ---------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def num_replicas(self) -> int:
        return self._replicas

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def num_nodes(self) -> int:
        return self._nodes

    @property
    def node_rank(self) -> int:
        return self._rank // self._local

    @property
    def local_rank(self) -> int:
        return self._rank % self._local

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to iterate. A new epoch starts from its beginning on the current
        topology; the current epoch is left as it is (so a pending resume survives)."""
        epoch = _check_int(epoch, "epoch", 0, _MAX_SEED)
        if epoch != self._epoch:
            self._epoch = epoch
            self._start_epoch()
            self._resume_pending = False

    def __len__(self) -> int:
        """Number of indices the next ``__iter__`` yields (the rest of the epoch after a resume)."""
        if self._resume_pending:
            return self._segment().per_replica
        return self._fresh_segment().per_replica

    def __iter__(self) -> Iterator[int]:
        if not self._resume_pending:
            self._start_epoch()
        self._resume_pending = False
        self._generation += 1
        segment, layouts = self._segment(), list(self._layouts)
        steps = segment.per_replica
        node, local_rank = self.node_rank, self.local_rank
        # Taken now: a pass keeps the order it started with, whatever set_epoch does meanwhile.
        n, seed, epoch, shuffle = self._n, self._seed, self._epoch, self._shuffle

        def indices(first: int) -> np.ndarray:
            chunk = np.arange(first, min(first + _CHUNK, steps), dtype=np.int64)
            return sample_ids(segment.positions(node, local_rank, chunk), n, layouts, segment.nodes, seed, epoch, shuffle)

        return self._count(self._generation, (indices(first) for first in range(0, steps, _CHUNK)))

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The epoch's progress as a small JSON-serialisable dict (the same on every replica).

        ``consumed``: samples this replica's training actually used in this epoch, when that is
        fewer than what was yielded (DataLoader workers prefetch); stored as ``"consumed"``.
        """
        if consumed is not None:
            consumed = _check_int(consumed, "consumed", 0, None)
        return {
            "version": STATE_VERSION,
            "dataset_len": self._n,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
            "epoch": self._epoch,
            "num_replicas": self._replicas,
            "num_nodes": self._nodes,
            "layouts": [list(layout) for layout in self._layouts],
            "offset": self._offset,
            "segment_start": self._segment_start,
            "yielded": self._yielded,
            "consumed": consumed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the epoch recorded in ``state`` on this sampler's topology.

        The state may come from a different ``num_replicas``/``num_nodes``: the samples left in
        the epoch after ``state["consumed"]`` (else ``state["yielded"]``) per old replica are
        re-dealt to this topology, each exactly once apart from padding. The seed is taken
        from the state; dataset_len, shuffle and drop_last must match.
        """
        parsed = _parse_state(state, self._n, self._shuffle, self._drop_last)
        self._seed = parsed["seed"]
        self._epoch = parsed["epoch"]
        self._layouts = parsed["layouts"]
        self._offset = parsed["offset"]
        self._segment_start = parsed["segment_start"]
        old = self._segment(parsed["num_nodes"], parsed["num_replicas"] // parsed["num_nodes"])
        self._rebase(old, parsed["consumed"])

    def resize(
        self,
        num_replicas: int,
        rank: int,
        num_nodes: int | None = None,
        node_rank: int | None = None,
        *,
        consumed: int | None = None,
    ) -> None:
        """Move to a new topology mid-epoch; the next ``__iter__`` yields this replica's share of
        the rest of the epoch.

        ``consumed``: samples each old replica consumed in this epoch (default: what this sampler
        yielded). Every replica of the new topology must call this with the same ``consumed``
        (new replicas can ``load_state_dict`` a state of an old one instead). ``num_nodes``
        defaults to the current node count.
        """
        consumed = self._yielded if consumed is None else _check_int(consumed, "consumed", 0, None)
        _check_not_before(consumed, self._segment_start, "consumed")
        old_nodes, old = self._nodes, self._segment()
        self._set_topology(num_replicas, rank, old_nodes if num_nodes is None else num_nodes, node_rank)
        self._rebase(old, consumed)

    def __repr__(self) -> str:
        return (f"ElasticSampler(dataset_len={self._n}, num_replicas={self._replicas}, "
                f"rank={self._rank}, num_nodes={self._nodes}, shuffle={self._shuffle}, "
                f"seed={self._seed}, drop_last={self._drop_last}, epoch={self._epoch})")

    # -- internals ----------------------------------------------------------------------------

    def _set_topology(self, num_replicas: int, rank: int, num_nodes: int, node_rank: int | None) -> None:
        replicas = _check_int(num_replicas, "num_replicas", 1, None)
        rank = _check_int(rank, "rank", 0, replicas - 1)
        nodes = _check_int(num_nodes, "num_nodes", 1, replicas)
        if replicas % nodes:
            raise ValueError(f"num_replicas={replicas} must be a multiple of num_nodes={nodes}")
        local = replicas // nodes
        if node_rank is not None and _check_int(node_rank, "node_rank", 0, nodes - 1) != rank // local:
            raise ValueError(f"node_rank={node_rank} disagrees with rank={rank}: with {local} ranks "
                             f"per node (numbered contiguously) rank {rank} is on node {rank // local}")
        self._replicas, self._rank, self._nodes, self._local = replicas, rank, nodes, local

    def _start_epoch(self) -> None:
        """Progress back to the beginning of the current epoch on the current topology."""
        self._layouts: list[tuple[int, int]] = []
        self._offset = 0
        self._segment_start = 0
        self._yielded = 0
        self._generation += 1

    def _segment(self, nodes: int | None = None, local: int | None = None) -> Segment:
        """The current segment; ``nodes``/``local`` override the topology it is dealt to."""
        return Segment(pool_size(self._n, self._layouts), self._nodes if nodes is None else nodes,
                       self._local if local is None else local, self._offset, self._drop_last)

    def _fresh_segment(self) -> Segment:
        return Segment(self._n, self._nodes, self._local, 0, self._drop_last)

    def _rebase(self, old: Segment, consumed: int) -> None:
        """Start a segment on the current topology after ``consumed`` samples per old replica."""
        consumed = min(consumed, self._segment_start + old.per_replica)
        offset = old.offset_after(consumed - self._segment_start)
        if consumed == 0:
            self._layouts, self._offset = [], 0
        elif old.nodes != self._nodes:
            self._layouts = [*self._layouts, (old.nodes, offset)]
            self._offset = 0
        else:
            self._offset = offset
        self._segment_start = self._yielded = consumed
        self._generation += 1
        self._resume_pending = True

    def _count(self, generation: int, chunks: Iterator[np.ndarray]) -> Iterator[int]:
        """Yield the indices, counting them unless a newer iteration or a resize took over."""
        for chunk in chunks:
            for index in chunk.tolist():
                if generation == self._generation:
                    self._yielded += 1
                yield index


# -- validation ------------------------------------------------------------------------------------


def _check_int(value: Any, name: str, low: int, high: int | None) -> int:
    """``value`` as an int in ``[low, high]``, else ValueError naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def _nodes_from_env(num_replicas: int) -> int:
    """Node count from torchrun's ``LOCAL_WORLD_SIZE`` (ranks per node), else 1."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    if value == "":
        return 1
    try:
        per_node = int(value)
    except ValueError:
        raise ValueError(f"environment variable LOCAL_WORLD_SIZE={value!r} is not an integer") from None
    if per_node < 1 or num_replicas % per_node:
        raise ValueError(f"num_replicas={num_replicas} is not a multiple of LOCAL_WORLD_SIZE={per_node}; "
                         "pass num_nodes explicitly")
    return num_replicas // per_node


def _parse_state(state: Any, n: int, shuffle: bool, drop_last: bool) -> dict[str, Any]:
    """Validate a state dict; return its fields with ``consumed`` resolved (ValueError on bad input)."""
    if not isinstance(state, dict):
        raise ValueError(f"state must be a dict, got {type(state).__name__}")
    missing = [key for key in _STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"state is missing {missing}")
    if state["version"] != STATE_VERSION:
        raise ValueError(f"state['version'] must be {STATE_VERSION}, got {state['version']!r}")
    for key, expected in (("dataset_len", n), ("shuffle", shuffle), ("drop_last", drop_last)):
        if state[key] != expected:
            raise ValueError(f"state['{key}']={state[key]!r} does not match this sampler's "
                             f"{key}={expected!r}")
    out = {key: _check_int(state[key], f"state['{key}']", 0, None)
           for key in ("seed", "epoch", "num_replicas", "num_nodes", "offset", "segment_start", "yielded")}
    _check_int(out["seed"], "state['seed']", 0, _MAX_SEED)
    replicas, nodes = out["num_replicas"], out["num_nodes"]
    if nodes < 1 or replicas < 1 or replicas % nodes:
        raise ValueError(f"state['num_replicas']={replicas} must be a positive multiple of "
                         f"state['num_nodes']={nodes}")
    out["layouts"] = _parse_layouts(state["layouts"], n)
    size = pool_size(n, out["layouts"])
    if out["offset"] > max_offset(size, nodes):
        raise ValueError(f"state['offset']={out['offset']} is past the end of the epoch")
    segment = Segment(size, nodes, replicas // nodes, out["offset"], drop_last)
    total = out["segment_start"] + segment.per_replica
    if not out["segment_start"] <= out["yielded"] <= total:
        raise ValueError(f"state['yielded']={out['yielded']} must be in "
                         f"[state['segment_start'], {total}]")
    consumed = state["consumed"]
    out["consumed"] = (out["yielded"] if consumed is None
                       else _check_int(consumed, "state['consumed']", 0, None))
    _check_not_before(out["consumed"], out["segment_start"], "state['consumed']")
    return out


def _check_not_before(consumed: int, segment_start: int, name: str) -> None:
    if consumed < segment_start:
        raise ValueError(f"{name}={consumed} is before the epoch's last topology change (at "
                         f"{segment_start} samples per replica), which cannot be undone")


def _parse_layouts(layouts: Any, n: int) -> list[tuple[int, int]]:
    if not isinstance(layouts, (list, tuple)):
        raise ValueError(f"state['layouts'] must be a list of [num_nodes, offset] pairs, got {layouts!r}")
    parsed, size = [], n
    for i, pair in enumerate(layouts):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"state['layouts'][{i}] must be a [num_nodes, offset] pair, got {pair!r}")
        nodes = _check_int(pair[0], f"state['layouts'][{i}][0]", 1, None)
        offset = _check_int(pair[1], f"state['layouts'][{i}][1]", 0, max_offset(size, nodes))
        parsed.append((nodes, offset))
        size = remaining(size, nodes, offset)
    return parsed
