"""A few int64 slots in shared memory: how ``set_epoch`` reaches persistent DataLoader workers."""

from __future__ import annotations

import torch


class EpochCell:
    """The epoch an object iterates, and how many DataLoader workers last iterated it.

    Shared memory survives the fork or pickling into DataLoader workers, so the main process and
    its workers read the same values. ``workers`` is -1 until a first pass starts.
    """

    def __init__(self) -> None:
        self._slots = torch.tensor([0, -1, -1], dtype=torch.int64).share_memory_()
        self._values = self._slots.numpy()  # read per batch: numpy indexing never drops the GIL, torch's does

    def __getstate__(self) -> dict[str, torch.Tensor]:
        return {"_slots": self._slots}  # the tensor travels as shared memory; the view is made again

    def __setstate__(self, state: dict[str, torch.Tensor]) -> None:
        self._slots = state["_slots"]
        self._values = self._slots.numpy()

    @property
    def epoch(self) -> int:
        return int(self._values[0])

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._values[0] = int(value)

    @property
    def workers(self) -> int:
        return int(self._values[1])

    @workers.setter
    def workers(self, value: int) -> None:
        self._values[1] = int(value)

    @property
    def last_pass(self) -> int:
        """The epoch the last pass started from its beginning (-1: none yet)."""
        return int(self._values[2])

    @last_pass.setter
    def last_pass(self, epoch: int) -> None:
        self._values[2] = int(epoch)
