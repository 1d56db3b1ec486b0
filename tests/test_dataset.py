"""ParquetStream through a real DataLoader on local disk: the invariants, end to end."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import streamshard as ss
from streamshard.testing import write_corpus
from helpers import assert_equal_steps, assert_exactly_once, assert_rows_match_ids, ids_of, run_epoch

NUM_ROWS_SKEWED = 900 + 700 + 1100 + 36 + 5 + 291


@pytest.mark.parametrize("num_workers", [0, 1, 3])
@pytest.mark.parametrize(
    "world_size, unit, batch_size, shuffle",
    [(1, "row_group", None, False), (2, "file", 64, True), (3, "row_group", 100, True), (4, "file", None, True)],
)
def test_every_row_once_and_equal_steps_across_ranks_and_workers(
    skewed_corpus, num_workers, world_size, unit, batch_size, shuffle
):
    def make(rank, world):
        return ss.ParquetStream(
            skewed_corpus, batch_size=batch_size, unit=unit, shuffle=shuffle, seed=7, rank=rank, world_size=world
        )

    per_rank = run_epoch(make, world_size, num_workers, epoch=1)
    assert_exactly_once(per_rank, NUM_ROWS_SKEWED)
    assert_equal_steps(per_rank)
    assert_rows_match_ids(per_rank)
    if batch_size is not None:
        assert all(len(b["sample_id"]) == batch_size for batches in per_rank for b in batches)


def test_drop_truncates_to_the_smallest_worker_and_reports_what_it_dropped(skewed_corpus):
    make = lambda r, w: ss.ParquetStream(skewed_corpus, batch_size=64, uneven="drop", rank=r, world_size=w)  # noqa: E731
    per_rank = run_epoch(make, 3, 2)
    assert_equal_steps(per_rank)
    ids = np.concatenate([ids_of(b) for b in per_rank])
    assert (ids >= 0).all() and len(np.unique(ids)) == len(ids)
    summary = make(0, 3).epoch_summary(num_workers=2)
    assert summary["dropped_rows"] == NUM_ROWS_SKEWED - len(ids) > 0
    assert summary["padding_batches"] == 0


def test_more_workers_than_rows_pads_with_real_shapes(tmp_path):
    write_corpus(str(tmp_path), [[3], [2]])
    make = lambda r, w: ss.ParquetStream(str(tmp_path), batch_size=4, rank=r, world_size=w)  # noqa: E731
    per_rank = run_epoch(make, 4, 2)
    assert_exactly_once(per_rank, 5)
    assert_equal_steps(per_rank)
    for batches in per_rank:
        for b in batches:
            assert b["input_ids"].dim() == 2 and len(b["sample_id"]) == 4
            assert torch.all(b["id"][b["sample_id"] < 0] == 0)


def test_same_seed_and_epoch_give_byte_identical_batches(skewed_corpus):
    def epoch(seed, e):
        ds = ss.ParquetStream(skewed_corpus, batch_size=50, shuffle=True, seed=seed, rank=1, world_size=2)
        ds.set_epoch(e)
        return list(DataLoader(ds, batch_size=None, num_workers=2))

    first, again = epoch(3, 2), epoch(3, 2)
    assert len(first) == len(again)
    for a, b in zip(first, again):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
    assert not torch.equal(ids_of_tensor(first), ids_of_tensor(epoch(3, 3)))
    assert not torch.equal(ids_of_tensor(first), ids_of_tensor(epoch(4, 2)))


def ids_of_tensor(batches):
    return torch.cat([b["sample_id"] for b in batches])


def test_set_epoch_reaches_persistent_workers(skewed_corpus):
    ds = ss.ParquetStream(skewed_corpus, batch_size=32, shuffle=True, rank=0, world_size=1)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    seen = []
    for e in range(2):
        ds.set_epoch(e)
        seen.append(ids_of_tensor(list(loader)))
    fresh = ss.ParquetStream(skewed_corpus, batch_size=32, shuffle=True, rank=0, world_size=1)
    fresh.set_epoch(1)
    assert torch.equal(seen[1], ids_of_tensor(list(DataLoader(fresh, batch_size=None, num_workers=2))))
    assert not torch.equal(seen[0], seen[1])


def test_unshuffled_single_worker_reads_in_catalog_order(small_corpus):
    ids = ids_of_tensor(list(ss.ParquetStream(small_corpus, rank=0, world_size=1)))
    real = ids[ids >= 0]
    assert torch.equal(real, torch.arange(len(real))) and torch.all(ids[len(real):] == -1)


@pytest.mark.parametrize("world, workers", [(1, 0), (2, 2), (3, 1)])
def test_default_batches_are_uniform_and_pad_at_most_one_batch_per_worker(skewed_corpus, world, workers):
    """A huge file next to many tiny ones, 1-row row groups, empty files: every batch holds the same rows."""
    per_rank = []
    for rank in range(world):
        ds = ss.ParquetStream(skewed_corpus, rank=rank, world_size=world)
        ds.set_epoch(0)
        per_rank.append(list(DataLoader(ds, batch_size=None, num_workers=workers)))
    sizes = {len(b["sample_id"]) for batches in per_rank for b in batches}
    assert sizes == {256}, f"batch sizes {sizes}"
    padding = sum(int((b["sample_id"] < 0).sum()) for batches in per_rank for b in batches)
    assert padding <= 256 * world * max(workers, 1), "more than one batch of padding per global worker"
    assert_exactly_once(per_rank, ss.ParquetStream(skewed_corpus).catalog.num_rows)


def test_row_group_sized_batches_warn_when_they_pad_more_than_a_tenth(skewed_corpus, small_corpus):
    with pytest.warns(UserWarning, match=r"steps this epoch are padding"):
        list(ss.ParquetStream(skewed_corpus, batch_size=None, rank=0, world_size=4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(ss.ParquetStream(small_corpus, rank=0, world_size=4))  # the default pads little: no warning


def test_shuffle_mixes_row_groups_by_default(tmp_path):
    write_corpus(str(tmp_path), [[100] * 4] * 8)  # 32 row groups of 100 rows
    batches = list(ss.ParquetStream(str(tmp_path), batch_size=64, shuffle=True, rank=0, world_size=1))
    groups = [len(set((b["sample_id"][b["sample_id"] >= 0] // 100).tolist())) for b in batches[:-1]]
    assert min(groups) >= 8, f"a default shuffle draws each batch from many row groups, got {groups}"
    one_at_a_time = ss.ParquetStream(str(tmp_path), batch_size=64, shuffle=True, shuffle_window=1, rank=0, world_size=1)
    assert max(len(set((b["sample_id"] // 100).tolist()) - {-1}) for b in one_at_a_time) <= 2


def test_transform_runs_in_the_worker_on_every_batch(small_corpus):
    ds = ss.ParquetStream(small_corpus, batch_size=16, transform=lambda b: {**b, "double": b["id"] * 2}, rank=0, world_size=1)
    ds.set_epoch(0)
    batches = list(DataLoader(ds, batch_size=None, num_workers=1))
    assert all(torch.equal(b["double"], b["id"] * 2) for b in batches)


def test_column_projection_reads_only_those_columns(small_corpus):
    batch = next(iter(ss.ParquetStream(small_corpus, columns=["score", "id"], rank=0, world_size=1)))
    assert set(batch) == {"score", "id", "sample_id"}
    assert batch["score"].dtype == torch.float32


def test_dataset_pickles_cheaply_before_and_after_the_catalog(skewed_corpus):
    ds = ss.ParquetStream(skewed_corpus, rank=0, world_size=1)
    assert len(pickle.dumps(ds)) < 4_000
    ds.catalog  # footers read, still no open handles
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.catalog.num_rows == NUM_ROWS_SKEWED
    assert len(pickle.dumps(ds)) < 20_000


def test_rank_and_world_size_default_to_the_environment(monkeypatch, small_corpus):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "5")
    ds = ss.ParquetStream(small_corpus)
    assert (ds.rank, ds.world_size) == (2, 5)
    explicit = ss.ParquetStream(small_corpus, rank=0, world_size=1)
    assert (explicit.rank, explicit.world_size) == (0, 1)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK"):
        ss.ParquetStream(small_corpus)


def test_steps_per_epoch_matches_what_the_loader_yields(skewed_corpus):
    ds = ss.ParquetStream(skewed_corpus, batch_size=40, rank=1, world_size=3)
    assert ds.steps_per_epoch(num_workers=2) == len(list(DataLoader(ds, batch_size=None, num_workers=2)))


def test_workers_whose_parent_read_no_catalog_share_one_snapshot(small_corpus):
    """No set_epoch: the first worker builds the catalog and publishes it, the others load it
    (catalog_share.py; tests/test_plain_dataloader.py covers the start methods and the races)."""
    ds = ss.ParquetStream(small_corpus, rank=0, world_size=1)
    batches = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert_exactly_once([batches], 229)  # conftest small_corpus
    assert len(batches) == ds.steps_per_epoch(num_workers=2)


def test_spawned_workers_receive_a_working_copy(small_corpus):
    ds = ss.ParquetStream(small_corpus, batch_size=20, rank=0, world_size=1)
    ds.catalog  # built in the parent, shipped to the child by pickling
    loader = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    assert_exactly_once([list(loader)], ds.catalog.num_rows)


@pytest.mark.parametrize("kwargs", [{}, {"shuffle": True}, {"shuffle": True, "unit": "file"}, {"shuffle": True, "shuffle_window": 3}])
def test_delivered_rows_match_the_pure_simulation(skewed_corpus, kwargs):
    ds = ss.ParquetStream(skewed_corpus, batch_size=None, rank=1, world_size=2, seed=4, **kwargs)
    ds.set_epoch(3)
    for loader_worker in (0, 1):
        expected = ds.schedule(loader_worker, num_workers=2).sample_ids()
        got = ids_of(list(DataLoader(ds, batch_size=None, num_workers=2))[loader_worker::2])
        np.testing.assert_array_equal(got[got >= 0], expected)


def test_an_unpicklable_transform_is_warned_about(small_corpus):
    ds = ss.ParquetStream(small_corpus, transform=lambda b: b, rank=0, world_size=1)
    with pytest.warns(UserWarning, match="cannot be pickled"):
        ds.set_epoch(0)


def test_more_workers_than_row_groups_is_warned_about(tmp_path):
    write_corpus(str(tmp_path), [[50], [50]])
    ds = ss.ParquetStream(str(tmp_path), rank=0, world_size=3)
    ds.set_epoch(0)
    with pytest.warns(UserWarning, match="3 global workers share 2 non-empty row groups"):
        list(ds)


def test_a_dataset_built_before_init_process_group_follows_the_process_group(small_corpus, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "1")  # a stale environment: the real process group will say rank 0 of 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    early = ss.ParquetStream(small_corpus)
    explicit = ss.ParquetStream(small_corpus, rank=1, world_size=2)
    assert early.topology == (1, 2)  # what is known before the group exists
    copied = pickle.dumps(early)  # pickled before any group (ddp_spawn's launcher): resolves where it runs
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            early.set_epoch(0)
            explicit.set_epoch(0)
        assert early.topology == (0, 1), "the process group's rank, not the one read before it existed"
        assert explicit.topology == (1, 2), "explicit arguments win"
        assert pickle.loads(copied).topology == (0, 1)
        pinned = pickle.dumps(early)  # a spawned DataLoader worker's copy: it has no process group
    finally:
        dist.destroy_process_group()
    assert pickle.loads(pinned).topology == (0, 1), "the group's rank travels with the copy"
    assert pickle.loads(copied).topology == (1, 2) == early.topology  # no group: the environment again


def _free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_second_pass_over_a_shuffled_epoch_without_set_epoch_is_warned_about_once(small_corpus):
    ds = ss.ParquetStream(small_corpus, shuffle=True, rank=0, world_size=1)
    ds.set_epoch(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = ids_of(list(DataLoader(ds, batch_size=None, num_workers=2)))
    with pytest.warns(UserWarning, match="same order as the last one"):
        again = ids_of(list(DataLoader(ds, batch_size=None, num_workers=0)))
    assert np.array_equal(np.sort(first[first >= 0]), np.sort(again[again >= 0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(ds)  # once is enough
        ds.set_epoch(1)
        list(ds)
        loader = ss.StreamLoader(ss.ParquetStream(small_corpus, shuffle=True, rank=0, world_size=1))
        list(loader), list(loader)  # the loader moves to the next epoch itself: no warning


def test_a_setup_warning_is_one_message_not_a_warning_and_a_log_line(small_corpus, caplog):
    ds = ss.ParquetStream(small_corpus, rank=0, world_size=8)
    with pytest.warns(UserWarning, match="global workers share") as caught:
        list(ds)  # in this process, where the warning can be caught
    assert len([w for w in caught if "global workers share" in str(w.message)]) == 1
    assert not [r for r in caplog.records if "global workers share" in r.getMessage()]
