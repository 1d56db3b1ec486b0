"""Column types as real writers produce them: what becomes a tensor, and what is refused by name."""

from __future__ import annotations

import datetime as dt
import decimal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import streamshard as ss


def read_all(path, **kwargs):
    ds = ss.ParquetStream(str(path), rank=0, world_size=1, **kwargs)
    batches = list(ds)
    assert len(batches) == 1
    return batches[0]


def test_numeric_and_bool_columns_become_1d_tensors_of_the_same_dtype(tmp_path):
    table = pa.table(
        {
            "i8": pa.array([1, -2, 3], pa.int8()),
            "i32": pa.array([1, 2, 3], pa.int32()),
            "u8": pa.array([1, 2, 255], pa.uint8()),
            "u32": pa.array([1, 2, 2**32 - 1], pa.uint32()),
            "f16": pa.array(np.array([0.5, 1.5, 2.5], np.float16)),
            "f64": pa.array([0.1, 0.2, 0.3], pa.float64()),
            "flag": pa.array([True, False, True]),
        },
        schema=pa.schema([(n, t, False) for n, t in [
            ("i8", pa.int8()), ("i32", pa.int32()), ("u8", pa.uint8()), ("u32", pa.uint32()),
            ("f16", pa.float16()), ("f64", pa.float64()), ("flag", pa.bool_())]]),
    )
    pq.write_table(table, tmp_path / "t.parquet")
    batch = read_all(tmp_path)
    assert batch["i8"].dtype == torch.int8 and batch["i8"].tolist() == [1, -2, 3]
    assert batch["u8"].dtype == torch.uint8
    assert batch["u32"].dtype == torch.int64 and batch["u32"][2] == 2**32 - 1
    assert batch["f16"].dtype == torch.float16
    assert batch["flag"].dtype == torch.bool and batch["flag"].tolist() == [True, False, True]
    assert not any(k.endswith("_mask") for k in batch)  # non-nullable fields get no mask


def test_nulls_become_zero_with_an_explicit_mask_in_every_batch(tmp_path):
    pq.write_table(pa.table({"x": pa.array([1, None, 3, 4], pa.int64())}), tmp_path / "a.parquet", row_group_size=2)
    pq.write_table(pa.table({"x": pa.array([5, 6], pa.int64())}), tmp_path / "b.parquet")
    ds = ss.ParquetStream(str(tmp_path), rank=0, world_size=1)
    batches = list(ds)
    assert all("x_mask" in b for b in batches)  # keys do not depend on a batch's contents
    x = torch.cat([b["x"] for b in batches])
    mask = torch.cat([b["x_mask"] for b in batches])
    assert x.tolist() == [1, 0, 3, 4, 5, 6]
    assert mask.tolist() == [True, False, True, True, True, True]


def test_spark_and_impala_style_files_with_int96_dictionary_and_delta_encodings(tmp_path):
    n = 1000
    ts = pa.array([dt.datetime(2024, 1, 1) + dt.timedelta(seconds=i) for i in range(n)], pa.timestamp("ns"))
    table = pa.table(
        {
            "event_time": ts,
            "day": pa.array([dt.date(2024, 1, 1 + i % 28) for i in range(n)], pa.date32()),
            "category": pa.array([f"c{i % 5}" for i in range(n)]).dictionary_encode(),
            "user": pa.array(np.arange(n, dtype=np.int64) % 13),
            "delta": pa.array(np.arange(n, dtype=np.int64) * 3),
        }
    )
    pq.write_table(
        table, tmp_path / "spark.parquet", use_deprecated_int96_timestamps=True, flavor="spark",
        use_dictionary=["user", "category"], column_encoding={"delta": "DELTA_BINARY_PACKED"},
        row_group_size=300,
    )
    batches = list(ss.ParquetStream(str(tmp_path), rank=0, world_size=1))
    assert len(batches) == 4
    events = torch.cat([b["event_time"] for b in batches])
    assert events.dtype == torch.int64
    assert int(events[1] - events[0]) == 1_000_000_000  # nanoseconds since the epoch
    assert torch.cat([b["day"] for b in batches]).dtype == torch.int32
    assert torch.cat([b["delta"] for b in batches]).tolist() == list(range(0, 3 * n, 3))
    assert batches[0]["category"][:3] == ["c0", "c1", "c2"]


def test_lists_become_padded_2d_tensors_with_lengths_and_fixed_lists_need_none(tmp_path):
    table = pa.table(
        {
            "tokens": pa.array([[1, 2, 3], [], None, [4]], pa.list_(pa.int32())),
            "big": pa.array([[1], [2, 3], [], [4, 5, 6]], pa.large_list(pa.int64())),
            "emb": pa.array([[1.0, 2.0], [3.0, 4.0], None, [7.0, 8.0]], pa.list_(pa.float32(), 2)),
        }
    )
    pq.write_table(table, tmp_path / "l.parquet")
    b = read_all(tmp_path)
    assert b["tokens"].tolist() == [[1, 2, 3], [0, 0, 0], [0, 0, 0], [4, 0, 0]]
    assert b["tokens_lengths"].tolist() == [3, 0, 0, 1]
    assert b["tokens_mask"].tolist() == [True, True, False, True]
    assert b["big"].dtype == torch.int64 and b["big_lengths"].tolist() == [1, 2, 0, 3]
    assert b["emb"].shape == (4, 2) and "emb_lengths" not in b
    assert b["emb"][2].tolist() == [0.0, 0.0] and b["emb"][3].tolist() == [7.0, 8.0]


def test_structs_flatten_into_dotted_keys_and_strings_pass_through(tmp_path):
    table = pa.table(
        {
            "meta": pa.array([{"a": 1, "b": {"c": 2.0}}, {"a": 3, "b": {"c": 4.0}}]),
            "text": pa.array(["hello", None]),
            "tags": pa.array([["x", "y"], []], pa.list_(pa.string())),
        }
    )
    pq.write_table(table, tmp_path / "s.parquet")
    b = read_all(tmp_path)
    assert b["meta.a"].tolist() == [1, 3] and b["meta.b.c"].tolist() == [2.0, 4.0]
    assert b["text"] == ["hello", None]
    assert b["tags"] == [["x", "y"], []]


@pytest.mark.parametrize(
    "array, type_name",
    [
        (pa.array([decimal.Decimal("1.10"), decimal.Decimal("2.20")], pa.decimal128(5, 2)), "decimal"),
        (pa.array([[("k", 1)], [("j", 2)]], pa.map_(pa.string(), pa.int64())), "map"),
        (pa.array([[[1], [2, 3]], [[4]]], pa.list_(pa.list_(pa.int64()))), "list<element: list"),
    ],
)
def test_types_without_tensor_meaning_are_refused_naming_file_and_column(tmp_path, array, type_name):
    pq.write_table(pa.table({"ok": [1, 2], "bad": array}), tmp_path / "odd.parquet")
    ds = ss.ParquetStream(str(tmp_path), rank=0, world_size=1)
    with pytest.raises(ss.ConversionError, match=rf"odd\.parquet.*'bad'.*{type_name}"):
        ds.set_epoch(0)
    assert read_all(tmp_path, columns=["ok"])["ok"].tolist() == [1, 2]  # projecting it out works


def test_null_values_inside_lists_are_refused_by_column(tmp_path):
    pq.write_table(pa.table({"v": pa.array([[1, None], [2]], pa.list_(pa.int64()))}), tmp_path / "n.parquet")
    with pytest.raises(ss.ConversionError, match="'v'"):
        read_all(tmp_path)


def test_uint64_beyond_int64_is_refused(tmp_path):
    pq.write_table(pa.table({"u": pa.array([1, 2**64 - 1], pa.uint64())}), tmp_path / "u.parquet")
    with pytest.raises(ss.ConversionError, match="'u'"):
        read_all(tmp_path)


def test_sliced_and_shuffled_rows_keep_lists_aligned(tmp_path):
    values = [[i] * (i % 5) for i in range(200)]
    pq.write_table(pa.table({"id": np.arange(200), "v": pa.array(values, pa.list_(pa.int64()))}), tmp_path / "a.parquet", row_group_size=64)
    for batch in ss.ParquetStream(str(tmp_path), shuffle=True, seed=1, batch_size=30, rank=1, world_size=3):
        for row, sid in enumerate(batch["sample_id"].tolist()):
            if sid >= 0:
                n = int(batch["v_lengths"][row])
                assert n == sid % 5 and batch["v"][row, :n].tolist() == [sid] * n


@pytest.mark.parametrize("batch_size", [None, 7])
def test_flat_lists_hold_the_same_rows_as_padded_ones(tmp_path, batch_size):
    values = [[i] * (i % 6) for i in range(50)]
    pq.write_table(pa.table({"v": pa.array(values, pa.list_(pa.int32()))}), tmp_path / "a.parquet", row_group_size=16)
    common = dict(batch_size=batch_size, shuffle=True, seed=2, rank=1, world_size=2)
    padded = list(ss.ParquetStream(str(tmp_path), **common))
    flat = list(ss.ParquetStream(str(tmp_path), lists="flat", **common))
    assert len(padded) == len(flat)
    for p, f in zip(padded, flat):
        assert f["v"].dim() == 1 and int(f["v_lengths"].sum()) == f["v"].numel()
        assert torch.equal(f["v_lengths"], p["v_lengths"])
        assert torch.equal(ss.pad_lists(f["v"], f["v_lengths"], width=p["v"].shape[1]), p["v"])
    assert any((b["sample_id"] < 0).any() for b in flat) == any((b["sample_id"] < 0).any() for b in padded)


def test_pad_lists_checks_width_and_pads_with_a_value():
    values, lengths = torch.tensor([1, 2, 3]), torch.tensor([2, 0, 1])
    assert ss.pad_lists(values, lengths, value=-1).tolist() == [[1, 2], [-1, -1], [3, -1]]
    with pytest.raises(ValueError, match="width=1"):
        ss.pad_lists(values, lengths, width=1)
    with pytest.raises(ValueError, match="lists"):
        ss.ParquetStream("x.parquet", lists="ragged", rank=0, world_size=1)
