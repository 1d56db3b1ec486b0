"""Blend two corpora 70/30 row by row and prove the mix and exactly-once per corpus epoch.

Run: ``python examples/blend.py`` (a few seconds; writes to a temporary directory).

Two simulated ranks, each with a 2-worker StreamLoader, read one blend epoch under each stop rule.
"web" has 1,000 rows and "code" 300: "first_exhausted" ends the epoch when "code" is used up
(web gives 700 of its rows), "all_exhausted" when "web" is (code cycles into a second,
reshuffled corpus epoch). For each corpus the script prints rows delivered vs blend_counts and
checks that no row comes more often than the full passes plus one partial pass allow.
"""

from __future__ import annotations

import tempfile

import numpy as np
import torch

from streamshard.streams.blend import BlendedStream
from streamshard.plan.blend_schedule import blend_counts
from streamshard.streams.dataset import ParquetStream
from streamshard.loader.stream_loader import StreamLoader
from streamshard.testing import write_corpus

WEIGHTS = {"web": 0.7, "code": 0.3}
WORLD_SIZE, NUM_WORKERS, BATCH = 2, 2, 32


def one_epoch(paths: dict[str, str], stop: str) -> None:
    batches, steps = [], []
    for rank in range(WORLD_SIZE):
        corpora = {name: ParquetStream(path, shuffle=True, seed=1) for name, path in paths.items()}
        blend = BlendedStream(corpora, WEIGHTS, batch_size=BATCH, stop=stop, rank=rank, world_size=WORLD_SIZE)
        mine = list(StreamLoader(blend, num_workers=NUM_WORKERS))
        batches += mine
        steps.append(len(mine))
    corpus = torch.cat([b["corpus"] for b in batches]).numpy()
    ids = torch.cat([b["sample_id"] for b in batches]).numpy()
    real = [b["sample_id"] >= 0 for b in batches]
    rows_match = all(torch.equal(b["id"][r], b["sample_id"][r]) for b, r in zip(batches, real))
    expected = blend_counts(list(WEIGHTS.values()), blend.num_samples)
    print(f"\nstop={stop!r}: N={blend.num_samples} samples, {steps} steps per rank, "
          f"padding rows {int((corpus < 0).sum())}, data matches sample_id: {rows_match}")
    print(f"  {'corpus':<6} {'rows':>5} {'blend_counts':>12} {'observed':>8} {'share':>6}  exactly once per corpus epoch")
    for k, name in enumerate(blend.names):
        mine = ids[corpus == k]
        size = blend.sizes[k]
        # Unique rows delivered, and how often each was delivered: full passes plus a partial one.
        times = np.bincount(mine, minlength=size)
        full, extra = divmod(len(mine), size)
        proof = bool(times.min() >= full and times.max() <= full + 1 and (times > full).sum() == extra)
        print(f"  {name:<6} {size:>5} {expected[k]:>12} {len(mine):>8} {len(mine) / blend.num_samples:>6.3f}  "
              f"{proof} ({full} full pass(es) + {extra} rows of a partial one)")


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        paths = {"web": f"{root}/web", "code": f"{root}/code"}
        write_corpus(paths["web"], [[200, 150], [250], [100, 300]])
        write_corpus(paths["code"], [[64] * 4, [44]], seed=1)
        for stop in ("first_exhausted", "all_exhausted"):
            one_epoch(paths, stop)


if __name__ == "__main__":
    main()
