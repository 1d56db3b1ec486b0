"""Hostile files (issue 23 item 7): truncated files and flipped bytes, in the footer and in the data, give
either exactly the rows pyarrow reads from the same bytes, or an error of the package's types that names
the file. Never a bare exception, an abort or a hang.

The cases are deterministic (a fixed seed over two small files, snappy and uncompressed, with int, float,
string, list and dictionary columns). They run in one child process (``python tests/test_hostile_files.py
DIR``) that prints a line per case, so an abort or a hang fails the test and names the case it was in.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from typing import Any, Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_table() -> Any:
    import pyarrow as pa

    n = 40
    return pa.table({
        "id": pa.array(range(n), pa.int64()),
        "x": pa.array([None if i % 7 == 3 else i * 0.5 for i in range(n)]),
        "s": pa.array([None if i % 5 == 1 else f"s{i}" * (i % 4) for i in range(n)]),
        "l": pa.array([None if i % 9 == 2 else list(range(i % 4)) for i in range(n)], pa.list_(pa.int32())),
        "d": pa.array([f"k{i % 3}" for i in range(n)]).dictionary_encode(),
    })


def mutations(data: bytes, rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """Truncations, single flipped bytes in the footer and in the pages, and wrong footer lengths."""
    n = len(data)
    length = int.from_bytes(data[-8:-4], "little")
    footer = n - 8 - length
    for k in range(1, 8):
        yield f"truncated to {n * k // 8} bytes", data[: n * k // 8]
    yield "last byte cut", data[:-1]
    for at in sorted(rng.sample(range(footer, n - 8), 14)):
        flipped = bytearray(data)
        flipped[at] ^= rng.choice([0x01, 0x80, 0xFF, 0x10])
        yield f"footer byte {at} flipped", bytes(flipped)
    for at in sorted(rng.sample(range(4, footer), 6)):
        flipped = bytearray(data)
        flipped[at] ^= 0xFF
        yield f"data byte {at} flipped", bytes(flipped)
    for claimed in (0, length + 1, length - 1, 2**31 - 1):
        wrong = bytearray(data)
        wrong[-8:-4] = claimed.to_bytes(4, "little")
        yield f"footer length {claimed}", bytes(wrong)


def _same(value: Any) -> Any:
    """A value comparable with ==, NaN included."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, list):
        return [_same(v) for v in value]
    return value


def streamed_rows(path: str) -> list[dict[str, Any]]:
    """Every row ParquetStream delivers for ``path``, in sample-id order, as Python values (None where masked)."""
    import streamshard as ss
    from helpers import rows_of

    rows: dict[int, dict[str, Any]] = {}
    stream = ss.ParquetStream(path, rank=0, world_size=1, batch_size=16)
    columns = stream.catalog.columns  # a flipped byte may rename one
    for batch in stream:
        for sid, row in rows_of(batch, columns):
            assert sid not in rows, f"sample id {sid} delivered twice"
            rows[sid] = row
    assert sorted(rows) == list(range(len(rows))), "sample ids are not 0..n-1"
    return [_same(rows[i]) for i in range(len(rows))]


def verdict(path: str) -> str:
    """``ok: ...`` when the case behaves, else what went wrong."""
    import pyarrow.parquet as pq

    import streamshard as ss

    try:
        expected = [_same(r) for r in pq.read_table(path).to_pylist()]
    except Exception:  # noqa: BLE001 - pyarrow refuses the bytes: then streaming them must fail too
        expected = None
    try:
        got = streamed_rows(path)
    except ss.StreamshardError as exc:
        if os.path.basename(path) not in str(exc):
            return f"an error that does not name the file: {type(exc).__name__}: {exc}"
        return f"ok: {type(exc).__name__}"
    except BaseException as exc:  # noqa: BLE001 - what this test is looking for
        return f"a foreign error: {type(exc).__module__}.{type(exc).__name__}: {exc}"
    if expected is None:
        return "rows delivered where pyarrow refuses the file"
    return "ok: rows" if got == expected else "other rows than pyarrow reads"


def run_cases(root: str) -> None:
    import pyarrow.parquet as pq

    rng = random.Random(0)
    case = 0
    for compression in ("snappy", "none"):
        source = os.path.join(root, f"source-{compression}.parquet")
        pq.write_table(source_table(), source, row_group_size=16, compression=compression)
        data = open(source, "rb").read()
        for name, blob in mutations(data, rng):
            path = os.path.join(root, f"case{case:03d}.parquet")
            with open(path, "wb") as f:
                f.write(blob)
            print(f"START case{case:03d} {compression}: {name}", flush=True)
            print(f"END case{case:03d} {compression}: {name} -> {verdict(path)}", flush=True)
            case += 1


@pytest.mark.slow
def test_hostile_files_give_their_rows_or_an_error_naming_them(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path)], capture_output=True,
                              text=True, timeout=240, env=env)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        started = [line for line in out.splitlines() if line.startswith("START")]
        pytest.fail(f"hung in {started[-1] if started else 'setup'}")
    lines = done.stdout.splitlines()
    if done.returncode != 0:
        started = [line for line in lines if line.startswith("START")]
        pytest.fail(f"the process died ({done.returncode}) in {started[-1] if started else 'setup'}: "
                    f"{done.stderr[-1500:]}")
    ended = [line for line in lines if line.startswith("END")]
    assert len(ended) == 64
    bad = [line for line in ended if "-> ok: " not in line]
    assert not bad, "\n".join(bad)
    kinds = {line.rsplit("-> ", 1)[1] for line in ended}
    assert {"ok: rows", "ok: CatalogError", "ok: ReadError"} <= kinds  # the set reaches every outcome


if __name__ == "__main__":
    run_cases(sys.argv[1])
