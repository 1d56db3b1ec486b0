"""What verifying page checksums costs a row-group read (issue 24 item 5).

Writes one file per compression with ``write_page_checksum=True`` (int64, float64 and a ~20-character
string column), then reads every row group through ``RowGroupReader`` (fetch + decode + the value check),
``verify_checksums`` off and on, interleaved, and prints the median seconds of each and their ratio.
JSON lands in ``benchmarks/out/page_checksums.json`` (``page_checksums-quick.json`` with ``--quick``).

    .venv/bin/python benchmarks/page_checksums.py            # 2,000,000 rows per file, 5 rounds
    .venv/bin/python benchmarks/page_checksums.py --quick    # 200,000 rows, 3 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from streamshard.io.reader import RowGroupReader  # noqa: E402


def write(path: Path, rows: int, compression: str) -> None:
    rng = np.random.default_rng(0)
    table = pa.table({
        "id": pa.array(np.arange(rows, dtype=np.int64)),
        "x": pa.array(rng.random(rows)),
        "text": pa.array([f"row {i} of the corpus" for i in range(rows)]),
    })
    pq.write_table(table, path, row_group_size=131072, compression=compression, write_page_checksum=True)


def read_all(path: Path, verify: bool) -> float:
    meta = pq.read_metadata(path)
    reader = RowGroupReader([str(path)], [os.path.getsize(path)], None, verify_checksums=verify)
    started = time.perf_counter()
    for rg in range(meta.num_row_groups):
        reader.read(0, rg)
    elapsed = time.perf_counter() - started
    reader.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rows, rounds = (200_000, 3) if args.quick else (2_000_000, 5)
    out_dir = HERE / "out" / "page_checksums"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    print(f"{'compression':<12} {'MB':>7} {'off s':>8} {'on s':>8} {'on/off':>7}")
    for compression in ("snappy", "none"):
        path = out_dir / f"{compression}-{rows}.parquet"
        if not path.exists():
            write(path, rows, compression)
        read_all(path, True)  # warm the page cache
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):
            for verify in (False, True):
                times[verify].append(read_all(path, verify))
        off, on = statistics.median(times[False]), statistics.median(times[True])
        record = {"compression": compression, "rows": rows, "file_bytes": os.path.getsize(path),
                  "off_s": times[False], "on_s": times[True], "median_off_s": off, "median_on_s": on,
                  "ratio": on / off}
        results.append(record)
        print(f"{compression:<12} {record['file_bytes'] / 1e6:7.1f} {off:8.3f} {on:8.3f} {on / off:7.3f}")
    out = HERE / "out" / ("page_checksums-quick.json" if args.quick else "page_checksums.json")
    out.write_text(json.dumps({"load_average": os.getloadavg(), "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
