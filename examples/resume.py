"""Stop mid-epoch, save a data checkpoint, and resume: on the same topology and on another one.

    python examples/resume.py

Part 1 resumes one rank's StreamLoader (2 workers) and checks the batches are exactly those the
uninterrupted run would have given. Part 2 stops 4 simulated ranks x 2 workers after 3 steps and
finishes the epoch on 3 ranks x 1 worker, then checks every row was delivered exactly once. The
loader counts what it handed out: the checkpoint needs no numbers from the training loop.
"""

from __future__ import annotations

import itertools
import json
import tempfile

import numpy as np
import torch

import streamshard as ss
from streamshard.testing import write_corpus


def stream(path: str, rank: int = 0, world_size: int = 1) -> ss.ParquetStream:
    return ss.ParquetStream(path, batch_size=64, shuffle=True, seed=0, rank=rank, world_size=world_size)



def same_topology(path: str) -> None:
    full = list(ss.StreamLoader(stream(path), num_workers=2))
    k = 7
    loader = ss.StreamLoader(stream(path), num_workers=2)
    head = list(itertools.islice(loader, k))  # training stops (preemption) after k steps
    state = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint would; no counts passed in
    resumed = ss.StreamLoader(stream(path), num_workers=2)
    resumed.load_state_dict(state)
    print(f"same topology: stopped after {k} of {len(full)} batches; the resumed loader's epoch is still "
          f"{len(resumed)} batches long, {len(resumed) - k} of them left")
    rest = list(resumed)
    identical = len(rest) == len(full) - k and all(
        torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(head + rest, full))
    print(f"  identical to the uninterrupted run: {identical}")
    print(f"  checkpoint: {json.dumps(state)}")
    if not identical:
        raise SystemExit("resume differs")


def elastic(path: str) -> None:
    seen, state = [], None
    for world, workers, stop_after in ((4, 2, 3), (3, 1, None)):
        states = []
        for rank in range(world):
            loader = ss.StreamLoader(stream(path, rank, world), num_workers=workers)
            if state is not None:
                loader.load_state_dict(state)
            batches = list(itertools.islice(loader, stop_after))
            seen.extend(b["sample_id"][b["sample_id"] >= 0].numpy() for b in batches)
            states.append(loader.state_dict())
        state = states[0]  # every rank saved the same state
        print(f"{world} ranks x {workers} workers: {len(batches)} steps each")
    ids = np.sort(np.concatenate(seen))
    total = loader.dataset.catalog.num_rows
    once = len(ids) == total and bool(np.array_equal(ids, np.arange(total)))
    print(f"elastic 4x2 -> 3x1: {len(ids)} of {total} rows, exactly once: {once}")
    if not once:
        raise SystemExit("elastic resume lost or repeated rows")


def main() -> None:
    with tempfile.TemporaryDirectory() as path:
        write_corpus(path, [[1_000, 400], [1_300], [50] * 6])
        same_topology(path)
        elastic(path)


if __name__ == "__main__":
    main()
