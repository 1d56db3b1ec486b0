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
    import streamshard.reader as reader

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
