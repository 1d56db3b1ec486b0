"""What the footer walk (``parquet_thrift.scan_footer``: encryption and chunks that would abort pyarrow)
costs next to the rest of a footer's handling: pyarrow's parse and the catalog's summary of it.

For three footer shapes (3 columns x 1 row group, 20 x 10, 100 x 2), the best of 5 rounds of each step,
per footer. Prints a table; JSON lands in ``benchmarks/out/footer_walk.json``.

    .venv/bin/python benchmarks/footer_walk.py
"""

from __future__ import annotations

import io
import json
import os
import sys
import timeit
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from streamshard.io.catalog import _footer_from_metadata  # noqa: E402
from streamshard.format.parquet_thrift import scan_footer  # noqa: E402

SHAPES = [(3, 1000, 1000), (20, 100, 1000), (100, 10_000, 20_000)]  # columns, row group rows, rows


def best(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number


def main() -> None:
    results = []
    print(f"{'shape':<16} {'footer B':>9} {'walk ms':>8} {'parse ms':>9} {'summary ms':>11} {'walk/(parse+summary)':>21}")
    for columns, group, rows in SHAPES:
        table = pa.table({f"c{i}": np.arange(rows) for i in range(columns)})
        buffer = io.BytesIO()
        pq.write_table(table, buffer, row_group_size=group)
        data = buffer.getvalue()
        length = int.from_bytes(data[-8:-4], "little")
        tail = data[-8 - length:]
        metadata = pq.read_metadata(pa.BufferReader(tail))
        number = 200 if length < 2000 else 10
        walk = best(lambda: scan_footer(tail[:-8]), number)
        parse = best(lambda: pq.read_metadata(pa.BufferReader(tail)), number)
        summary = best(lambda: _footer_from_metadata("u", len(data), metadata, length, None, "v"), number)
        shape = f"{columns} x {rows // group} rg"
        record = {"shape": shape, "footer_bytes": length, "walk_s": walk, "parse_s": parse, "summary_s": summary}
        results.append(record)
        print(f"{shape:<16} {length:>9} {walk * 1e3:8.3f} {parse * 1e3:9.3f} {summary * 1e3:11.3f} "
              f"{walk / (parse + summary):21.2f}")
    out = HERE / "out" / "footer_walk.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"load_average": os.getloadavg(), "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
