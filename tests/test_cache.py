"""ActivationCache: exact values or a miss, never garbage; bounded tiers; restart, key and crash safety."""

from __future__ import annotations

import copy
import errno
import logging
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamshard.cache import (
    ActivationCache,
    CacheError,
    CacheLockedError,
    CacheWarning,
    RecordSpecError,
    module_fingerprint,
)
from streamshard.cache.index import IdIndex as _IdIndex

DIM = 16  # float32 records of 64 bytes: a multiple of 8, so every byte of a disk slot is checked


def rows_for(ids: torch.Tensor | np.ndarray, dim: int = DIM) -> torch.Tensor:
    """Deterministic per-id values, so any process can recompute the expected rows."""
    ids = torch.as_tensor(np.asarray(ids), dtype=torch.int64)
    return ids[:, None].to(torch.float32) * 1000.0 + torch.arange(dim, dtype=torch.float32)


def fill(cache: ActivationCache, ids) -> None:
    ids = torch.as_tensor(ids, dtype=torch.int64)
    cache.put(ids, rows_for(ids))


def assert_exact_or_miss(cache: ActivationCache, ids) -> torch.Tensor:
    """Every hit is the exact value, every miss row is zeros; returns the hit mask."""
    ids = torch.as_tensor(ids, dtype=torch.int64)
    values, hit = cache.get(ids)
    if values is None:
        assert not hit.any()
        return hit
    assert torch.equal(values[hit], rows_for(ids[hit]))
    assert not values[~hit].any()
    return hit


RECORD_BYTES = DIM * 4


# -- host tier and the batch API ----------------------------------------------------------------
def test_get_before_any_put_returns_no_values_and_all_misses():
    cache = ActivationCache()
    values, hit = cache.get(torch.tensor([0, 1, -1]))
    assert values is None and hit.tolist() == [False, False, False]
    assert cache.stats.misses == 2 and cache.stats.padding == 1


def test_put_then_get_returns_exact_rows_and_zero_filled_misses():
    cache = ActivationCache(host_bytes=1 << 20)
    fill(cache, range(0, 100, 2))
    hit = assert_exact_or_miss(cache, torch.arange(100))
    assert hit.tolist() == [i % 2 == 0 for i in range(100)]


def test_padding_rows_are_never_stored_and_always_miss():
    cache = ActivationCache()
    ids = torch.tensor([-1, 3, -1, 4])
    cache.put(ids, rows_for(torch.tensor([0, 3, 0, 4])))
    values, hit = cache.get(ids)
    assert hit.tolist() == [False, True, False, True]
    assert cache.stats.host_records == 2 and cache.stats.padding == 2


def test_get_or_compute_calls_fn_only_with_miss_positions_and_keeps_batch_order():
    cache = ActivationCache()
    calls: list[list[int]] = []

    def compute(ids: torch.Tensor):
        def fn(pos: torch.Tensor) -> torch.Tensor:
            calls.append(pos.tolist())
            return rows_for(ids[pos])
        return fn

    first = torch.tensor([5, 1, -1, 9])
    assert torch.equal(cache.get_or_compute(first, compute(first))[[0, 1, 3]], rows_for(first[[0, 1, 3]]))
    second = torch.tensor([9, 7, -1, 5, 1])
    out = cache.get_or_compute(second, compute(second))
    assert calls == [[0, 1, 2, 3], [1, 2]]  # padding is recomputed, hits are not
    assert torch.equal(out[[0, 1, 3, 4]], rows_for(second[[0, 1, 3, 4]]))
    third = torch.tensor([1, 5, 9, 7])
    assert torch.equal(cache.get_or_compute(third, compute(third)), rows_for(third))
    assert len(calls) == 2  # all hits: fn not called


def test_get_or_compute_rejects_fn_returning_wrong_row_count():
    cache = ActivationCache()
    with pytest.raises(CacheError, match="one row per miss"):
        cache.get_or_compute(torch.tensor([1, 2]), lambda pos: torch.zeros(3, DIM))


def test_record_shape_and_dtype_are_fixed_by_first_put():
    cache = ActivationCache()
    fill(cache, [1])
    assert cache.record_shape == (DIM,) and cache.record_dtype == torch.float32
    with pytest.raises(RecordSpecError, match="shape"):
        cache.put(torch.tensor([2]), torch.zeros(1, DIM + 1))
    with pytest.raises(RecordSpecError, match="float64"):
        cache.put(torch.tensor([2]), torch.zeros(1, DIM, dtype=torch.float64))
    with pytest.raises(ValueError, match="one row per sample id"):
        cache.put(torch.tensor([2, 3]), torch.zeros(1, DIM))


def test_bad_arguments_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="host_bytes"):
        ActivationCache(host_bytes=-1)
    with pytest.raises(ValueError, match="key is required"):
        ActivationCache(tmp_path)
    with pytest.raises(TypeError, match="key"):
        ActivationCache(tmp_path, key=3)
    with pytest.raises(ValueError, match="sample_ids"):
        ActivationCache().get(torch.zeros(2, 2, dtype=torch.int64))


def test_keep_first_host_tier_serves_capacity_over_working_set_on_cyclic_scans():
    n, capacity, batch = 1000, 250, 64
    cache = ActivationCache(host_bytes=capacity * RECORD_BYTES)
    rng = np.random.default_rng(0)
    for epoch in range(4):
        order = np.arange(n) if epoch % 2 else rng.permutation(n)  # fixed-order and shuffled scans
        cache.reset_stats()
        for start in range(0, n, batch):
            ids = torch.from_numpy(order[start : start + batch])
            out = cache.get_or_compute(ids, lambda pos, ids=ids: rows_for(ids[pos]))
            assert torch.equal(out, rows_for(ids))
        if epoch:
            assert cache.stats.hit_rate == capacity / n  # LRU would give 0.0 on the fixed-order scan
    assert cache.stats.host_bytes == capacity * RECORD_BYTES


def test_bfloat16_and_multi_dim_records_round_trip_through_disk(tmp_path):
    values = torch.randn(5, 3, 7).to(torch.bfloat16)
    with ActivationCache(tmp_path, key="bf16", host_bytes=0) as cache:
        cache.put(torch.arange(5), values)
    with ActivationCache(tmp_path, key="bf16") as cache:
        got, hit = cache.get(torch.arange(5))
        assert hit.all() and got.dtype == torch.bfloat16 and torch.equal(got, values)


# -- disk tier: restart, identity, budget, faults ------------------------------------------------
def run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1],
    )


CHILD_WRITER = """
    import os, sys, torch
    sys.path.insert(0, os.getcwd())
    from streamshard.cache import ActivationCache
    ids = torch.arange(200)
    closed = ActivationCache(sys.argv[1], key="k", host_bytes=0)
    closed.put(ids, ids[:, None].float() * 1000.0 + torch.arange(16).float())
    closed.close()
    crashed = ActivationCache(sys.argv[2], key="k", host_bytes=0)
    crashed.put(ids, ids[:, None].float() * 1000.0 + torch.arange(16).float())
    os._exit(0)  # crash-like exit: no close, no index commit
"""


def test_disk_entries_survive_a_process_restart_with_or_without_close(tmp_path):
    child = run_child(CHILD_WRITER, str(tmp_path / "closed"), str(tmp_path / "crashed"))
    assert child.returncode == 0, child.stderr
    assert not (tmp_path / "crashed" / "index.npy").exists()  # recovered from record headers alone
    for name in ("closed", "crashed"):
        with ActivationCache(tmp_path / name, key="k", host_bytes=0) as cache:
            assert assert_exact_or_miss(cache, torch.arange(250)).tolist() == [True] * 200 + [False] * 50
            assert cache.stats.disk_hits == 200


def test_reopening_with_a_different_key_never_returns_old_entries(tmp_path):
    with ActivationCache(tmp_path, key="weights-v1") as cache:
        fill(cache, range(50))
    with pytest.warns(CacheWarning, match="different key"):
        cache = ActivationCache(tmp_path, key="weights-v2")
    values, hit = cache.get(torch.arange(50))
    assert values is None and not hit.any()
    cache.put(torch.arange(3), torch.ones(3, 4))  # a new spec is fine under the new key
    cache.close()
    with pytest.warns(CacheWarning, match="different key"):
        cache = ActivationCache(tmp_path, key="weights-v1")
    assert not cache.get(torch.arange(50))[1].any()
    cache.close()


def test_reopened_cache_keeps_its_record_spec(tmp_path):
    with ActivationCache(tmp_path, key="k") as cache:
        fill(cache, range(4))
    with ActivationCache(tmp_path, key="k") as cache:
        assert cache.record_shape == (DIM,)
        with pytest.raises(RecordSpecError, match="change the key"):
            cache.put(torch.tensor([9]), torch.zeros(1, DIM, dtype=torch.float16))


def open_disk_only(path: Path) -> ActivationCache:
    return ActivationCache(path, key="k", host_bytes=0)


def slot_bytes() -> int:
    return 16 + RECORD_BYTES  # 8-byte sample id + 8-byte checksum + payload


@settings(max_examples=25, deadline=None)
@given(offset=st.integers(0, 20 * (16 + RECORD_BYTES) - 1), flip=st.integers(1, 255))
def test_any_corrupted_byte_on_disk_turns_exactly_that_record_into_a_miss(tmp_path_factory, offset, flip):
    path = tmp_path_factory.mktemp("corrupt")
    with open_disk_only(path) as cache:
        fill(cache, range(20))
    raw = bytearray((path / "slots.bin").read_bytes())
    raw[offset] ^= flip
    (path / "slots.bin").write_bytes(bytes(raw))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with open_disk_only(path) as cache:
            hit = assert_exact_or_miss(cache, torch.arange(20))
            assert cache.stats.corrupt == 1 and cache.stats.disk_records == 19  # dropped, not re-read
    assert hit.tolist() == [i != offset // slot_bytes() for i in range(20)]
    assert any(issubclass(w.category, CacheWarning) and "corrupt" in str(w.message) for w in caught)


def test_truncated_slot_file_reads_the_torn_and_missing_records_as_misses(tmp_path):
    with open_disk_only(tmp_path) as cache:
        fill(cache, range(10))
    os.truncate(tmp_path / "slots.bin", 6 * slot_bytes() + 20)  # record 6 torn, 7..9 gone
    with open_disk_only(tmp_path) as cache:
        assert assert_exact_or_miss(cache, torch.arange(10)).tolist() == [True] * 6 + [False] * 4
        fill(cache, [6, 7])  # appending after the torn record works
    with open_disk_only(tmp_path) as cache:
        assert assert_exact_or_miss(cache, torch.arange(10)).tolist() == [True] * 8 + [False] * 2


def test_unreadable_index_falls_back_to_verified_record_headers(tmp_path):
    with open_disk_only(tmp_path) as cache:
        fill(cache, range(30))
    (tmp_path / "index.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.warns(CacheWarning, match="unreadable cache index"):
        cache = open_disk_only(tmp_path)
    assert assert_exact_or_miss(cache, torch.arange(30)).all()
    cache.close()


def test_disk_budget_full_warns_once_and_keeps_serving(tmp_path):
    cache = ActivationCache(tmp_path, key="k", host_bytes=0, disk_bytes=25 * slot_bytes())
    with pytest.warns(CacheWarning, match="disk tier full") as record:
        for start in range(0, 100, 10):
            ids = torch.arange(start, start + 10)
            assert torch.equal(cache.get_or_compute(ids, lambda pos, ids=ids: rows_for(ids[pos])), rows_for(ids))
    assert sum("disk tier full" in str(w.message) for w in record) == 1
    assert cache.stats.disk_records == 25 and cache.stats.disk_bytes <= 25 * slot_bytes()
    assert assert_exact_or_miss(cache, torch.arange(100)).sum() == 25
    cache.close()


def test_enospc_degrades_to_recompute_with_a_warning(tmp_path, monkeypatch):
    cache = ActivationCache(tmp_path, key="k", host_bytes=1 << 20)
    fill(cache, range(10))

    def full_disk(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.warns(CacheWarning, match="disk full"):
        out = cache.get_or_compute(torch.arange(20), lambda pos: rows_for(pos + 0))
    assert torch.equal(out, rows_for(torch.arange(20)))
    assert assert_exact_or_miss(cache, torch.arange(20)).all()  # host tier still holds them
    monkeypatch.undo()
    cache.close()
    with open_disk_only(tmp_path) as cache:
        assert assert_exact_or_miss(cache, torch.arange(20)).tolist() == [True] * 10 + [False] * 10


def test_disk_full_while_creating_the_cache_files_falls_back_to_host_memory(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    cache = ActivationCache(tmp_path, key="k")
    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.warns(CacheWarning, match="disk tier disabled"):
        out = cache.get_or_compute(torch.arange(8), lambda pos: rows_for(pos + 0))
    assert torch.equal(out, rows_for(torch.arange(8)))
    assert assert_exact_or_miss(cache, torch.arange(8)).all() and cache.stats.disk_records == 0
    monkeypatch.undo()
    cache.close()


# -- one process per directory ------------------------------------------------------------------
def test_a_second_cache_on_the_same_directory_is_refused(tmp_path):
    first = ActivationCache(tmp_path, key="k")
    with pytest.raises(CacheLockedError, match="rank"):
        ActivationCache(tmp_path, key="k")
    first.close()
    ActivationCache(tmp_path, key="k").close()  # free again after close


def test_another_process_cannot_open_a_directory_in_use(tmp_path):
    code = """
        import os, sys
        sys.path.insert(0, os.getcwd())
        from streamshard.cache import ActivationCache, CacheLockedError
        for path in sys.argv[1:]:
            try:
                ActivationCache(path, key="k").close()
                print(path, "opened")
            except CacheLockedError:
                print(path, "locked")
    """
    rank0, rank1 = str(tmp_path / "rank0"), str(tmp_path / "rank1")
    with ActivationCache(rank0, key="k"):
        child = run_child(code, rank0, rank1)
    assert child.stdout.split() == [rank0, "locked", rank1, "opened"], child.stderr  # per-rank dirs coexist


class _TriesTheDirectory(torch.utils.data.Dataset):
    """Map-style: item i is 1 if this (worker) process is refused the cache directory, 0 if it got it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        try:
            ActivationCache(self.directory, key="k").close()
        except CacheLockedError:
            return 1
        return 0


def persistent_workers(dataset: torch.utils.data.Dataset) -> torch.utils.data.DataLoader:
    # fork explicitly: the workers inherit the parent's open fds, which is how a lock could leak
    return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True,
                                       multiprocessing_context="fork")


def test_close_frees_the_directory_while_persistent_dataloader_workers_live(tmp_path):
    cache = ActivationCache(tmp_path, key="k")
    fill(cache, range(4))
    loader = persistent_workers(list(range(4)))
    assert sorted(int(x) for x in loader) == [0, 1, 2, 3]  # the workers are forked and stay alive
    cache.close()
    with ActivationCache(tmp_path, key="k") as again:  # no CacheLockedError although the workers live
        assert assert_exact_or_miss(again, torch.arange(4)).all()
        assert sorted(int(x) for x in loader) == [0, 1, 2, 3]  # the same workers serve another epoch
    del loader


def test_a_directory_stays_exclusive_while_forked_workers_live(tmp_path):
    cache = ActivationCache(tmp_path, key="k")
    loader = persistent_workers(_TriesTheDirectory(tmp_path))
    assert [int(x) for x in loader] == [1, 1, 1, 1]  # each worker process is refused while the parent holds it
    cache.close()
    with ActivationCache(tmp_path, key="k"):  # reopened while the same workers live: still exclusive
        with pytest.raises(CacheLockedError):
            ActivationCache(tmp_path, key="k")  # a second object in this process
        assert [int(x) for x in loader] == [1, 1, 1, 1]  # other processes
    del loader


def test_cache_refuses_to_be_copied_or_used_after_close(tmp_path):
    cache = ActivationCache(tmp_path, key="k")
    with pytest.raises(TypeError, match="one per process"):
        copy.copy(cache)
    cache.close()
    cache.close()
    with pytest.raises(CacheError, match="closed"):
        cache.get(torch.tensor([1]))


def test_a_forked_child_cannot_use_or_release_the_parents_cache(tmp_path):
    cache = ActivationCache(tmp_path, key="k")
    fill(cache, range(4))
    pid = os.fork()
    if pid == 0:  # child: must refuse, and closing must leave the parent's lock and files alone
        code = 2
        try:
            cache.get(torch.tensor([1]))
        except CacheError:
            cache.close()
            code = 0
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with pytest.raises(CacheLockedError):
        ActivationCache(tmp_path, key="k")
    assert assert_exact_or_miss(cache, torch.arange(4)).all()
    cache.close()


def test_clear_drops_both_tiers_and_allows_a_new_record_spec(tmp_path):
    with ActivationCache(tmp_path, key="k") as cache:
        fill(cache, range(10))
        cache.clear()
        assert cache.get(torch.arange(10))[0] is None and cache.record_shape is None
        cache.put(torch.arange(3), torch.ones(3, 2, dtype=torch.float16))
    with ActivationCache(tmp_path, key="k") as cache:
        values, hit = cache.get(torch.arange(10))
        assert hit.tolist() == [True] * 3 + [False] * 7 and values.dtype == torch.float16


# -- model-based property test and the index -----------------------------------------------------
ops = st.lists(
    st.tuples(st.booleans(), st.lists(st.integers(-1, 60), min_size=1, max_size=12)), min_size=1, max_size=25
)


@settings(max_examples=30, deadline=None)
@given(ops=ops, host_records=st.integers(0, 20), disk_records=st.integers(0, 40), reopen_at=st.integers(0, 25))
def test_cache_matches_a_dict_model_within_its_byte_budgets(tmp_path_factory, ops, host_records, disk_records, reopen_at):
    path = tmp_path_factory.mktemp("model")
    budgets = dict(host_bytes=host_records * RECORD_BYTES, disk_bytes=disk_records * slot_bytes())
    cache = ActivationCache(path, key="m", **budgets)
    stored: set[int] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        for step, (is_put, ids) in enumerate(ops):
            if step == reopen_at:
                cache.close()
                cache = ActivationCache(path, key="m", **budgets)  # only the disk tier survives
            ids_t = torch.tensor(ids)
            if is_put:
                fill(cache, ids_t)
                stored |= {i for i in ids if i >= 0}
            hit = assert_exact_or_miss(cache, ids_t)
            assert all(i in stored for i, h in zip(ids, hit.tolist()) if h)
            s = cache.stats
            assert s.host_bytes <= budgets["host_bytes"] and s.disk_bytes <= budgets["disk_bytes"]
            assert s.host_records <= host_records and s.disk_records <= disk_records
    cache.close()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 2**62), max_size=300, unique=True)), max_size=8))
def test_id_index_behaves_like_a_dict(batches):
    index, model = _IdIndex(), {}
    for n, (insert, ids) in enumerate(batches):
        arr = np.array(ids, dtype=np.int64)
        if insert:
            fresh = arr[index.get(arr) < 0]
            index.insert(fresh, fresh * 0 + n)
            model.update({int(i): n for i in fresh})
        else:
            index.remove(arr)
            for i in ids:
                model.pop(i, None)
        probe = np.array(sorted(set(ids) | set(model)), dtype=np.int64)
        assert index.get(probe).tolist() == [model.get(int(i), -1) for i in probe]
        assert index.size == len(model)


def test_module_fingerprint_changes_with_weights_and_extra():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    base = module_fingerprint(net)
    assert module_fingerprint(net) == base
    assert module_fingerprint(net, extra="2 layers") != base
    with torch.no_grad():
        net[0].weight[0, 0] += 1e-6
    assert module_fingerprint(net) != base


def test_a_dropped_cache_with_a_directory_is_collected_and_releases_its_lock(tmp_path):
    import gc
    import weakref

    cache = ActivationCache(tmp_path / "c", host_bytes=1 << 20, disk_bytes=1 << 20, key="k")
    cache.put(torch.tensor([1, 2]), torch.ones(2, 4))
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None
    ActivationCache(tmp_path / "c", host_bytes=1 << 20, disk_bytes=1 << 20, key="k").close()  # lock released


def test_a_cache_event_is_one_warning_not_a_warning_and_a_log_line(tmp_path, caplog):
    first = ActivationCache(str(tmp_path / "c"), host_bytes=0, disk_bytes=1 << 20, key="a")
    first.put(torch.tensor([1]), torch.ones(1, 4))
    first.close()
    with pytest.warns(CacheWarning) as caught:
        ActivationCache(str(tmp_path / "c"), host_bytes=0, disk_bytes=1 << 20, key="b").close()
    assert len(caught) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("shape", [[10**12, 10**6], [-3], "16", [0], [True], [2**62, 2**62]])
def test_a_damaged_meta_json_shape_is_ignored_with_a_warning_and_the_cache_rebuilt(tmp_path, shape):
    """A meta.json whose shape is not a list of positive ints, or claims an absurd record size, is
    discarded (warning), never a crash, a huge allocation or a spec that refuses the real records."""
    import json

    with ActivationCache(tmp_path, key="k", host_bytes=0) as cache:
        fill(cache, range(10))
    meta_path = tmp_path / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"] = shape
    meta_path.write_text(json.dumps(meta))
    with pytest.warns(CacheWarning):
        cache = ActivationCache(tmp_path, key="k", host_bytes=0)
    with cache:
        assert not assert_exact_or_miss(cache, torch.arange(10)).any(), "entries under a damaged spec were served"
        fill(cache, range(5))
        assert assert_exact_or_miss(cache, torch.arange(5)).all()


def test_values_with_an_empty_or_huge_record_are_refused_by_argument(tmp_path):
    with ActivationCache(tmp_path, key="k", host_bytes=1 << 20) as cache:
        with pytest.raises(ValueError, match="values: a record's shape must be positive ints"):
            cache.put(torch.arange(3), torch.ones(3, 0))


def test_a_failed_index_commit_leaves_no_temp_file(tmp_path):
    """A write refused by the kernel (here: a file-size limit, EFBIG, as a full disk would) warns and
    leaves no index.npy.tmp behind; the records stay readable."""
    script = textwrap.dedent(f"""
        import resource, signal, warnings, torch
        from streamshard.cache import ActivationCache
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        cache = ActivationCache({str(tmp_path)!r}, key="k", host_bytes=0)
        ids = torch.arange(1000)
        cache.put(ids, ids[:, None].to(torch.float32) * 1000.0 + torch.arange({DIM}, dtype=torch.float32))
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # the index needs ~8 KB
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cache.close()
        print(any("could not commit cache index" in str(w.message) for w in caught))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True", out.stdout + out.stderr
    assert not (tmp_path / "index.npy.tmp").exists(), "a failed commit left its temp file"
    with open_disk_only(tmp_path) as cache:
        assert assert_exact_or_miss(cache, torch.arange(1000)).all()
