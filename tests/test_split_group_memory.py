"""What a worker holds while it reads its part of a huge row group: the part once, in the flat form
batches gather from, plus about one record batch in Arrow; never the part in Arrow as well (issue 25
item 4; ``benchmarks/big_row_group.py`` measures the process's peak RSS on a 304 MiB group).

Measured in a fresh process (Arrow's allocator counts its peak per process, ``max_memory``): the
peak of Arrow's allocations, and of numpy's (``tracemalloc`` traces numpy's buffers), while each of
the two shares of one streamed row group is read, unshuffled and shuffled. The thresholds are lowered so a
48 MiB group is "huge" and record batches are 1 MiB; the bounds are loose (several record batches;
the part plus a fifth), while the old path (the part decoded into a table, then joined for
conversion) held the part in Arrow two times over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parent.parent
ROWS, WIDTH = 24_000, 512  # one row group of list<int32>: 47 MiB of items

CHILD = textwrap.dedent("""
    import json, sys, tracemalloc
    import numpy as np
    import pyarrow as pa
    import streamshard as ss
    import streamshard.io.reader as reader

    reader.STREAM_ABOVE_BYTES = 16 << 20
    reader.STREAM_BATCH_BYTES = 1 << 20
    path = sys.argv[1]
    out = {"arrow_peak": [], "numpy_peak": [], "rows": []}
    tracemalloc.start()
    # The first pass is run twice: its first run imports what the package imports lazily (Python objects).
    for shuffle, rank in ((False, 0), (False, 0), (False, 1), (True, 0), (True, 1)):
        ds = ss.ParquetStream(path, batch_size=512, shuffle=shuffle, seed=3, rank=rank, world_size=2)
        ds.set_epoch(0)
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        ids = []
        for batch in ds:
            ids.extend(batch["id"][batch["sample_id"] >= 0].tolist())
            assert (batch["x"][:, 0] == batch["id"] % 1000).all()  # each row's items are its own
            del batch
        out["numpy_peak"].append(tracemalloc.get_traced_memory()[1] - start)
        out["arrow_peak"].append(pa.default_memory_pool().max_memory())
        out["rows"].append(sorted(ids))
    print(json.dumps({key: values[1:] for key, values in out.items()}))
""")


@pytest.mark.slow
def test_a_workers_share_of_a_huge_row_group_is_held_once(tmp_path):
    ids = np.arange(ROWS, dtype=np.int64)
    values = (np.arange(ROWS * WIDTH, dtype=np.int64) % 7).astype(np.int32)
    values[::WIDTH] = (ids % 1000).astype(np.int32)  # a row's first item says whose it is
    offsets = pa.array(np.arange(0, ROWS * WIDTH + 1, WIDTH, dtype=np.int32))
    path = tmp_path / "one-group.parquet"
    pq.write_table(pa.table({"id": ids, "x": pa.ListArray.from_arrays(offsets, pa.array(values))}), path,
                   row_group_size=ROWS)
    part = ROWS // 2 * WIDTH * 4  # a share's items, in bytes

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])

    for first in (0, 2):  # unshuffled, shuffled: every row once over the two shares
        assert sorted(got["rows"][first] + got["rows"][first + 1]) == list(range(ROWS))
    for arrow_peak, numpy_peak in zip(got["arrow_peak"], got["numpy_peak"]):
        # Arrow: a few record batches of 1 MiB at a time, whatever the size of the share (24 MiB).
        assert arrow_peak <= part / 3, f"Arrow held {arrow_peak / 2**20:.1f} MiB for a {part / 2**20:.0f} MiB share"
        # numpy: the share's items once (grown in place), plus batches gathered from it.
        assert numpy_peak <= 1.2 * part, f"numpy held {numpy_peak / 2**20:.1f} MiB for a {part / 2**20:.0f} MiB share"


def test_a_part_converted_piece_by_piece_equals_the_part_converted_at_once():
    """``part_convert.convert_part`` (pieces of record batches, rows picked out of them by numpy)
    gives exactly what ``gather.convert_read`` gives for the same rows taken as one table: numbers,
    lists with null items (masks), lists of text, fixed-size lists, nullable text, empty lists."""
    from streamshard.convert.gather import convert_read
    from streamshard.convert.part_convert import convert_part
    from streamshard.convert.tensors import BatchConverter

    rng = np.random.default_rng(5)
    n = 3_000
    lengths = rng.integers(0, 9, n)
    items = int(lengths.sum())
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    values = pa.array(rng.integers(0, 100, items).astype(np.int32), mask=rng.random(items) < 0.1)
    words = pa.array([f"w{i}" for i in range(items)])
    table = pa.table({
        "id": np.arange(n, dtype=np.int64),
        "score": pa.array(rng.random(n), mask=rng.random(n) < 0.2),
        "ids": pa.ListArray.from_arrays(offsets, values),
        "words": pa.ListArray.from_arrays(offsets, words),
        "pair": pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(0, 9, 2 * n).astype(np.int16)), 2),
        "name": pa.array([None if i % 7 == 0 else f"r{i}" for i in range(n)]),
    })
    converter = BatchConverter(table.schema, source="t", inner_nulls="mask")
    for shuffled in (False, True):
        rows = np.sort(rng.choice(n, n // 2, replace=False)) if shuffled else np.arange(400, 2_900)
        pieces, start = [], 0
        for batch in table.to_batches(max_chunksize=256):  # like decode_rows: a run is a slice, else picks
            mine = rows[(rows >= start) & (rows < start + batch.num_rows)] - start
            if len(mine) == batch.num_rows:
                pieces.append((pa.Table.from_batches([batch]), None))
            elif len(mine) and mine[-1] - mine[0] == len(mine) - 1:
                pieces.append((pa.Table.from_batches([batch.slice(int(mine[0]), len(mine))]), None))
            elif len(mine):
                pieces.append((pa.Table.from_batches([batch]), mine))
            start += batch.num_rows
        want = convert_read(table.take(pa.array(rows)), converter)
        # One pass over all columns, or passes over subsets of them (a wide group; a column seen in an
        # earlier pass, as partition keys are, is not converted again).
        passes = [pieces], [[(t.select(["words", "id"]), p) for t, p in pieces],
                            [(t.select(["score", "ids", "id"]), p) for t, p in pieces],
                            [(t.select(["pair", "name"]), p) for t, p in pieces]]
        for part in passes:
            got = convert_part(iter(part), len(rows), converter)
            assert got.rows == want.rows == len(rows)
            assert list(got.columns) == list(want.columns)
            for key, value in want.columns.items():
                if isinstance(value, np.ndarray):
                    assert got.columns[key].dtype == value.dtype and np.array_equal(got.columns[key], value), key
                else:
                    assert list(got.columns[key]) == list(value), key
            for key, value in want.offsets.items():
                assert np.array_equal(got.offsets[key], value), key
