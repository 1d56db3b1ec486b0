"""How many batches in flight a loader's workers need: rows/s by ``prefetch_factor``, interleaved.

On ``throughput.py``'s cached corpus (run it once), 256-row batches (the default), 2 workers:
``StreamLoader`` with worker processes and with thread workers, and a plain ``DataLoader``, each at
several depths, plus a plain ``DataLoader`` over row-group batches. Every configuration keeps its
workers (persistent / reused), warms up one epoch, then runs one epoch per round, rounds
interleaved; the table shows the median. Writes ``benchmarks/out/loader_depth.json``.

    .venv/bin/python benchmarks/loader_depth.py [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import streamshard as ss  # noqa: E402

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "out" / "corpus" / "full"
COLUMNS = ["id", "input_ids", "score"]


def configurations() -> dict[str, tuple[ss.ParquetStream, object]]:
    out: dict[str, tuple[ss.ParquetStream, object]] = {}
    for kind in ("processes", "threads"):
        for depth in (None, 2, 4, 8):
            ds = ss.ParquetStream(str(CORPUS), columns=COLUMNS, rank=0, world_size=1)
            name = f"StreamLoader {kind}, prefetch_factor={depth}"
            out[name] = (ds, ss.StreamLoader(ds, num_workers=2, workers=kind, prefetch_factor=depth,
                                             persistent_workers=kind == "processes"))
    for batch_size, depth in ((256, 2), (256, 4), (256, 8), (None, 2)):
        ds = ss.ParquetStream(str(CORPUS), columns=COLUMNS, rank=0, world_size=1, batch_size=batch_size)
        ds.set_epoch(0)
        out[f"plain DataLoader, bs={batch_size}, prefetch_factor={depth}"] = (
            ds, DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True, prefetch_factor=depth))
    return out


def epoch(loader: object) -> float:
    started, rows = time.perf_counter(), 0
    for batch in loader:  # type: ignore[attr-defined]
        rows += int((batch["sample_id"] >= 0).sum())
    return rows / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if not CORPUS.is_dir():
        sys.exit(f"no corpus at {CORPUS}: run benchmarks/throughput.py once")
    load = [os.getloadavg()[0]]
    configs = configurations()
    for ds, loader in configs.values():
        epoch(loader)  # warm-up: workers started, files cached
    runs: dict[str, list[float]] = {name: [] for name in configs}
    for round_ in range(args.rounds):
        for name, (ds, loader) in configs.items():
            if isinstance(loader, DataLoader):
                ds.set_epoch(round_ + 1)
            runs[name].append(epoch(loader))
    load.append(os.getloadavg()[0])
    print(f"rows/s, median of {args.rounds} interleaved rounds; load average {load[0]:.2f} -> {load[1]:.2f}")
    table = {name: {"median": statistics.median(r), "runs": r} for name, r in runs.items()}
    for name, row in table.items():
        print(f"{name:55} {row['median']:12,.0f}")
    os.makedirs(HERE / "out", exist_ok=True)
    with open(HERE / "out" / "loader_depth.json", "w") as f:
        json.dump({"load": load, "results": table}, f, indent=2)


if __name__ == "__main__":
    main()
