"""Stop mid-epoch, save a data checkpoint, and resume: on the same topology and on another one.

    python examples/resume.py

Part 1 resumes one rank with 2 DataLoader workers and checks the batches are exactly those the
uninterrupted run would have given. Part 2 stops 4 simulated ranks after 3 steps and finishes the
epoch on 3 ranks, then checks every row was delivered exactly once.
"""

from __future__ import annotations

import json
import tempfile

import numpy as np
import torch
from torch.utils.data import DataLoader

import streamshard as ss
from streamshard.testing import write_corpus


def stream(path: str, rank: int = 0, world_size: int = 1) -> ss.ParquetStream:
    return ss.ParquetStream(path, batch_size=64, shuffle=True, seed=0, rank=rank, world_size=world_size)


def same_topology(path: str) -> None:
    ds = stream(path)
    ds.set_epoch(1)
    full = list(DataLoader(ds, batch_size=None, num_workers=2))
    k = 7
    state = json.loads(json.dumps(ds.state_dict(consumed_batches=k, num_workers=2)))  # as a checkpoint would
    resumed = stream(path)
    resumed.load_state_dict(state)
    rest = list(DataLoader(resumed, batch_size=None, num_workers=2))
    identical = len(rest) == len(full) - k and all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(rest, full[k:]))
    print(f"same topology: stopped after {k} of {len(full)} batches, resumed {len(rest)}; identical: {identical}")
    print(f"  checkpoint: {json.dumps(state)}")
    if not identical:
        raise SystemExit("resume differs")


def elastic(path: str) -> None:
    seen, state = [], None
    for world, stop_after in ((4, 3), (3, None)):
        for rank in range(world):
            ds = stream(path, rank, world)
            if state is not None:
                ds.load_state_dict(state)
            batches = list(DataLoader(ds, batch_size=None, num_workers=1))[:stop_after]
            seen.extend(b["sample_id"][b["sample_id"] >= 0].numpy() for b in batches)
        state = ds.state_dict(consumed_batches=len(batches), num_workers=1)
        print(f"{world} ranks: {len(batches)} steps each")
    ids = np.sort(np.concatenate(seen))
    total = ds.catalog.num_rows
    once = len(ids) == total and bool(np.array_equal(ids, np.arange(total)))
    print(f"elastic 4 -> 3 ranks: {len(ids)} of {total} rows, exactly once: {once}")
    if not once:
        raise SystemExit("elastic resume lost or repeated rows")


def main() -> None:
    with tempfile.TemporaryDirectory() as path:
        write_corpus(path, [[1_000, 400], [1_300], [50] * 6])
        same_topology(path)
        elastic(path)


if __name__ == "__main__":
    main()
