"""``ElasticSampler``: a map-style sampler with node-local shuffling and mid-epoch resizing.

The torch-facing edge: argument and state validation, the epoch/resume/resize state machine and
iteration. Which sample each replica gets is pure arithmetic in :mod:`streamshard.plan.sampler_plan`
(node subsets, per-epoch order, dealing, and the fold of earlier node layouts after a resize).
Its checkpoint follows the contract of :mod:`streamshard.plan.state` (``kind: "sampler"``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from ..errors import StateError
from ..plan.permutation import MAX_N
from ..plan.sampler_plan import Segment, max_offset, pool_size, remaining, sample_ids
from ..plan.state import MAX_SEGMENTS, MAX_WORLD_SIZE, STATE_VERSION, check_fingerprint, int_field, require
from ..plan.topology import resolve_rank_world
from ..plan.validate import check_bool, check_int

__all__ = ["ElasticSampler"]

_MAX_SEED = 2**64 - 1
# Indices computed per numpy call while iterating: enough to amortise numpy, small in memory.
_CHUNK = 1 << 14
_STATE_KEYS = ("version", "kind", "epoch", "fingerprint", "num_replicas", "num_nodes", "layouts", "offset",
               "segment_start", "yielded", "consumed")


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
    a synchronous job; by default it counts the indices this sampler has *yielded* in the epoch,
    which is exact wherever the sampler is asked when its indices are handed out (torchdata's
    ``StatefulDataLoader`` does that; ``ss.StreamLoader(dataset, sampler=...)`` keeps the count
    itself). :meth:`load_state_dict` (or :meth:`resize`) makes the *next* ``__iter__`` continue
    the epoch; any other ``__iter__`` starts the current epoch from its beginning, like
    ``DistributedSampler``. ``set_epoch`` with a new epoch starts that epoch; with the current
    epoch it keeps a pending resume, so ``for e in range(start, E): set_epoch(e)`` resumes.

    With a plain ``DataLoader`` whose workers pull indices ahead of training, pass what training
    actually used, per replica, in this epoch: ``state_dict(consumed=batches_done * batch_size)``
    (counts past the end of the epoch are clamped, so a short last batch is fine), or
    ``resize(..., consumed=...)``.

    Defaults: ``num_replicas``/``rank`` via :func:`streamshard.plan.topology.resolve_rank_world`;
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
        self._n = check_int(dataset_len, "dataset_len", 0, MAX_N)
        self._shuffle = check_bool(shuffle, "shuffle")
        self._drop_last = check_bool(drop_last, "drop_last")
        self._seed = check_int(seed, "seed", 0, _MAX_SEED)
        check_int(num_replicas, "num_replicas", 1, MAX_WORLD_SIZE, none_ok=True)
        check_int(rank, "rank", 0, none_ok=True)
        rank, num_replicas = resolve_rank_world(rank, num_replicas)
        if num_nodes is None:
            num_nodes = _nodes_from_env(num_replicas)
        self._set_topology(num_replicas, rank, num_nodes, node_rank)
        self._epoch = 0
        self._start_epoch()
        self._resume_pending = False

    # -- public API ---------------------------------------------------------------------------

    @property
    def dataset_len(self) -> int:
        return self._n

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

    @property
    def resume_point(self) -> int:
        """Indices of this replica's epoch that the next ``__iter__`` skips: where a pending
        ``load_state_dict``/``resize`` continues, else 0. The next pass covers
        ``resume_point .. resume_point + len(self)``."""
        return self._segment_start if self._resume_pending else 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to iterate. A new epoch starts from its beginning on the current
        topology; the current epoch is left as it is (so a pending resume survives)."""
        epoch = check_int(epoch, "epoch", 0, _MAX_SEED)
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
        segment, layouts = self._segment(), list(self._layouts)
        node, local_rank = self.node_rank, self.local_rank
        # Taken now: a pass keeps the order it started with, whatever set_epoch does meanwhile.
        n, seed, epoch, shuffle = self._n, self._seed, self._epoch, self._shuffle

        def indices(first: int) -> np.ndarray:
            chunk = np.arange(first, min(first + _CHUNK, segment.per_replica), dtype=np.int64)
            return sample_ids(segment.positions(node, local_rank, chunk), n, layouts, segment.nodes, seed, epoch, shuffle)

        self._pass = _Pass(indices, segment.per_replica)
        return self._pass

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The epoch's progress as a small JSON-serialisable dict (the same on every replica).

        Without ``consumed`` the progress is what this sampler has yielded in the epoch.
        ``consumed`` overrides it (for a plain ``DataLoader`` whose workers prefetch): the
        samples this replica's training used in this epoch, clamped to the epoch's end; the
        state is then that of a sampler stopped there, on every replica alike. A state of the whole
        epoch is the next epoch's beginning (loading it never delivers this epoch again).
        """
        yielded, override = self._yielded(), None
        end = self._segment_start + self._segment().per_replica
        if consumed is not None:
            consumed = check_int(consumed, "consumed", 0)
            _check_not_before(consumed, self._segment_start, "consumed", ValueError)
            yielded = override = min(consumed, end)
        if yielded >= end > self._segment_start:  # the epoch's last sample: the state is the next epoch's beginning
            return {**self._state(self._epoch + 1, [], 0, 0, 0), "consumed": None if override is None else 0}
        return {**self._state(self._epoch, self._layouts, self._offset, self._segment_start, yielded),
                "consumed": override}

    def _state(self, epoch: int, layouts: list[tuple[int, int]], offset: int, segment_start: int,
               yielded: int) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "kind": "sampler",
            "epoch": epoch,
            "fingerprint": self._fingerprint(),
            "num_replicas": self._replicas,
            "num_nodes": self._nodes,
            "layouts": [list(layout) for layout in layouts],
            "offset": offset,
            "segment_start": segment_start,
            "yielded": yielded,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the epoch recorded in ``state`` on this sampler's topology.

        The state may come from a different ``num_replicas``/``num_nodes``: the samples left in
        the epoch after ``state["consumed"]`` (else ``state["yielded"]``) per old replica are
        re-dealt to this topology, each exactly once apart from padding. A state whose
        ``fingerprint`` (dataset_len, seed, shuffle, drop_last) differs from this sampler's, or
        that is malformed, raises ``StateError`` naming the field, and leaves the sampler as it was.
        """
        parsed = _parse_state(state, self._fingerprint(), self._drop_last)
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
        consumed = self._yielded() if consumed is None else check_int(consumed, "consumed", 0)
        _check_not_before(consumed, self._segment_start, "consumed", ValueError)
        old_nodes, old = self._nodes, self._segment()
        self._set_topology(num_replicas, rank, old_nodes if num_nodes is None else num_nodes, node_rank)
        self._rebase(old, consumed)

    def __repr__(self) -> str:
        return (f"ElasticSampler(dataset_len={self._n}, num_replicas={self._replicas}, "
                f"rank={self._rank}, num_nodes={self._nodes}, shuffle={self._shuffle}, "
                f"seed={self._seed}, drop_last={self._drop_last}, epoch={self._epoch})")

    # -- internals ----------------------------------------------------------------------------

    def _fingerprint(self) -> dict[str, Any]:
        """Everything that decides the order and cannot change on resume."""
        return {"dataset_len": self._n, "seed": self._seed, "shuffle": self._shuffle, "drop_last": self._drop_last}

    def _set_topology(self, num_replicas: int, rank: int, num_nodes: int, node_rank: int | None) -> None:
        replicas = check_int(num_replicas, "num_replicas", 1, MAX_WORLD_SIZE)
        rank = check_int(rank, "rank", 0, replicas - 1)
        nodes = check_int(num_nodes, "num_nodes", 1, replicas)
        if replicas % nodes:
            raise ValueError(f"num_replicas={replicas} must be a multiple of num_nodes={nodes}")
        local = replicas // nodes
        if node_rank is not None and check_int(node_rank, "node_rank", 0, nodes - 1) != rank // local:
            raise ValueError(f"node_rank={node_rank} disagrees with rank={rank}: with {local} ranks "
                             f"per node (numbered contiguously) rank {rank} is on node {rank // local}")
        self._replicas, self._rank, self._nodes, self._local = replicas, rank, nodes, local

    def _start_epoch(self) -> None:
        """Progress back to the beginning of the current epoch on the current topology."""
        self._layouts: list[tuple[int, int]] = []
        self._offset = 0
        self._segment_start = 0
        self._pass: _Pass | None = None

    def _yielded(self) -> int:
        """Samples per replica this epoch: those before the current segment, plus its pass's."""
        return self._segment_start + (self._pass.count if self._pass is not None else 0)

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
        self._segment_start = consumed
        self._pass = None  # an older iterator keeps its order but no longer counts
        self._resume_pending = True


class _Pass(Iterator[int]):
    """One pass over a replica's share of a segment: a fixed order and its own count."""

    def __init__(self, chunk: Callable[[int], np.ndarray], steps: int) -> None:
        self._chunk, self._steps = chunk, steps
        self._buffer: list[int] = []
        self._next = 0
        self.count = 0  # indices handed out so far

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> int:
        if self._next == len(self._buffer):
            if self.count >= self._steps:
                raise StopIteration
            self._buffer, self._next = self._chunk(self.count).tolist(), 0
        index = self._buffer[self._next]
        self._next += 1
        self.count += 1
        return index


# -- validation ------------------------------------------------------------------------------------


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


def _parse_state(state: Any, fingerprint: Mapping[str, Any], drop_last: bool) -> dict[str, Any]:
    """Validate a sampler state against this sampler; its progress fields, ``consumed`` resolved.

    Every check is arithmetic on a few numbers (at most ``MAX_SEGMENTS`` layouts), so even an
    absurd state is refused at once.
    """
    require(state, ("sampler",), _STATE_KEYS, "ElasticSampler")
    check_fingerprint(state["fingerprint"], fingerprint, "ElasticSampler")
    n = fingerprint["dataset_len"]
    out = {"epoch": int_field(state, "epoch", 0, _MAX_SEED),
           "num_replicas": int_field(state, "num_replicas", 1, MAX_WORLD_SIZE)}
    replicas = out["num_replicas"]
    nodes = out["num_nodes"] = int_field(state, "num_nodes", 1, replicas)
    if replicas % nodes:
        raise StateError(f"state['num_replicas'] = {replicas} must be a multiple of state['num_nodes'] = {nodes}")
    out["layouts"] = _parse_layouts(state["layouts"], n)
    size = pool_size(n, out["layouts"])
    out["offset"] = int_field(state, "offset", 0, max_offset(size, nodes))
    segment = Segment(size, nodes, replicas // nodes, out["offset"], drop_last)
    start = out["segment_start"] = int_field(state, "segment_start", 0, n)
    total = start + segment.per_replica
    out["yielded"] = int_field(state, "yielded", start, total)
    out["consumed"] = out["yielded"] if state["consumed"] is None else int_field(state, "consumed", start, total)
    return out


def _check_not_before(consumed: int, segment_start: int, name: str, error: type[ValueError]) -> None:
    if consumed < segment_start:
        raise error(f"{name}={consumed} is before the epoch's last topology change (at "
                    f"{segment_start} samples per replica), which cannot be undone")


def _parse_layouts(layouts: Any, n: int) -> list[tuple[int, int]]:
    """``state['layouts']``: at most ``MAX_SEGMENTS`` ``[num_nodes, offset]`` pairs, each in range."""
    if not isinstance(layouts, (list, tuple)) or len(layouts) > MAX_SEGMENTS:
        raise StateError(f"state['layouts'] must be a list of at most {MAX_SEGMENTS} [num_nodes, offset] pairs, "
                         f"got {layouts!r:.80}")
    parsed, size = [], n
    for i, pair in enumerate(layouts):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise StateError(f"state['layouts'][{i}] must be a [num_nodes, offset] pair, got {pair!r:.80}")
        try:
            fields = {"num_nodes": pair[0], "offset": pair[1]}
            nodes = int_field(fields, "num_nodes", 1, MAX_WORLD_SIZE)
            offset = int_field(fields, "offset", 0, max_offset(size, nodes))
        except StateError as error:
            raise StateError(f"state['layouts'][{i}]: {error}") from None
        parsed.append((nodes, offset))
        size = remaining(size, nodes, offset)
    return parsed
