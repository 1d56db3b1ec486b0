"""Run a dataset the way training does and check the invariants on what came out."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem
from torch.utils.data import DataLoader

import streamshard as ss


def run_epoch(make: Callable[[int, int], ss.ParquetStream], world_size: int, num_workers: int, epoch: int = 0):
    """Every simulated rank's batches of one epoch through a real DataLoader."""
    per_rank = []
    for rank in range(world_size):
        ds = make(rank, world_size)
        ds.set_epoch(epoch)
        loader = DataLoader(ds, batch_size=None, num_workers=num_workers)
        per_rank.append(list(loader))
    return per_rank


def ids_of(batches) -> np.ndarray:
    return np.concatenate([b["sample_id"].numpy() for b in batches]) if batches else np.zeros(0, np.int64)


def assert_exactly_once(per_rank, num_rows: int) -> None:
    ids = np.concatenate([ids_of(batches) for batches in per_rank])
    real = np.sort(ids[ids >= 0])
    assert len(real) == num_rows, f"{num_rows - len(real)} rows missing or {len(real) - num_rows} extra"
    np.testing.assert_array_equal(real, np.arange(num_rows))


def assert_rows_match_ids(per_rank) -> None:
    """The synthetic corpus stores each row's global index in `id`: data and sample_id must agree."""
    for batches in per_rank:
        for b in batches:
            real = b["sample_id"] >= 0
            assert torch.equal(b["id"][real], b["sample_id"][real])
            assert torch.all(b["sample_id"][~real] == -1)
            lengths = b["input_ids_lengths"][real]
            tokens = b["input_ids"][real]
            for row in range(0, len(tokens), max(1, len(tokens) // 5)):
                expected = int(b["sample_id"][real][row]) % 50_000
                assert torch.all(tokens[row, : lengths[row]] == expected)


def assert_equal_steps(per_rank) -> None:
    counts = [len(batches) for batches in per_rank]
    assert len(set(counts)) == 1, f"ranks yield different step counts: {counts}"


def rows_of(batch: dict[str, Any], columns: list[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(sample_id, row)`` for each real row of a delivered batch: each column's value as Python data, a
    list column cut to its length, None where its mask says null."""
    for j, sid in enumerate(batch["sample_id"].tolist()):
        if sid < 0:
            continue
        row: dict[str, Any] = {}
        for c in columns:
            mask = batch.get(f"{c}_mask")
            if mask is not None and not bool(mask[j]):
                row[c] = None
            elif f"{c}_lengths" in batch:
                row[c] = batch[c][j][: int(batch[f"{c}_lengths"][j])].tolist()
            else:
                value = batch[c][j]
                row[c] = value.item() if hasattr(value, "item") else value
        yield sid, row


class LocalUnderProtocol(LocalFileSystem):
    """The local filesystem under its own URL scheme (``protocol``), for tests that watch or disturb
    what the package asks of a store: a subclass sets ``protocol`` and overrides the calls it watches,
    then registers itself with ``fsspec.register_implementation(protocol, cls, clobber=True)``."""

    protocol = "localunder"

    @classmethod
    def _strip_protocol(cls, path):
        path, scheme = str(path), f"{cls.protocol}://"
        return super()._strip_protocol(path[len(scheme):] if path.startswith(scheme) else path)

    def unstrip_protocol(self, name):
        return f"{self.protocol}://{self._strip_protocol(name)}"
