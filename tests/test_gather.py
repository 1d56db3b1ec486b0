"""Batches gathered from reads converted once equal the batches of converting each batch's rows."""

from __future__ import annotations

import datetime as dt
import decimal

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streamshard.convert.gather as gather_module
from streamshard.plan.batch_plan import BatchSpec, Read
from streamshard.streams.delivery import build
from streamshard.convert.gather import Gatherer, convert_read, gatherable
from streamshard.convert.tensors import BatchConverter

ROWS = 12
_rng = np.random.default_rng(5)


def _lists(rng, nulls=True, inner=False):
    out = []
    for i in range(ROWS):
        if nulls and i % 5 == 3:
            out.append(None)
            continue
        row = [int(v) for v in rng.integers(0, 100, int(rng.integers(0, 6)))]
        out.append([None if inner and j % 3 == 1 else v for j, v in enumerate(row)])
    return out


# One table per shape: each a column kind real writers produce (nulls included).
TABLES = {
    "numbers": pa.table({
        "i": pa.array([None if i % 4 == 0 else i for i in range(ROWS)], pa.int64()),
        "f": pa.array([i / 3 for i in range(ROWS)], pa.float32()),
        "b": pa.array([i % 2 == 0 for i in range(ROWS)]),
        "t": pa.array([dt.datetime(2024, 1, 1 + i) for i in range(ROWS)], pa.timestamp("ms")),
        "d": pa.array([decimal.Decimal(f"{i}.25") for i in range(ROWS)], pa.decimal128(9, 2)),
    }),
    "tokens": pa.table({
        "input_ids": pa.array(_lists(_rng, nulls=False), pa.list_(pa.field("item", pa.int32(), nullable=False))),
        "score": pa.array(np.arange(ROWS, dtype=np.float64)),
    }),
    "nullable lists with null elements": pa.table({"v": pa.array(_lists(_rng, inner=True), pa.list_(pa.int16()))}),
    "text": pa.table({
        "s": pa.array([None if i == 2 else f"row {i}" for i in range(ROWS)]),
        "tags": pa.array([[f"t{i}"] * (i % 3) for i in range(ROWS)], pa.list_(pa.string())),
    }),
    "fixed lists": pa.table({"e": pa.array([[i, i + 1, i + 2] for i in range(ROWS)], pa.list_(pa.float32(), 3))}),
    "structs and lists of structs": pa.table({
        "s": pa.array([{"x": i, "y": None if i % 3 else float(i)} for i in range(ROWS)]),
        "p": pa.array([[{"a": i, "b": 0.5}] * (i % 4) for i in range(ROWS)],
                      pa.list_(pa.struct([("a", pa.int32()), ("b", pa.float64())]))),
    }),
    "maps": pa.table({"m": pa.array([[(f"k{i}", i)] * (i % 3) if i % 5 else None for i in range(ROWS)],
                                    pa.map_(pa.string(), pa.int64()))}),
    "large lists": pa.table({"w": pa.array(_lists(_rng), pa.large_list(pa.int64()))}),
    "list of structs with null fields": pa.table({
        "q": pa.array([[{"a": j, "b": None if j % 2 else 1.5} for j in range(i % 4)] for i in range(ROWS)],
                      pa.list_(pa.struct([("a", pa.int32()), ("b", pa.float64())]))),
    }),
}


def _check_same(got, want):
    assert list(got) == list(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


@st.composite
def batches(draw):
    """A table cut into reads (some holding only part of their rows), and a batch drawing rows
    from them in any order, then padding."""
    name = draw(st.sampled_from(sorted(TABLES)))
    table = TABLES[name]
    cuts = sorted(draw(st.sets(st.integers(1, ROWS - 1), max_size=3)))
    bounds = list(zip([0] + cuts, cuts + [ROWS]))
    reads, tables, owned = {}, {}, {}
    for key, (a, b) in enumerate(bounds):
        rows = np.arange(b - a)
        if draw(st.booleans()) and len(rows) > 1:  # this worker owns only some of the group's rows
            keep = draw(st.sets(st.sampled_from(rows.tolist()), min_size=1))
            rows = np.array(sorted(keep))
            reads[key] = Read(0, key, rows=rows)
            tables[key] = table.slice(a, b - a).take(pa.array(rows))
        else:
            reads[key] = Read(0, key)
            tables[key] = table.slice(a, b - a)
        owned[key] = rows
    pairs = [(k, int(r)) for k, rows in owned.items() for r in rows]
    specs = []
    for index in range(draw(st.integers(1, 4))):  # batch after batch of one pass, sharing the reads
        chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=len(pairs)))
        if draw(st.booleans()):
            chosen.sort()  # no shuffle: each read's rows in order, reads one after the other
        padding = draw(st.integers(0, 3))
        read = np.array([k for k, _ in chosen], dtype=np.int64)
        row = np.array([r for _, r in chosen], dtype=np.int64)
        used = list(dict.fromkeys(read.tolist())) or [0]
        specs.append(BatchSpec(index, {k: reads[k] for k in used}, read, row,
                               np.arange(len(chosen), dtype=np.int64) * 7, padding))
    return name, specs, tables


# How list items are copied: (_SLICE_ROWS_FROM, _JOIN_BYTES, _PAD_GROWTH). A slice per row; one
# element gather (runs) and, in shuffle windows, whole rows of the window padded once (padded) or
# from the window's items joined once (flat); the same with padded cells gathered from the joined
# items (no padding once); the same with no room to join.
ITEM_PATHS = [(0, 64 << 20, 2.5), (10**9, 64 << 20, 10**9), (10**9, 64 << 20, 0), (10**9, 0, 2.5)]


@pytest.mark.parametrize("item_path", ITEM_PATHS, ids=["slices", "gather-padded-window", "gather-joined", "gather-no-room"])
@pytest.mark.parametrize("lists", ["padded", "flat"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=batches())
def test_gathered_batches_equal_converting_their_rows(lists, item_path, case):
    name, specs, tables = case
    converter = BatchConverter(TABLES[name].schema, lists=lists, inner_nulls="mask")
    assert gatherable(converter)
    gatherer = Gatherer(converter)
    parts = {k: convert_read(t, converter) for k, t in tables.items()}
    with pytest.MonkeyPatch.context() as patch:  # per example (a fixture would span them all)
        patch.setattr(gather_module, "_SLICE_ROWS_FROM", item_path[0])
        patch.setattr(gather_module, "_JOIN_BYTES", item_path[1])
        patch.setattr(gather_module, "_PAD_GROWTH", item_path[2])
        for spec in specs:  # batch after batch of one pass, one window after another
            want = build(spec, {k: tables[k] for k in spec.reads}, converter)
            _check_same(gatherer.build(spec, {k: parts[k] for k in spec.reads}), want)


def test_a_window_moves_on_when_a_batch_reaches_into_the_next_one():
    table = TABLES["tokens"]
    converter = BatchConverter(table.schema)
    tables = {k: table.slice(3 * k, 3) for k in range(4)}
    parts = {k: convert_read(t, converter) for k, t in tables.items()}
    gatherer = Gatherer(converter)
    for index, keys in enumerate([(0, 1), (0, 1), (1, 2), (2, 3), (3, 2)]):  # interleaved rows
        read = np.array([keys[0], keys[1], keys[0], keys[1]], dtype=np.int64)
        row = np.array([0, 2, 1, 0], dtype=np.int64)
        spec = BatchSpec(index, {k: Read(0, k) for k in keys}, read, row, np.arange(4), 1)
        _check_same(gatherer.build(spec, {k: parts[k] for k in keys}), build(spec, {k: tables[k] for k in keys}, converter))


def test_a_batch_never_shares_memory_with_the_rows_held_for_later_batches():
    table = TABLES["tokens"]
    for lists in ("padded", "flat"):
        converter = BatchConverter(table.schema, lists=lists)
        part = convert_read(table, converter)
        spec = BatchSpec(0, {0: Read(0, 0)}, np.zeros(4, dtype=np.int64), np.arange(4), np.arange(4), 0)
        gatherer = Gatherer(converter)
        first = gatherer.build(spec, {0: part})
        for value in first.values():
            value.fill_(-1)  # a training loop writing into its batch
        again = gatherer.build(spec, {0: part})
        _check_same(again, build(spec, {0: table}, converter))


def test_lists_of_lists_keep_the_whole_batch_conversion():
    nested = pa.schema([("v", pa.list_(pa.list_(pa.int32())))])
    assert not gatherable(BatchConverter(nested))
    assert gatherable(BatchConverter(TABLES["maps"].schema))
