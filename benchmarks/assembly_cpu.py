"""CPU per row of batch assembly, in one thread: issue 25's short corpus through
``StreamLoader(num_workers=0)`` with ``read_ahead=0``, so every CPU-second is this process's main
thread (plus pyarrow's decoding pool) and no thread waits on another. Steadier than the threaded
rows/s of ``throughput.py`` on a shared machine: it counts work, not waiting.

    .venv/bin/python benchmarks/assembly_cpu.py                       # this checkout
    .venv/bin/python benchmarks/assembly_cpu.py --tree ../other-tree   # another checkout, same corpus

Each configuration: one warm-up epoch, then the lowest process CPU of ``--repeats`` epochs, per
million rows. ``bs=None, lists=flat`` (one batch per row group) is the floor: decoding plus the
per-read work, with almost no per-batch work. Writes ``benchmarks/out/assembly_cpu.json``
(appends one record per run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=str(HERE.parent), help="the checkout whose streamshard is measured")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(args.tree).resolve()))
    sys.path.insert(0, str(HERE))
    import streamshard
    from streamshard import ParquetStream, StreamLoader
    from throughput import SPECS, ensure_corpus, COLUMNS  # the same cached corpus

    directory = ensure_corpus(SPECS["short"])
    configs = [("defaults (bs=256, padded)", {}), ("shuffle=True", {"shuffle": True}),
               ("bs=256, lists=flat", {"lists": "flat"}), ("shuffle=True, lists=flat", {"shuffle": True, "lists": "flat"}),
               ("bs=None, lists=flat (floor)", {"lists": "flat", "batch_size": None})]
    load = os.getloadavg()
    results = {}
    for name, kwargs in configs:
        ds = ParquetStream(str(directory), columns=COLUMNS, read_ahead=0, **{"batch_size": 256, **kwargs})
        loader = StreamLoader(ds, num_workers=0)
        rows = 0
        for batch in loader:  # warm-up (catalog, caches)
            rows += int((batch["sample_id"] >= 0).sum())
        best = float("inf")
        for _ in range(args.repeats):
            began = time.process_time()
            for _batch in loader:
                pass
            best = min(best, time.process_time() - began)
        results[name] = best / rows * 1e6
    print(f"streamshard from {Path(streamshard.__file__).parent}; load {load[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print("| configuration | CPU-s per M rows |\n|---|---:|")
    for name, value in results.items():
        print(f"| {name} | {value:.2f} |")
    out = HERE / "out" / "assembly_cpu.json"
    out.parent.mkdir(exist_ok=True)
    runs = json.loads(out.read_text()) if out.exists() else []
    runs.append({"tree": str(Path(args.tree).resolve()), "loadavg": [load[0], os.getloadavg()[0]],
                 "cpu_s_per_mrows": results})
    out.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
