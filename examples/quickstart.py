"""Quick start: stream a Parquet corpus into PyTorch with ParquetStream.

    python examples/quickstart.py [PATH_OR_GLOB]

Without a path it writes a small corpus to a temporary directory first.
"""

from __future__ import annotations

import sys
import tempfile

import streamshard as ss
from streamshard.testing import write_corpus


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else write_demo_corpus()
    ds = ss.ParquetStream(path, columns=["input_ids", "label"], batch_size=128, shuffle=True, seed=0)
    loader = ss.StreamLoader(ds, num_workers=2)  # or DataLoader(ds, batch_size=None, num_workers=2)
    print(ds.catalog)
    print("per epoch:", ds.epoch_summary(num_workers=2), f"-> {len(loader)} batches for this rank")
    rows = steps = 0
    for batch in loader:
        real = batch["sample_id"] >= 0  # -1 marks padding rows
        rows += int(real.sum())
        steps += 1
    print(f"{steps} batches, {rows} rows; last batch keys: {sorted(batch)}")
    print(f"input_ids {tuple(batch['input_ids'].shape)} {batch['input_ids'].dtype}, lengths {tuple(batch['input_ids_lengths'].shape)}")
    print("checkpoint (the next epoch, from its start):", loader.state_dict()["history"])


def write_demo_corpus() -> str:
    path = tempfile.mkdtemp(prefix="streamshard-quickstart-")
    write_corpus(path, [[2_000, 1_500], [700], [3_000, 200, 900]], min_tokens=16, max_tokens=64)
    return path


if __name__ == "__main__":
    main()
