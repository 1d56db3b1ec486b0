"""A/B of the worker hand-off: this checkout against another one (``--src``), on the same corpus.

Each round runs, in a fresh process per checkout and configuration (alternating the checkouts):
``StreamLoader(ds, num_workers=2, workers="processes")`` (slotted worker processes) and a plain
``DataLoader(ds, batch_size=None, num_workers=2)``, both at the default ``batch_size=256``, and the
plain DataLoader over row-group batches (``ParquetStream(batch_size=None)``); persistent workers, one
warm-up epoch, then rows/s over two epochs. Prints a table of medians and the new/old
ratio, and writes ``benchmarks/out/handoff_ab.json``. The corpus is ``throughput.py``'s (run it once).

    git worktree add /tmp/old <commit> && .venv/bin/python benchmarks/handoff_ab.py --src /tmp/old
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "benchmarks" / "out" / "corpus" / "full"

CHILD = r'''
import sys, time
sys.path.insert(0, sys.argv[1])
import streamshard as ss
from torch.utils.data import DataLoader
ds = ss.ParquetStream(sys.argv[2] + "/*.parquet", batch_size=None if sys.argv[3] == "dataloader-none" else 256)
ds.set_epoch(0)
if sys.argv[3] == "stream":
    kwargs = {"workers": "processes"} if "workers" in ss.StreamLoader.__init__.__code__.co_varnames else {}
    loader = ss.StreamLoader(ds, num_workers=2, persistent_workers=True, **kwargs)
else:
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
for _ in loader:
    pass
start, rows = time.perf_counter(), 0
for _ in range(2):
    for batch in loader:
        rows += int((batch["sample_id"] >= 0).sum())
print(rows / (time.perf_counter() - start))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True, help="the other checkout (the 'old' side)")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if not CORPUS.is_dir():
        sys.exit(f"no corpus at {CORPUS}: run benchmarks/throughput.py once")
    sides = {"old": str(Path(args.src).resolve()), "new": str(ROOT)}
    results: dict[str, list[float]] = {}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for loader in ("stream", "dataloader", "dataloader-none"):
            for side, src in sides.items():
                out = subprocess.run([sys.executable, "-c", CHILD, src, str(CORPUS), loader],
                                     capture_output=True, text=True, check=True)
                results.setdefault(f"{loader} {side}", []).append(float(out.stdout.strip().splitlines()[-1]))
    load.append(os.getloadavg()[0])
    print(f"rows/s, median of {args.rounds} rounds; load average {load[0]:.1f} -> {load[1]:.1f}")
    print(f"{'configuration':40} {'old':>10} {'new':>10} {'new/old':>8}")
    table = {}
    for loader, label in (("stream", "StreamLoader, worker processes, bs=256"),
                          ("dataloader", "plain DataLoader, 2 workers, bs=256"),
                          ("dataloader-none", "plain DataLoader, 2 workers, bs=None")):
        old, new = (statistics.median(results[f"{loader} {s}"]) for s in ("old", "new"))
        table[label] = {"old": old, "new": new, "ratio": new / old, "runs": {s: results[f"{loader} {s}"] for s in sides}}
        print(f"{label:40} {old:10,.0f} {new:10,.0f} {new / old:8.2f}")
    os.makedirs(ROOT / "benchmarks" / "out", exist_ok=True)
    with open(ROOT / "benchmarks" / "out" / "handoff_ab.json", "w") as f:
        json.dump({"src": sides["old"], "load": load, "results": table}, f, indent=2)


if __name__ == "__main__":
    main()
