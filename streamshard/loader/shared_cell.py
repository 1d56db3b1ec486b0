"""A few int64 slots in shared memory: how the main process reaches its DataLoader workers.

``set_epoch`` must reach persistent workers, and a state loaded in the main process must be used by
the first pass after the load and by no later one, although a plain ``DataLoader`` starts every
non-persistent pass from a fresh copy of the dataset that still carries it.
"""

from __future__ import annotations

import torch

MAX_CLAIMS = 128  # DataLoader workers per rank whose use of a loaded state is recorded (1 KiB pickled)
_EPOCH, _WORKERS, _LAST_PASS, _LOAD = range(4)


class EpochCell:
    """The epoch an object iterates, how many DataLoader workers last iterated it, and which pass
    used the last loaded state.

    Shared memory survives the fork or pickling into DataLoader workers, so the main process and
    its workers read the same values. ``workers`` is -1 until a first pass starts.
    """

    def __init__(self) -> None:
        slots = torch.zeros(4 + MAX_CLAIMS, dtype=torch.int64)
        slots[_WORKERS] = slots[_LAST_PASS] = -1
        self._slots = slots.share_memory_()
        self._values = self._slots.numpy()  # read per batch: numpy indexing never drops the GIL, torch's does

    def __getstate__(self) -> dict[str, torch.Tensor]:
        return {"_slots": self._slots}  # the tensor travels as shared memory; the view is made again

    def __setstate__(self, state: dict[str, torch.Tensor]) -> None:
        self._slots = state["_slots"]
        self._values = self._slots.numpy()

    @property
    def epoch(self) -> int:
        return int(self._values[_EPOCH])

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._values[_EPOCH] = int(value)

    @property
    def workers(self) -> int:
        return int(self._values[_WORKERS])

    @workers.setter
    def workers(self, value: int) -> None:
        self._values[_WORKERS] = int(value)

    @property
    def last_pass(self) -> int:
        """The epoch the last pass started from its beginning (-1: none yet, or set_epoch since)."""
        return int(self._values[_LAST_PASS])

    @last_pass.setter
    def last_pass(self, epoch: int) -> None:
        self._values[_LAST_PASS] = int(epoch)

    # -- the last loaded state and the pass that used it ------------------------------------------
    @property
    def loads(self) -> int:
        """How many states were loaded in the main process (a copy of the dataset carries the count
        of its time: a different count means a state was loaded after the copy was taken)."""
        return int(self._values[_LOAD])

    def record_load(self) -> int:
        """A state was loaded: no pass has used it yet. Returns the new count."""
        self._values[4:] = 0
        self._values[_LOAD] += 1
        return int(self._values[_LOAD])

    def claim(self, worker_id: int, pass_seed: int) -> bool:
        """Whether DataLoader worker ``worker_id`` of the pass identified by ``pass_seed`` is the one
        to use the loaded state: yes for the workers of the first pass after the load, no for any
        later pass (another seed, or a worker whose claim is already recorded).

        Each worker writes only its own slot, so workers starting together need no lock.
        """
        if not 0 <= worker_id < MAX_CLAIMS:
            raise ValueError(f"a loaded state can be used by at most {MAX_CLAIMS} DataLoader workers per rank, "
                             f"got worker {worker_id}")
        tag = (pass_seed & 0x3FFF_FFFF_FFFF_FFFF) | 1  # never 0: 0 marks an unclaimed slot
        claims = self._values[4:]
        if claims[worker_id] != 0 or any(c not in (0, tag) for c in claims[claims != 0].tolist()):
            return False
        claims[worker_id] = tag
        return True

    @property
    def claimed(self) -> bool:
        """Whether some pass used the last loaded state."""
        return bool((self._values[4:] != 0).any())
