"""Column types as real writers produce them: what becomes a tensor, and what is refused by name."""

from __future__ import annotations

import datetime as dt
import decimal
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

import streamshard as ss
from streamshard.convert.batches import concat, padding_like
from streamshard.convert.tensors import BatchConverter


def read_all(path, **kwargs):
    ds = ss.ParquetStream(str(path), batch_size=None, rank=0, world_size=1, **kwargs)
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
    ds = ss.ParquetStream(str(tmp_path), batch_size=None, rank=0, world_size=1)
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
    batches = list(ss.ParquetStream(str(tmp_path), batch_size=None, rank=0, world_size=1))
    assert len(batches) == 4
    events = torch.cat([b["event_time"] for b in batches])
    assert events.dtype == torch.int64
    assert int(events[1] - events[0]) == 1_000_000  # INT96 is read at microseconds since the epoch (int96.py)
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
    common = {"batch_size": batch_size, "shuffle": True, "seed": 2, "rank": 1, "world_size": 2}
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


# -- every writer's types: decimals, nested lists, lists of records, maps, nulls inside lists -------

def parquet(tmp_path, columns, name: str = "t.parquet", **write) -> str:
    """Write ``columns`` (a dict or table) and return the path: types are what Parquet round-trips."""
    path = tmp_path / name
    pq.write_table(columns if isinstance(columns, pa.Table) else pa.table(columns), path, **write)
    return str(path)


def convert(path: str, **kwargs):
    """The converter planned from the file's schema, and the whole file as one batch."""
    table = pq.read_table(path)
    kwargs.setdefault("inner_nulls", "mask")  # the nested shapes below are checked in their masked form
    converter = BatchConverter(table.schema, source=path, **kwargs)
    return converter, converter(table)


def loader_batches(path: str, **kwargs):
    """What training sees: ``ParquetStream(batch_size=4)`` through a real DataLoader."""
    kwargs.setdefault("inner_nulls", "mask")
    ds = ss.ParquetStream(path, batch_size=4, rank=0, world_size=1, **kwargs)
    return ds, list(DataLoader(ds, batch_size=None))


D = decimal.Decimal
PRICES = [D("1.10"), None, D("-12345678.99"), D("0.07"), D("99999999.99")]
AMOUNTS = [D("123456789012345678901234567890.12345"), D("-0.00001"), None, D("42.00000"), D("-92233720368547.75808")]
DECIMALS = {"price": pa.array(PRICES, pa.decimal128(10, 2)), "amount": pa.array(AMOUNTS, pa.decimal256(40, 5))}


def test_decimals_read_as_the_nearest_float64_with_nulls_masked(tmp_path):
    converter, b = convert(parquet(tmp_path, DECIMALS))
    assert b["price"].dtype == torch.float64
    assert b["price"].tolist() == [1.1, 0.0, -12345678.99, 0.07, 99999999.99]  # float(Decimal): the nearest double
    assert b["price_mask"].tolist() == [True, False, True, True, True]
    assert b["amount_mask"].tolist() == [True, True, False, True, True]
    for got, want in zip(b["amount"].tolist(), AMOUNTS):
        want = float(want or 0)  # beyond 2**53 the unscaled integer is not exact: within one ulp
        assert abs(got - want) <= math.ulp(want)
    assert converter.scales == {}


def test_decimals_below_2_pow_53_unscaled_are_the_nearest_double_every_time(tmp_path):
    rng = np.random.default_rng(0)
    values = [D(int(v)).scaleb(-6) for v in rng.integers(-(2**53), 2**53, 2000)]
    _, b = convert(parquet(tmp_path, {"d": pa.array(values, pa.decimal128(18, 6))}))
    assert b["d"].tolist() == [float(v) for v in values]


def test_decimals_as_scaled_int64_are_exact_with_the_scale_known(tmp_path):
    small = [D("1.5"), D("-0.00001"), None, D("42"), D("-92233720368547.75808")]  # the last is -2**63 / 10**5
    path = parquet(tmp_path, {"price": DECIMALS["price"], "amount": pa.array(small, pa.decimal256(40, 5))})
    converter, b = convert(path, decimals="scaled_int64")
    assert converter.scales == {"price": 2, "amount": 5}
    assert b["price"].dtype == torch.int64 and b["price"].tolist() == [110, 0, -1234567899, 7, 9999999999]
    assert b["amount"].tolist() == [150000, -1, 0, 4200000, -(2**63)]
    assert b["amount_mask"].tolist() == [True, True, False, True, True]


def test_a_decimal_beyond_int64_is_refused_naming_file_column_and_value(tmp_path):
    path = parquet(tmp_path, {"amount": DECIMALS["amount"]}, name="money.parquet")
    with pytest.raises(ss.ConversionError,
                       match=r"^column 'amount': decimal value 1234567890.* \(in the rows of .*money\.parquet row group 0\)"):
        list(ss.ParquetStream(path, decimals="scaled_int64"))
    with pytest.raises(ValueError, match="decimals"):
        BatchConverter(pq.read_schema(path), decimals="float32")


NESTED = [[[1, 2], [], [3]], [], None, [[4], None, [5, 6, 7]], [[]]]


@pytest.mark.parametrize("lists", ["padded", "flat"])
def test_nested_lists_become_values_end_to_end_with_lengths_per_level(tmp_path, lists):
    path = parquet(tmp_path, {"v": pa.array(NESTED, pa.list_(pa.list_(pa.int32())))})
    converter, b = convert(path, lists=lists)  # deeper lists are flat in both forms
    assert list(b) == converter.keys == ["v", "v_lengths", "v_lengths.1", "v_values_mask", "v_mask", "v_mask.1"]
    assert b["v"].dtype == torch.int32 and b["v"].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert b["v_lengths"].tolist() == [3, 0, 0, 3, 1]  # level-1 lists per row
    assert b["v_lengths.1"].tolist() == [2, 0, 1, 1, 0, 3, 0]  # values per level-1 list
    assert b["v_mask"].tolist() == [True, True, False, True, True]
    assert b["v_mask.1"].tolist() == [True, True, True, True, False, True, True]
    assert b["v_values_mask"].tolist() == [True] * 7
    assert converter.ragged_keys == {"v", "v_lengths.1", "v_values_mask", "v_mask.1"}


def test_every_list_kind_nests_at_any_depth(tmp_path):
    rows = [[[[1], [2, 3]], [[], [4]]], [], [[[5, 6], [7]]]]
    t = pa.large_list(pa.field("x", pa.list_(pa.field("y", pa.list_(pa.int64()), False), 2), False))
    _, b = convert(parquet(tmp_path, {"d": pa.array(rows, t)}))
    assert b["d"].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert b["d_lengths"].tolist() == [2, 0, 1]
    assert b["d_lengths.1"].tolist() == [2, 2, 2]  # fixed_size_list[2]
    assert b["d_lengths.2"].tolist() == [1, 2, 0, 1, 2, 1]
    assert "d_mask.1" not in b and "d_mask.2" not in b  # the schema rules those nulls out


RECORDS = [[{"a": 1, "b": 0.5}, {"a": 2, "b": None}], [], None, [None, {"a": 3, "b": 1.5}]]
RECORD = pa.list_(pa.struct([("a", pa.int64()), ("b", pa.float32())]))


def test_lists_of_structs_become_one_list_entry_per_field_sharing_the_lengths(tmp_path):
    path = parquet(tmp_path, {"p": pa.array(RECORDS, RECORD)})
    converter, b = convert(path)
    assert converter.keys == ["p.a", "p.b", "p_lengths", "p.a_values_mask", "p.b_values_mask", "p_mask"]
    assert b["p_lengths"].tolist() == [2, 0, 0, 2] and b["p_mask"].tolist() == [True, True, False, True]
    assert b["p.a"].tolist() == [[1, 2], [0, 0], [0, 0], [0, 3]]  # a null record reads as zeros
    assert b["p.a_values_mask"].tolist() == [[True, True], [False, False], [False, False], [False, True]]
    assert b["p.b"].dtype == torch.float32 and b["p.b"].tolist() == [[0.5, 0], [0, 0], [0, 0], [0, 1.5]]
    assert b["p.b_values_mask"].tolist() == [[True, False], [False, False], [False, False], [False, True]]
    _, flat = convert(path, lists="flat")
    assert flat["p.a"].tolist() == [1, 2, 0, 3] and flat["p.b_values_mask"].tolist() == [True, False, False, True]


def test_fields_of_listed_structs_that_are_lists_or_text_nest_one_level_deeper(tmp_path):
    t = pa.list_(pa.struct([("tags", pa.list_(pa.int32())), ("name", pa.string())]))
    rows = [[{"tags": [7], "name": "x"}, {"tags": [], "name": None}], [{"tags": [8, 9], "name": "y"}]]
    _, b = convert(parquet(tmp_path, {"p": pa.array(rows, t)}))
    assert b["p_lengths"].tolist() == [2, 1]
    assert b["p.tags"].tolist() == [7, 8, 9] and b["p.tags_lengths.1"].tolist() == [1, 0, 2]
    assert b["p.name"] == [["x", None], ["y"]]  # text stays Python, nested per list level


def test_maps_become_key_and_value_lists_sharing_the_lengths(tmp_path):
    rows = [[("a", 1), ("b", None)], [], None, [("c", 3)]]
    converter, b = convert(parquet(tmp_path, {"m": pa.array(rows, pa.map_(pa.string(), pa.int64()))}))
    assert converter.keys == ["m.key", "m.value", "m_lengths", "m.value_values_mask", "m_mask"]
    assert b["m.key"] == [["a", "b"], [], None, ["c"]]
    assert b["m.value"].tolist() == [[1, 0], [0, 0], [0, 0], [3, 0]]
    assert b["m.value_values_mask"].tolist() == [[True, False], [False, False], [False, False], [True, False]]
    assert b["m_lengths"].tolist() == [2, 0, 0, 1] and b["m_mask"].tolist() == [True, True, False, True]


def test_maps_of_numbers_become_two_tensors(tmp_path):
    rows = [[(1, 0.5), (2, 1.5)], [(3, -1.0)], []]
    _, b = convert(parquet(tmp_path, {"k": pa.array(rows, pa.map_(pa.int32(), pa.float64()))}), lists="flat")
    assert b["k.key"].dtype == torch.int32 and b["k.key"].tolist() == [1, 2, 3]
    assert b["k.value"].tolist() == [0.5, 1.5, -1.0] and b["k_lengths"].tolist() == [2, 1, 0]
    assert "k.key_values_mask" not in b  # map keys are never null


def test_null_elements_read_as_zero_with_a_values_mask_shaped_like_the_values(tmp_path):
    path = parquet(tmp_path, {
        "v": pa.array([[1, None, 3], [None], [], None], pa.list_(pa.int32())),
        "f": pa.array([[1, None], None, [3, 4], [5, 6]], pa.list_(pa.int32(), 2)),
    })
    _, b = convert(path)
    assert b["v"].tolist() == [[1, 0, 3], [0, 0, 0], [0, 0, 0], [0, 0, 0]] and b["v_lengths"].tolist() == [3, 1, 0, 0]
    assert b["v_values_mask"].tolist() == [[True, False, True], [False] * 3, [False] * 3, [False] * 3]
    assert b["v_mask"].tolist() == [True, True, True, False]
    assert b["f"].tolist() == [[1, 0], [0, 0], [3, 4], [5, 6]]
    assert b["f_values_mask"].tolist() == [[True, False], [False, False], [True, True], [True, True]]
    _, flat = convert(path, lists="flat")
    assert flat["v"].tolist() == [1, 0, 3, 0] and flat["v_values_mask"].tolist() == [True, False, True, False]


def test_the_schema_alone_decides_which_lists_get_a_values_mask(tmp_path):
    required = pa.list_(pa.field("item", pa.int32(), nullable=False))
    path = parquet(tmp_path, {
        "dense": pa.array([[1, 2], [3]], required),
        "clean": pa.array([[1, 2], [3]], pa.list_(pa.int32())),  # nullable items, none null
    })
    _, b = convert(path)
    assert "dense_values_mask" not in b
    assert b["clean_values_mask"].tolist() == [[True, True], [True, False]]


def test_batch_keys_do_not_depend_on_where_the_nulls_are(tmp_path):
    rows = [[1, 2], [3], [4, None], [], [5], [6, 7], [None], [8]]
    path = parquet(tmp_path, {"v": pa.array(rows, pa.list_(pa.int32())),
                              "n": pa.array([[[i]] if i % 3 else None for i in range(8)], pa.list_(pa.list_(pa.int64())))},
                   row_group_size=3)
    ds, batches = loader_batches(path)
    assert len({tuple(b) for b in batches}) == 1
    assert set(batches[0]) == set(ds.converter.keys) | {"sample_id"}


@pytest.mark.parametrize("lists", ["padded", "flat"])
def test_padding_rows_have_length_zero_and_add_no_values(tmp_path, lists):
    path = parquet(tmp_path, {"v": pa.array(NESTED, pa.list_(pa.list_(pa.int32()))),
                              "p": pa.array(RECORDS + [[]], RECORD),
                              "x": pa.array([[1], [2, None], [], None, [3, 4, 5]], pa.list_(pa.int32()))})
    converter, b = convert(path, lists=lists)
    padded = concat(b, padding_like(b, 2, converter.ragged_keys))
    assert list(padded) == list(b)
    for key in converter.ragged_keys:
        assert torch.equal(padded[key], b[key])  # end to end: padding adds nothing
    for key in ["v_lengths", "p_lengths", "x_lengths"]:
        assert padded[key].tolist() == b[key].tolist() + [0, 0]
    for key in ["v_mask", "p_mask", "x_mask"]:
        assert padded[key].tolist() == b[key].tolist() + [False, False]
    if lists == "padded":
        assert padded["x"].shape == (7, 3) and not padded["x"][5:].any() and not padded["x_values_mask"][5:].any()
        assert padded["p.a"].shape == (7, 2)


SHAPES = {
    "decimals": DECIMALS,
    "nested lists": {"v": pa.array(NESTED, pa.list_(pa.list_(pa.int32())))},
    "list of structs": {"p": pa.array(RECORDS + [[{"a": 4, "b": 2.5}]], RECORD)},
    "map<string, int64>": {"m": pa.array([[("a", 1)], [], None, [("b", 2), ("c", None)], [("d", 4)]],
                                          pa.map_(pa.string(), pa.int64()))},
    "map<int32, float64>": {"k": pa.array([[(1, 0.5)], [], [(2, 1.5), (3, 2.5)], None, [(4, 0.0)]],
                                           pa.map_(pa.int32(), pa.float64()))},
    "null elements": {"v": pa.array([[1, None], [None], [], None, [2, 3, None]], pa.list_(pa.int32()))},
}


def _joined(parts):
    out = parts[0]
    for part in parts[1:]:
        out = concat(out, part)
    return out


@pytest.mark.parametrize("lists", ["padded", "flat"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_shape_streams_through_a_dataloader_with_padding(tmp_path, shape, lists):
    path = parquet(tmp_path, SHAPES[shape], row_group_size=3)
    ds, batches = loader_batches(path, lists=lists)
    assert len(batches) == 2 and (batches[-1]["sample_id"] < 0).sum() == 3  # 5 rows in batches of 4
    reference = ds.converter(pq.read_table(path))  # the whole file in one batch
    ragged = ds.converter.ragged_keys
    for batch in batches:
        assert list(batch) == ds.converter.keys + ["sample_id"]
    real = [b["sample_id"] >= 0 for b in batches]
    for key, want in reference.items():
        if key in ragged:
            got = torch.cat([b[key] for b in batches])
        elif isinstance(want, torch.Tensor):
            got = _joined([{key: b[key][keep]} for b, keep in zip(batches, real)])[key]
            assert not batches[-1][key][~real[-1]].any()  # padding rows: zeros, False, length 0
        else:
            got = [x for b, keep in zip(batches, real) for x, k in zip(b[key], keep.tolist()) if k]
            assert all(x is None for x, k in zip(batches[-1][key], real[-1].tolist()) if not k)
        assert got.tolist() == want.tolist() if isinstance(want, torch.Tensor) else got == want, key


@pytest.mark.parametrize("shape", list(SHAPES))
def test_joining_two_batches_equals_converting_their_rows_together(tmp_path, shape):
    table = pq.read_table(parquet(tmp_path, SHAPES[shape]))
    converter = BatchConverter(table.schema, inner_nulls="mask")
    for cut in range(table.num_rows + 1):
        joined = concat(converter(table.slice(0, cut)), converter(table.slice(cut)))
        for key, want in converter(table).items():
            got = joined[key]
            assert (got.tolist() == want.tolist()) if isinstance(want, torch.Tensor) else got == want, (cut, key)


@pytest.mark.parametrize(
    "array, cause",
    [
        (pa.array([[], [None]], pa.list_(pa.null())), "type null holds no values"),
        (pa.array([None, None], pa.null()), "type null holds no values"),
        (pa.array([[("k", None)], []], pa.map_(pa.string(), pa.null())), "type null holds no values .in 'bad.value'"),
    ],
)
def test_types_without_tensor_meaning_are_refused_naming_file_column_and_cause(tmp_path, array, cause):
    pq.write_table(pa.table({"ok": [1, 2], "bad": array}), tmp_path / "odd.parquet")
    ds = ss.ParquetStream(str(tmp_path), rank=0, world_size=1)
    with pytest.raises(ss.ConversionError, match=rf"odd\.parquet: column 'bad' of type .* has no tensor conversion: {cause}"):
        ds.set_epoch(0)
    assert read_all(tmp_path, columns=["ok"])["ok"].tolist() == [1, 2]  # projecting it out works


@pytest.mark.parametrize(
    "t, cause",
    [
        (pa.dense_union([pa.field("i", pa.int32()), pa.field("s", pa.string())]), "a union"),
        (pa.month_day_nano_interval(), r"month_day_nano_interval \(months, days and nanoseconds\) has no exact"),
        (pa.list_(pa.struct([("u", pa.sparse_union([pa.field("i", pa.int8())]))])), r"a union .* \(in 'c.u'\)"),
    ],
)
def test_arrow_only_types_without_tensor_meaning_are_refused_when_planning(t, cause):
    with pytest.raises(ss.ConversionError, match=rf"^w\.parquet: column 'c' of type .*: {cause}"):
        BatchConverter(pa.schema([("c", t)]), source="w.parquet")


def test_uint64_beyond_int64_is_refused_naming_file_and_column(tmp_path):
    pq.write_table(pa.table({"u": pa.array([1, 2**64 - 1], pa.uint64())}), tmp_path / "u.parquet")
    with pytest.raises(ss.ConversionError, match=r"^column 'u': uint64 value 18446744073709551615.*\(in the rows of .*u\.parquet row group 0\)"):
        read_all(tmp_path)


def test_generated_keys_that_collide_with_a_column_are_refused():
    schema = pa.schema([("v", pa.list_(pa.int32())), ("v_lengths", pa.int64())])
    with pytest.raises(ss.ConversionError, match="'v_lengths'.*also the name of another entry"):
        BatchConverter(schema, source="c.parquet")


def test_by_default_list_elements_get_no_mask_and_a_null_element_names_the_column(tmp_path):
    """pyarrow marks list elements nullable: a mask per token by default would cost every batch a bool per value."""
    clean = parquet(tmp_path, {"ids": pa.array([[1, 2], [], [3]], pa.list_(pa.int32()))}, name="clean.parquet")
    batch = next(iter(ss.ParquetStream(clean, batch_size=None, rank=0, world_size=1)))
    assert "ids_values_mask" not in batch and batch["ids"].tolist() == [[1, 2], [0, 0], [3, 0]]
    holes = parquet(tmp_path, {"ids": pa.array([[1, None], [3]], pa.list_(pa.int32()))}, name="holes.parquet")
    with pytest.raises(ss.ConversionError, match=r"column 'ids': null values inside lists; pass inner_nulls='mask'.*\(in the rows of .*holes\.parquet row group 0\)"):
        list(ss.ParquetStream(holes, batch_size=None, rank=0, world_size=1))
    masked = next(iter(ss.ParquetStream(holes, batch_size=None, inner_nulls="mask", rank=0, world_size=1)))
    assert masked["ids_values_mask"].tolist() == [[True, False], [True, False]]
    with pytest.raises(ValueError, match="inner_nulls"):
        ss.ParquetStream(holes, inner_nulls="drop")
