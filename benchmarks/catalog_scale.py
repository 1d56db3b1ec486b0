"""How long a catalog of many small files takes, where the time goes, and what memory it needs.

A directory of ``--files`` Parquet files (100,000 by default; 1 row group of 10 rows, two columns:
the per-file costs dominate, as in a lake of many small files) is cataloged in a fresh process
each time, so nothing is shared between runs:

* ``listing``: ``catalog.list_entries`` alone (the recursive directory walk with sizes and mtimes);
* ``cold``: ``Catalog.build`` of the directory (listing, every footer, schemas, arrays);
* ``warm``: the same with ``catalog_cache`` filled by a previous build (listing, then the cache).

Each row reports wall seconds, the process's CPU seconds (all threads), and the peak resident memory
above the process's baseline after importing streamshard (``ru_maxrss``). ``--tree`` runs another
checkout (``PYTHONPATH``) on the same files, for before/after tables.

    .venv/bin/python benchmarks/catalog_scale.py [--files 100000] [--repeats 1] [--tree /path/to/checkout]

Writes ``benchmarks/out/catalog_scale.json`` (``catalog_scale-<files>.json`` for other sizes).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"

JOB = """
import json, os, resource, sys, time
import streamshard as ss
from streamshard.io.catalog import list_entries
what, path, cache = sys.argv[1], sys.argv[2], sys.argv[3]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cpu, wall = time.process_time(), time.perf_counter()
if what == "listing":
    count = len(list_entries(path))
else:
    count = len(ss.Catalog.build(path, distributed=False, cache_dir=cache if what == "warm" else None).urls)
print(json.dumps({"files": count, "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                  "peak_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024,
                  "streamshard": os.path.dirname(os.path.dirname(ss.__file__))}))
"""


def write_files(directory: Path, count: int) -> None:
    """``count`` copies of one small Parquet file, 1,000 to a subdirectory (what a lake's writers leave)."""
    buffer = io.BytesIO()
    pq.write_table(pa.table({"id": pa.array(range(10), pa.int64()), "input_ids": pa.array([[1, 2, 3]] * 10)}),
                   buffer)
    data = buffer.getvalue()
    for i in range(count):
        sub = directory / f"d{i // 1000:04d}"
        if i % 1000 == 0:
            sub.mkdir(parents=True, exist_ok=True)
        (sub / f"part-{i:07d}.parquet").write_bytes(data)


def run(tree: Path, what: str, path: Path, cache: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # Run in the tree: `python -c` puts the working directory first on sys.path, ahead of PYTHONPATH.
    done = subprocess.run([sys.executable, "-c", JOB, what, str(path), str(cache)], capture_output=True, text=True,
                          env=env, cwd=str(tree), check=False)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["streamshard"]).resolve() != tree:
        raise SystemExit(f"measured {result['streamshard']}, not the tree {tree}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--tree", action="append", default=None,
                        help="a checkout to measure (repeatable; default: this one)")
    args = parser.parse_args()
    trees = [Path(t).resolve() for t in (args.tree or [str(ROOT)])]
    rows = []
    with tempfile.TemporaryDirectory(prefix="catalog_scale-") as tmp:
        data, start = Path(tmp) / "data", time.perf_counter()
        write_files(data, args.files)
        print(f"wrote {args.files} files in {time.perf_counter() - start:.1f} s")
        for repeat in range(args.repeats):
            for tree in trees:
                cache = Path(tmp) / f"cache-{trees.index(tree)}-{repeat}"
                for what in ("listing", "cold", "warm"):
                    if what == "warm":
                        run(tree, "warm", data, cache)  # fills the cache (a cold build that writes it)
                    rows.append({"tree": str(tree), "repeat": repeat, "case": what, **run(tree, what, data, cache)})
    print(f"\n{'tree':<28} {'case':<8} {'files':>8} {'wall s':>8} {'CPU s':>8} {'peak MB':>8}")
    for r in rows:
        print(f"{Path(r['tree']).name[:28]:<28} {r['case']:<8} {r['files']:>8} {r['wall_s']:>8.2f} {r['cpu_s']:>8.2f} "
              f"{r['peak_mb']:>8.0f}")
    OUT.mkdir(exist_ok=True)
    out = OUT / ("catalog_scale.json" if args.files == 100_000 else f"catalog_scale-{args.files}.json")
    out.write_text(json.dumps({
        "command": "benchmarks/catalog_scale.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()},
        "rows": rows,
    }, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
