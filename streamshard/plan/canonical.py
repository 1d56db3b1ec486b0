"""Topology-independent order: which rows make up each global step, whatever the world size.

The epoch's stream (``plan/epoch_plan.py``) is cut into ``C`` canonical partitions, contiguous and balanced
by rows, and each partition is consumed in micro-batches of ``micro`` rows, in order. A rank's
DataLoader hands out batch ``j`` from worker ``j % N``, so worker ``w`` of every rank owns the
partitions of phase ``w`` (``p % N == w``), split contiguously among the ranks, and its batch
``i`` is micro-batch ``i`` of each partition it owns. Global step ``j`` (batch ``j`` of every
rank) is then micro-batch ``j // N`` of every phase-``(j % N)`` partition: the same rows for every
world size ``W`` with ``W * N`` dividing ``C``, as long as ``N`` and ``micro`` stay the same (the
per-rank ``batch_size`` is ``micro * C / (W * N)``, i.e. the global batch is fixed). Resuming on
another such world size continues at global step ``k`` with nothing to repartition.

Pure: no I/O, no torch.
"""

from __future__ import annotations

import numpy as np

from .batch_plan import PieceBatches
from .epoch_plan import EpochPlan, Layout, PlanConfig


class CanonicalPlan:
    """One epoch in canonical order for ``world_size`` ranks x ``num_workers`` DataLoader workers."""

    def __init__(
        self, layout: Layout, config: PlanConfig, epoch: int, partitions: int, world_size: int, num_workers: int
    ) -> None:
        if config.batch_size is None:
            raise ValueError("partitions= needs an int batch_size (the per-rank batch of a global step)")
        if config.shuffle_window != 1:
            raise ValueError("partitions= and shuffle_window > 1 cannot be combined")
        self.n = max(num_workers, 1)
        global_workers = world_size * self.n
        if partitions < 1 or partitions % global_workers:
            raise ValueError(
                f"partitions={partitions} must be a multiple of world_size x workers = "
                f"{world_size} x {self.n} = {global_workers}"
            )
        self.per_worker = partitions // global_workers
        if config.batch_size % self.per_worker:
            raise ValueError(
                f"batch_size={config.batch_size} must be a multiple of the {self.per_worker} partitions each "
                f"worker owns (partitions / (world_size x workers))"
            )
        self.config, self.partitions, self.world_size = config, partitions, world_size
        self.micro = config.batch_size // self.per_worker
        self.stream = EpochPlan(layout, config, epoch, partitions)  # partition p is block p of the stream
        begin, end = self.stream.block_bounds(np.arange(partitions))
        self.begin, self.rows = begin, end - begin
        per_partition = -(-self.rows // self.micro) if config.uneven == "pad" else self.rows // self.micro
        self.steps = int(per_partition.max() if config.uneven == "pad" else per_partition.min())

    def owned(self, rank: int, phase: int) -> np.ndarray:
        """The partitions worker ``phase`` of rank ``rank`` consumes."""
        of_phase = np.arange(phase, self.partitions, self.n)
        return of_phase[rank * self.per_worker : (rank + 1) * self.per_worker]

    def schedule(self, partitions: np.ndarray) -> PieceBatches:
        """The batches of a worker owning ``partitions``: batch ``i`` is micro-batch ``i`` of each."""
        ranges = [(int(self.begin[p]), int(self.rows[p])) for p in partitions.tolist()]
        return PieceBatches(self.stream, ranges, self.micro, self.micro * len(ranges), self.steps)

    def global_step_ids(self, j: int) -> np.ndarray:
        """Sample ids of global step ``j`` (all ranks' batch ``j``): the invariant this plan keeps."""
        every_rank = np.arange(j % self.n, self.partitions, self.n)
        return self.schedule(every_rank).batch(j // self.n).sample_id
