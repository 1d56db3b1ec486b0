"""The per-read work a pass repeats: what the process already did once is not done again per pass.

Counted, not timed: a later pass (a new ``RowGroupReader``, as every pass and thread worker makes)
must not walk a footer this process already parsed.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

import streamshard.io.fetch as fetch
from streamshard.io.catalog import Catalog
from streamshard.io.reader import RowGroupReader


def write_files(directory, files: int = 3, groups: int = 2, rows: int = 50) -> None:
    directory.mkdir()
    for f in range(files):
        table = pa.table({"id": pa.array(range(f * groups * rows, (f + 1) * groups * rows), pa.int64()),
                          "tokens": pa.array([[i, i + 1] for i in range(groups * rows)], pa.list_(pa.int32()))})
        pq.write_table(table, directory / f"part-{f}.parquet", row_group_size=rows)


def read_pass(catalog) -> list[int]:
    reader = RowGroupReader.from_catalog(catalog)
    try:
        return [i for f, g in zip(catalog.rg_file.tolist(), catalog.rg_index.tolist())
                for i in reader.read(f, g).column("id").to_pylist()]
    finally:
        reader.close()


def test_a_footer_is_parsed_once_per_process_not_once_per_pass(tmp_path, monkeypatch):
    write_files(tmp_path / "data")
    catalog = Catalog.build(str(tmp_path / "data"))
    fetch.PARSED_FOOTERS.clear()
    walks = []
    real = fetch.parse_footer
    monkeypatch.setattr(fetch, "parse_footer", lambda *a, **k: walks.append(a[1]) or real(*a, **k))
    first = read_pass(catalog)
    assert len(walks) == 3  # one per file, in the first pass
    assert read_pass(catalog) == first == list(range(300))
    assert len(walks) == 3  # the second pass walked none


def test_a_loop_that_writes_into_its_batches_changes_no_later_batch(tmp_path):
    # Padded batches as wide as their block are views of the block's rows (no copy): they must not
    # overlap, so a loop masking tokens in place leaves every other batch as it was. A guard: the
    # copies of before passed it too.
    import torch

    import streamshard as ss
    from streamshard.testing import write_corpus

    write_corpus(str(tmp_path), [[700, 300], [500]], 3, 30, seed=5, tokens="random")
    for kwargs in ({}, {"shuffle": True}, {"lists": "flat"}):
        want = [{k: v.clone() for k, v in b.items()} for b in ss.ParquetStream(str(tmp_path), batch_size=64, **kwargs)]
        got = []
        for batch in ss.ParquetStream(str(tmp_path), batch_size=64, **kwargs):
            got.append({k: v.clone() for k, v in batch.items()})
            for value in batch.values():
                value.fill_(-7)  # what a loop may do to the batch it holds
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
