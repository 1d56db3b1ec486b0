"""``StreamLoader``: iterate a stream and keep its checkpoint, so no count comes from the user.

It iterates like ``DataLoader(dataset, batch_size=None, ...)`` (and uses one for its worker
processes) and counts the batches it hands to the training loop. That count, with the worker
count and the dataset's own fingerprint, is the whole checkpoint: ``state_dict()`` is the
dataset's rank state after those batches, and it resumes on any world size and worker count.

Batches arrive in round-robin order (batch ``j`` of a rank from worker ``j % num_workers``):
that is what lets one number per rank say how far every worker got.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Protocol

import torch
from torch.utils.data import DataLoader

from .errors import StateError
from .validate import check_int


class StreamSource(Protocol):
    """What ``StreamLoader`` needs from a dataset (``ParquetStream``, ``BlendedStream``, ...)."""

    @property
    def epoch(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    def steps_per_epoch(self, num_workers: int = 0) -> int: ...

    def loader_state(self, consumed_batches: int, num_workers: int) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class StreamLoader:
    """Iterate ``dataset`` with ``num_workers`` worker processes and keep the data checkpoint.

    * ``for batch in loader`` yields the rest of the current epoch; when an epoch is exhausted
      the loader moves the dataset to the next epoch itself (``set_epoch`` is still honoured:
      setting another epoch on the loader or the dataset starts that epoch from its beginning).
      Breaking out of the loop and iterating again continues where the loop stopped.
    * ``len(loader)``: the batches this rank yields from its current position to the end of the
      epoch, exact before and after a resume.
    * ``state_dict()``: a small JSON dict, the same on every rank of a synchronous job;
      ``load_state_dict(state)`` on any world size and worker count delivers the rest of the
      epoch exactly once, with equal steps on every rank.

    Args:
        dataset: a ``ParquetStream`` or ``BlendedStream``.
        num_workers, pin_memory, prefetch_factor, persistent_workers, multiprocessing_context,
            timeout, worker_init_fn: as for ``torch.utils.data.DataLoader``; ``pin_memory=None``
            pins when a CUDA device is available.
    """

    def __init__(
        self,
        dataset: StreamSource,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        multiprocessing_context: Any = None,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
    ) -> None:
        for name in ("loader_state", "load_state_dict", "steps_per_epoch", "set_epoch"):
            if not callable(getattr(dataset, name, None)):
                raise ValueError(f"StreamLoader needs a streamshard stream (ParquetStream, BlendedStream), "
                                 f"got {type(dataset).__name__} without {name}()")
        self.dataset = dataset
        self.num_workers = check_int(num_workers, "num_workers", 0, 1024)
        if persistent_workers and not self.num_workers:
            raise ValueError("persistent_workers=True needs num_workers > 0")
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._loader_args = dict(prefetch_factor=prefetch_factor, persistent_workers=bool(persistent_workers),
                                 multiprocessing_context=multiprocessing_context, timeout=timeout,
                                 worker_init_fn=worker_init_fn)
        self._epoch = dataset.epoch
        self._consumed = 0  # batches handed out since the dataset's position (the start of this pass)
        self._resumed = False  # the dataset holds a loaded position for self._epoch
        self._loader: DataLoader | None = None
        self._loader_resume_epoch: int | None = None  # the epoch whose position its workers were started with

    # -- epoch and length -----------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning on the next iteration (a pending resume of it is kept)."""
        epoch = check_int(epoch, "epoch", 0)
        if epoch != self._epoch:
            self._consumed, self._resumed = 0, False
        self._epoch = epoch
        self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        self._follow_dataset_epoch()
        return self.dataset.steps_per_epoch(self.num_workers) - self._consumed

    # -- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the dataset's state after the batches this loader handed out."""
        self._follow_dataset_epoch()
        return self.dataset.loader_state(self._consumed, self.num_workers)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (saved by any ``StreamLoader`` of the same data and settings)."""
        if isinstance(state, Mapping) and state.get("kind") == "worker":
            raise StateError("this is a per-worker state from torchdata's StatefulDataLoader; StreamLoader loads "
                             "the rank states it saves itself")
        self.dataset.load_state_dict(state)
        self._epoch, self._consumed, self._resumed = self.dataset.epoch, 0, True
        self._loader = None  # workers must start from the new position

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        self._follow_dataset_epoch()
        if self._consumed or self._resumed:
            if self.dataset.steps_per_epoch(self.num_workers) - self._consumed <= 0:
                self.set_epoch(self._epoch + 1)  # the epoch was delivered in full: on to the next
        if self._consumed:  # a pass that stopped early: continue where it stopped
            self.dataset.load_state_dict(self.dataset.loader_state(self._consumed, self.num_workers))
            self._consumed, self._resumed = 0, True
        self.dataset.set_epoch(self._epoch)  # the catalog is read here once; workers inherit it
        loader = self._data_loader()
        return self._count(loader)

    def _count(self, loader: DataLoader) -> Iterator[Any]:
        for batch in loader:
            self._consumed += 1
            yield batch
        # The epoch is exhausted: the next pass starts the next one.
        self._consumed, self._resumed = 0, False
        self._epoch += 1
        self.dataset.set_epoch(self._epoch)

    def _data_loader(self) -> DataLoader:
        resume_epoch = self._epoch if self._resumed else None
        reusable = (self._loader is not None and self._loader_args["persistent_workers"] and resume_epoch is None
                    and self._loader_resume_epoch != self._epoch)
        if not reusable:
            self._loader = DataLoader(self.dataset, batch_size=None, num_workers=self.num_workers,  # type: ignore[arg-type]
                                      pin_memory=self.pin_memory, **self._loader_args)
            self._loader_resume_epoch = resume_epoch
        assert self._loader is not None
        return self._loader

    def _follow_dataset_epoch(self) -> None:
        """A ``set_epoch`` called on the dataset directly moves the loader to that epoch."""
        if self.dataset.epoch != self._epoch:
            self._epoch, self._consumed, self._resumed = self.dataset.epoch, 0, False

    def __repr__(self) -> str:
        return (f"StreamLoader({type(self.dataset).__name__}, num_workers={self.num_workers}, epoch={self._epoch}, "
                f"consumed={self._consumed})")
