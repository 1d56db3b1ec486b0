"""Who am I: rank and world size of the data-parallel job, DataLoader worker, global worker id.

Resolution order for rank/world size: explicit arguments, then an initialised
``torch.distributed`` process group, then the ``RANK``/``WORLD_SIZE`` environment variables
(as set by ``torchrun``), then a single process; a process that is one of several but does not
know which is not given a rank (``TopologyError``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..errors import TopologyError


@dataclass(frozen=True)
class Topology:
    """One global worker's place among all of them.

    ``num_workers`` is the DataLoader's worker count; 0 means the main process reads, which
    counts as one worker per rank.
    """

    rank: int = 0
    world_size: int = 1
    worker_id: int = 0
    num_workers: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        if not 0 <= self.worker_id < self.workers_per_rank:
            raise ValueError(
                f"worker_id must be in [0, {self.workers_per_rank}), got {self.worker_id}"
            )

    @property
    def workers_per_rank(self) -> int:
        return max(self.num_workers, 1)

    @property
    def num_global_workers(self) -> int:
        return self.world_size * self.workers_per_rank

    @property
    def global_worker_id(self) -> int:
        return self.rank * self.workers_per_rank + self.worker_id


def resolve_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` of the data-parallel job: explicit values win, then an initialised
    torch.distributed process group, then ``RANK``/``WORLD_SIZE`` (as ``torchrun`` sets them), then a
    single process.

    Never a guess: a process that says it is one of several (``WORLD_SIZE`` > 1, or ``LOCAL_RANK``
    > 0) but not which (no ``RANK``; Lightning's DDP processes before ``init_process_group``) has no
    rank yet: ``TopologyError`` names the variables (a stream built that early resolves its rank
    on first use: ``known_rank_world``).
    """
    resolved = known_rank_world(rank, world_size)
    if resolved is None:
        env = _from_environment()
        told = ", ".join(f"{k}={v}" if v is not None else f"no {k}" for k, v in env.items())
        raise TopologyError(
            f"the data-parallel rank is not known yet (environment: {told}; torch.distributed not initialised): a "
            "process launched as one of several (e.g. by Lightning's DDP before init_process_group) must not be "
            "read as rank 0. Use the stream after torch.distributed is initialised (Lightning: it is by "
            "setup()/train_dataloader()), or pass rank= and world_size=")
    return resolved


def known_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int] | None:
    """``resolve_rank_world``'s answer, or None while the rank cannot be known yet."""
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if rank is not None and rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    dist_rank, dist_world = distributed_rank_world()
    env = _from_environment()
    if world_size is None:
        world_size = dist_world if dist_world is not None else env["WORLD_SIZE"]
    if rank is None:
        rank = dist_rank if dist_rank is not None else env["RANK"]
    if rank is None and world_size is None and not env["LOCAL_RANK"]:
        rank, world_size = 0, 1  # nothing says this process is one of several
    elif rank is None and world_size == 1:
        rank = 0
    if rank is None or world_size is None:
        return None
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    return rank, world_size


def mesh_rank_world(mesh: Any, rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """The data-parallel ``(rank, world_size)`` of a 1-D torch ``DeviceMesh`` (e.g. ``mesh["dp"]``):
    under tensor/pipeline/context parallelism, the ranks of one model-parallel group share a
    data-parallel rank, so they get the same batches and only data-parallel ranks split the data."""
    if rank is not None or world_size is not None:
        raise ValueError("pass either mesh= or rank=/world_size=, not both")
    if not callable(getattr(mesh, "get_local_rank", None)) or not callable(getattr(mesh, "size", None)):
        raise ValueError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        names = getattr(mesh, "mesh_dim_names", None)
        raise ValueError(f"mesh must be the 1-D data-parallel mesh, got {mesh.ndim} dimensions {names}: pass "
                         "mesh['dp'] (or the flattened data-parallel dimensions)")
    return int(mesh.get_local_rank()), int(mesh.size())


def current_worker() -> tuple[int, int]:
    """Return ``(worker_id, num_workers)`` of the calling DataLoader worker; ``(0, 0)`` outside one."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is None:
        return 0, 0
    return info.id, info.num_workers


def distributed_rank_world() -> tuple[int | None, int | None]:
    """``(rank, world_size)`` of an initialised torch.distributed process group, else ``(None, None)``."""
    try:
        import torch.distributed as dist
    except ImportError:  # torch built without distributed support
        return None, None
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None, None


def _from_environment() -> dict[str, int | None]:
    def read(name: str) -> int | None:
        value = os.environ.get(name)
        if value is None or value == "":
            return None
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"environment variable {name}={value!r} is not an integer") from None

    return {name: read(name) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
