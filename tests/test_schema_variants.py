"""Schemas as real writers leave them (issue 24 items 4 and 6): columns in another order, pandas' empty and
all-None frames (``null`` columns), extension types whatever was imported first, and types pyarrow or
tensors do not support, called unsupported with the file and column named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamshard as ss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stream(path, batch_size=16, **kwargs):
    return list(ss.ParquetStream(str(path), rank=0, world_size=1, batch_size=batch_size, **kwargs))


def test_files_with_the_same_columns_in_another_order_stream_by_name(tmp_path):
    # They were refused ("schemas disagree"), although columns= read them.
    pq.write_table(pa.table({"a": [1, 2, 3], "b": ["x", "y", "z"], "c": [0.5, 1.5, 2.5]}), tmp_path / "1.parquet")
    pq.write_table(pa.table({"c": [3.5, 4.5], "a": [4, 5], "b": ["u", "v"]}), tmp_path / "2.parquet")
    (batch,) = stream(tmp_path, batch_size=5)
    assert batch["a"].tolist() == [1, 2, 3, 4, 5]
    assert batch["b"] == ["x", "y", "z", "u", "v"]
    assert batch["c"].tolist() == [0.5, 1.5, 2.5, 3.5, 4.5]
    catalog = ss.Catalog.build(str(tmp_path), columns=["b", "c"])  # byte ranges follow each file's order too
    assert catalog.columns == ["b", "c"]
    (batch,) = stream(tmp_path, batch_size=5, columns=["c", "a"])
    assert batch["c"].tolist() == [0.5, 1.5, 2.5, 3.5, 4.5] and batch["a"].tolist() == [1, 2, 3, 4, 5]


def test_files_with_other_columns_name_the_columns_they_share(tmp_path):
    pq.write_table(pa.table({"a": [1], "b": [2]}), tmp_path / "1.parquet")
    pq.write_table(pa.table({"a": [3], "c": [4]}), tmp_path / "2.parquet")
    with pytest.raises(ss.CatalogError, match=r"1\.parquet has columns \['a', 'b'\] but .*2\.parquet has "
                                              r"\['a', 'c'\]; pass columns=\['a'\]"):
        stream(tmp_path)


def test_pandas_empty_and_all_none_frames_stream_with_the_others(tmp_path):
    import pandas as pd
    # An empty frame's object columns are written as null (the single file was a bare ValueError, "A null
    # type field may not be non-nullable"); an all-None column is null too; float64 empty columns likewise
    # must not stop the int64 of the files with rows.
    pd.DataFrame({"a": pd.Series([], dtype=object), "b": pd.Series([], dtype=object)}).to_parquet(
        tmp_path / "0-empty.parquet")
    pd.DataFrame({"a": pd.Series([], dtype="float64"), "b": pd.Series([], dtype=object)}).to_parquet(
        tmp_path / "1-empty-float.parquet")
    pd.DataFrame({"a": [1, 2], "b": ["x", "y"]}).to_parquet(tmp_path / "2-rows.parquet")
    pd.DataFrame({"a": [None, None], "b": ["z", None]}).to_parquet(tmp_path / "3-none.parquet")
    assert pq.read_schema(tmp_path / "0-empty.parquet").field("a").type == pa.null()
    (batch,) = stream(tmp_path)
    real = batch["sample_id"] >= 0
    assert batch["a"][real].tolist() == [1, 2, 0, 0] and batch["a_mask"][real].tolist() == [True, True, False, False]
    assert [b for b, r in zip(batch["b"], real) if r] == ["x", "y", "z", None]
    # a catalog of the empty file alone: the null column is named, as having no values to convert
    with pytest.raises(ss.ConversionError, match=r"0-empty\.parquet: column 'a' of type null \(unsupported\)"):
        stream(tmp_path / "0-empty.parquet")


_STREAM_DIGEST = textwrap.dedent("""
    import json, sys
    if sys.argv[1] == "write":  # write the files with datasets and pandas, which registers their extension types
        import datasets, pandas as pd
        features = datasets.Features({"a": datasets.Array2D((2, 3), "float32")})
        rows = [[[i, i + 1, i + 2], [i + 3, i + 4, i + 5]] for i in range(4)]
        datasets.Dataset.from_dict({"a": rows}, features=features).to_parquet(sys.argv[2])
        pd.DataFrame({"p": pd.period_range("2020-01", periods=4, freq="M"),
                      "i": pd.interval_range(0, 4)}).to_parquet(sys.argv[3])
    import pyarrow.parquet as pq
    import streamshard as ss
    out = {"registered": [str(t) for t in pq.read_schema(sys.argv[2]).types + pq.read_schema(sys.argv[3]).types]}
    for path in sys.argv[2:]:
        try:
            batches = list(ss.ParquetStream(path, rank=0, world_size=1, batch_size=4))
            out[path] = [{k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in b.items()} for b in batches]
        except Exception as exc:
            out[path] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_extension_types_read_the_same_whatever_was_imported_first(tmp_path):
    # A Hugging Face Array2D column streamed, or was refused when `datasets` had been imported; pandas'
    # Period/Interval likewise after pandas registered its types.
    import datasets  # noqa: F401 - a dev dependency: its absence fails the test
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    array2d, periods = str(tmp_path / "array2d.parquet"), str(tmp_path / "periods.parquet")
    seen = {}
    for first in ("write", "nothing"):  # the writing process has both packages' types registered
        done = subprocess.run([sys.executable, "-c", _STREAM_DIGEST, first, array2d, periods], env=env,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-2000:]
        seen[first] = json.loads(done.stdout.strip().splitlines()[-1])
    registered = seen["write"]["registered"]
    assert any("Array2D" in t for t in registered) and any("extension<pandas" in t for t in registered)
    assert not any("extension" in t for t in seen["nothing"]["registered"])
    assert seen["write"][array2d] == seen["nothing"][array2d]
    assert seen["write"][periods] == seen["nothing"][periods]
    (batch,) = seen["nothing"][array2d]
    assert batch["a"] == [float(i + k) for i in range(4) for k in range(6)]  # 4 rows of 2 x 3, flat
    (batch,) = seen["nothing"][periods]
    assert batch["p"] == [600, 601, 602, 603]  # months since 1970-01: 2020-01 ...
    assert batch["i.left"] == [0, 1, 2, 3] and batch["i.right"] == [1, 2, 3, 4]


def test_a_type_pyarrow_cannot_read_is_called_unsupported_naming_the_file(tmp_path):
    import polars as pl
    # polars' Int128 was called a "corrupt Parquet footer"
    pl.DataFrame({"big": pl.Series([1, 2**100], dtype=pl.Int128), "b": [1, 2]}).write_parquet(tmp_path / "i128.parquet")
    with pytest.raises(ss.CatalogError, match=r"i128\.parquet: column 'big' \(a 128-bit integer\): unsupported "
                                              r"type") as caught:
        stream(tmp_path / "i128.parquet")
    assert "corrupt" not in str(caught.value)
