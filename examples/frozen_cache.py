"""Skip a frozen prefix's forward pass from epoch 2 on with ActivationCache.

A small Parquet corpus is streamed with ParquetStream; a model whose first layers are frozen (and
deliberately costly) trains a small head for 3 epochs. Epoch 1 computes and caches the prefix's
output per ``sample_id``; later epochs read it back (half from host memory, half from the disk
tier, to show both) and run only the head. Runs on CPU in well under a minute:

    python examples/frozen_cache.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader

from streamshard.cache import ActivationCache, module_fingerprint
from streamshard.streams.dataset import ParquetStream

DIM, CLASSES, FEATURES = 32, 10, 128
FILES, ROW_GROUPS, ROWS_PER_GROUP = 4, 4, 1024


def write_corpus(root: Path) -> list[str]:
    """Parquet files with ``x`` fixed_size_list<float32>[32] and a learnable int64 label ``y``."""
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((DIM, CLASSES)).astype(np.float32)
    paths = []
    for f in range(FILES):
        x = rng.standard_normal((ROW_GROUPS * ROWS_PER_GROUP, DIM)).astype(np.float32)
        y = (x @ teacher).argmax(axis=1).astype(np.int64)
        table = pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), DIM), "y": y})
        path = root / f"part-{f:02d}.parquet"
        pq.write_table(table, path, row_group_size=ROWS_PER_GROUP)
        paths.append(str(path))
    return paths


def frozen_prefix() -> torch.nn.Module:
    """A few wide Linear layers standing in for an expensive frozen backbone."""
    layers: list[torch.nn.Module] = [torch.nn.Linear(DIM, 1024), torch.nn.ReLU()]
    for _ in range(3):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(1024, FEATURES))
    prefix = torch.nn.Sequential(*layers).eval()
    prefix.requires_grad_(False)
    return prefix


def main() -> None:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_corpus(Path(tmp))
        ds = ParquetStream(paths, columns=["x", "y"], batch_size=500, shuffle=True, seed=0)
        loader = DataLoader(ds, batch_size=None, num_workers=0)
        prefix, head = frozen_prefix(), torch.nn.Linear(FEATURES, CLASSES)
        optimizer = torch.optim.Adam(head.parameters(), lr=3e-2)
        rows = FILES * ROW_GROUPS * ROWS_PER_GROUP
        host_bytes = rows * FEATURES * 4 // 2  # half the features fit in memory; the rest come from disk
        with ActivationCache(Path(tmp) / "cache", key=module_fingerprint(prefix), host_bytes=host_bytes) as cache:
            for epoch in range(3):
                ds.set_epoch(epoch)
                cache.reset_stats()
                start, seen, correct = time.perf_counter(), 0, 0
                for batch in loader:
                    x, y, ids = batch["x"], batch["y"], batch["sample_id"]

                    def run_prefix(miss: torch.Tensor) -> torch.Tensor:
                        with torch.no_grad():
                            return prefix(x[miss])

                    features = cache.get_or_compute(ids, run_prefix)
                    real = ids >= 0  # padding rows (-1) do not count in the loss
                    logits = head(features[real])
                    loss = torch.nn.functional.cross_entropy(logits, y[real])
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    seen += int(real.sum())
                    correct += int((logits.argmax(1) == y[real]).sum())
                s = cache.stats
                print(
                    f"epoch {epoch + 1}: {time.perf_counter() - start:6.2f} s  rows {seen}  "
                    f"train acc {correct / seen:.3f}  hit rate {s.hit_rate:.3f} "
                    f"(host {s.host_hits}, disk {s.disk_hits}, misses {s.misses})"
                )
            # The cached features are exactly what the prefix computes.
            first_file = pq.read_table(paths[0], columns=["x"]).column("x").combine_chunks()
            probe = torch.tensor(first_file.flatten().to_numpy().reshape(-1, DIM)[:256])
            cached, hit = cache.get(torch.arange(256))
            with torch.no_grad():
                exact = bool(hit.all()) and torch.equal(cached, prefix(probe))
            print(f"cache: {s.host_records} records in memory, {s.disk_records} on disk; "
                  f"cached == recomputed: {exact}")


if __name__ == "__main__":
    main()
