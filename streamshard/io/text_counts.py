"""Counting the tokens of a text column, row group by row group, before a packed epoch is planned.

Equal steps need every global worker's token count before anything is read, and a footer does not
know how a tokenizer will cut its texts: so each row group is tokenized once, here, and only its
count kept (``TokenCountCache`` keeps it on disk, per file version and tokenizer). Cold, this costs
one tokenizing pass over the corpus, split over the ranks (each counts every world-size-th missing
row group; an all-gather gives all of them to everyone) and over ``threads`` read/tokenize threads per
rank (Hugging Face tokenizers run without the GIL); a bar on a terminal shows its progress. Warm, it
costs one JSON read. A failure on any rank is raised on every rank (no rank waits forever for it).
``count_over_ranks`` splits one later stage of a text epoch the same way, from a thread, over any
all-gather it is handed (``streams/stage_counting.py`` gives it one).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from . import collective
from ..errors import ReadError
from .reader import RowGroupReader
from ..convert.text_tokenizer import TextTokenizer
from .token_count_cache import UNKNOWN, TokenCountCache

log = logging.getLogger("streamshard")


def row_group_texts(table: pa.Table, column: str) -> list[str | None]:
    """The texts of a decoded row group, nulls as None."""
    return table.column(column).to_pylist()


def count_text_tokens(catalog: Any, storage_options: dict[str, Any], column: str, tokenizer: TextTokenizer,
                      cache_dir: str | None = None, *, distributed: bool = False, group: Any = None,
                      threads: int | None = None, quiet: bool = False, rgs: np.ndarray | None = None,
                      what: str = "before the first epoch", known: np.ndarray | None = None) -> np.ndarray:
    """Tokens per row group of ``catalog`` (int64) as ``tokenizer`` lays them out, cached in ``cache_dir``
    when the tokenizer has an identity. ``distributed``: split the counting over ``group``'s ranks.
    ``rgs``: count only these row groups (a stage of the epoch); the others are as the cache has
    them, ``UNKNOWN`` if it has none. ``what`` says in the log what the counting is for. ``known``:
    counts this process already holds (``UNKNOWN`` elsewhere), used with the cache's."""
    cache = TokenCountCache(cache_dir, tokenizer.identity, column) if cache_dir and tokenizer.identity else None
    counts = cache.load(catalog) if cache is not None else np.full(catalog.num_row_groups, UNKNOWN, np.int64)
    if known is not None:
        counts = np.where(counts >= 0, counts, known)
    place = collective.process_group(group) if distributed else None
    if place is not None:  # everyone plans the split from rank 0's view of the cache
        counts = np.array(collective.broadcast([int(c) for c in counts], group), dtype=np.int64)
    wanted = np.arange(len(counts), dtype=np.int64) if rgs is None else np.asarray(rgs, dtype=np.int64)
    missing = wanted[counts[wanted] < 0]
    if not missing.size:
        return counts
    rank, world = place if place is not None else (0, 1)
    mine = missing[rank::world]
    started = time.perf_counter()
    log.info("counting the tokens of %d row groups of column %r (%d on this rank) %s",
             len(missing), column, len(mine), what)
    error: BaseException | None = None
    try:
        counts[mine] = _count(catalog, storage_options, column, tokenizer, mine, threads, quiet)
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks learn of it
        if place is None:
            raise
        error = exc
    if place is not None:
        _take_counts(collective.all_gather(_counted(mine, counts, error), group), counts, error)
    log.info("counted %d tokens in %d row groups in %.1f s", int(counts[missing].sum()), len(missing),
             time.perf_counter() - started)
    if cache is not None and (place is None or place[0] == 0):
        cache.save(catalog, counts)
    return counts


def count_over_ranks(units: np.ndarray, known: np.ndarray, count: Callable[[np.ndarray], np.ndarray],
                     gather: Callable[[Any], list[Any]], place: tuple[int, int], weights: np.ndarray,
                     round_weight: float, leaving: Callable[[], bool] = lambda: False,
                     beat: Callable[[], None] = lambda: None) -> np.ndarray:
    """Tokens of ``units`` (a later stage of a text epoch), counted over the ranks that ``gather`` joins
    (``gather(value)``: every rank's JSON-safe value, in rank order; ``place``: this rank and their
    number). What some rank already holds (``known``, ``UNKNOWN`` elsewhere: ranks may differ, e.g.
    one whose training counted the stage alone) is sent by the first rank holding it; what none
    holds is split into rounds of about ``round_weight`` (of ``weights``, per unit: compressed text
    bytes), each rank counting every world-size-th unit of a round with ``count`` (alone: no
    collective), the counts all-gathered after each round. So no rank waits inside a collective
    much longer than one round's count on the slowest rank.

    Every rank calls it with the same ``units``, in the same order as its other gathers: the number
    of gathers follows from gathered data only. A failed ``count`` on any rank raises ``ReadError``
    on every rank (after the gather: none is left waiting); a gather that fails (a rank gone, its
    timeout) raises ``CollectiveFailed`` (its ``counts``: what this rank had by then), and the caller
    counts the rest alone: counts are deterministic, so the split only makes them come sooner.
    ``leaving()`` true on a rank (its process is exiting) is sent with its next gather, after which
    every rank raises ``CollectiveFailed`` at the same point: the group is left in step, with no
    collective left half-done. ``beat()`` is called after every gather (the split goes on: a worker
    process waiting for its parent's counts keeps waiting, ``io/count_share.py``)."""
    counts = np.asarray(known, dtype=np.int64).copy()

    def gather_and_beat(value: Any) -> list[Any]:
        shares = gather(value)
        beat()
        return shares

    try:
        return _count_over_ranks(np.asarray(units, dtype=np.int64), counts, count, gather_and_beat, place, weights,
                                 round_weight, leaving)
    except collective.CollectiveFailed as exc:
        exc.counts = counts  # what was counted here or gathered before it failed: not to be counted again
        raise


def _count_over_ranks(units: np.ndarray, counts: np.ndarray, count: Callable[[np.ndarray], np.ndarray],
                      gather: Callable[[Any], list[Any]], place: tuple[int, int], weights: np.ndarray,
                      round_weight: float, leaving: Callable[[], bool]) -> np.ndarray:
    rank, world = place
    views, left = _gather({"lacks": [int(u) for u in units[counts[units] < 0]]}, gather, leaving)
    if left is not None:
        raise left
    lacking = [np.asarray(view["lacks"], dtype=np.int64) for view in views]
    needed = np.unique(np.concatenate(lacking))
    if not needed.size:
        return counts[units]
    holds = np.stack([~np.isin(needed, lacks) for lacks in lacking])  # [rank, needed]: who holds each
    nobody = needed[~holds.any(axis=0)]
    send = needed[holds.any(axis=0) & (holds.argmax(axis=0) == rank)]  # held: the first holder sends it
    for i, part in enumerate(_rounds(nobody, np.asarray(weights, dtype=np.float64), round_weight, world)):
        mine = part[rank::world]
        error: BaseException | None = None
        try:
            got = np.asarray(count(mine), dtype=np.int64) if mine.size else np.zeros(0, np.int64)
            if got.shape != mine.shape or (got < 0).any():
                raise ValueError(f"counting gave {got!r} for {len(mine)} row groups")
            counts[mine] = got
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks learn of it
            error = exc
        sent = np.concatenate([send, mine]) if i == 0 else mine
        shares, left = _gather(_counted(sent, counts, error), gather, leaving)
        _take_counts(shares, counts, error)
        if left is not None:
            raise left
    return counts[units]


def _counted(rgs: np.ndarray, counts: np.ndarray, error: BaseException | None) -> dict[str, Any]:
    """What a rank sends after counting ``rgs``: their counts, or why it failed (JSON-safe)."""
    return {"rgs": [int(r) for r in rgs], "counts": [int(c) for c in counts[rgs]],
            "error": None if error is None else f"{type(error).__name__}: {error}"}


def _take_counts(shares: list[dict[str, Any]], counts: np.ndarray, error: BaseException | None) -> None:
    """Every rank's counts into ``counts``, once every rank has sent them; this rank's own ``error`` first,
    else the first rank's failure as a ``ReadError`` naming that rank (every rank raises, none waits)."""
    if error is not None:
        raise error
    failed = [(r, s["error"]) for r, s in enumerate(shares) if s["error"]]
    if failed:
        raise ReadError(f"counting tokens failed on rank {failed[0][0]}: {failed[0][1]}")
    for share in shares:
        counts[np.array(share["rgs"], dtype=np.int64)] = share["counts"]


def _rounds(units: np.ndarray, weights: np.ndarray, round_weight: float, world: int) -> list[np.ndarray]:
    """``units`` cut in order into rounds of about ``round_weight`` (at least ``world`` units each, so
    every rank has a share; the last one takes what is left); one empty round when there are none."""
    rounds, start, weight = [], 0, 0.0
    for i, w in enumerate(weights[units].tolist()):
        weight += w
        if weight >= round_weight and i + 1 - start >= world:
            rounds.append(units[start:i + 1])
            start, weight = i + 1, 0.0
    if start < len(units) or not rounds:
        rounds.append(units[start:])
    return rounds


def _gather(value: dict[str, Any], gather: Callable[[Any], list[Any]],
            leaving: Callable[[], bool]) -> tuple[list[dict[str, Any]], collective.CollectiveFailed | None]:
    """Every rank's ``value``, and the error to raise on every rank (after using them) when one said
    it is leaving; a gather that fails, whatever it raises, is a ``CollectiveFailed``."""
    try:
        shares = gather({**value, "leaving": bool(leaving())})
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError, DistBackendError, ...
        raise collective.CollectiveFailed(f"a gather of the counting group failed: {type(exc).__name__}: "
                                          f"{exc}") from exc
    left = [r for r, share in enumerate(shares) if share["leaving"]]
    return shares, collective.CollectiveFailed(f"rank {left[0]} of the counting group is exiting") if left else None


def _count(catalog: Any, storage_options: dict[str, Any], column: str, tokenizer: TextTokenizer,
           rgs: np.ndarray, threads: int | None, quiet: bool) -> np.ndarray:
    from ..progress import progress_bar  # here: importing the package must not import the command line

    reader = RowGroupReader.from_catalog(catalog, storage_options, columns=[column])
    threads = threads or min(8, os.cpu_count() or 1)
    bar = progress_bar(sys.stderr, total=len(rgs), unit="rg", desc="counting tokens", quiet=quiet)

    def one(rg: int) -> int:
        file_index, index = int(catalog.rg_file[rg]), int(catalog.rg_index[rg])
        table = reader.read(file_index, index)
        where = f"{catalog.urls[file_index]}: row group {index}"
        if table.num_rows != int(catalog.rg_rows[rg]):
            raise ReadError(f"{where}: {table.num_rows} rows, but the footer said {int(catalog.rg_rows[rg])}")
        return tokenizer.count(row_group_texts(table, column), where)

    out = np.zeros(len(rgs), dtype=np.int64)
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="streamshard-count")
    in_flight: deque[tuple[int, Future]] = deque()  # bounded: a million row groups are not a million futures
    try:
        for i, rg in enumerate(rgs.tolist()):
            in_flight.append((i, pool.submit(one, rg)))
            while in_flight and (len(in_flight) >= 2 * threads or i == len(rgs) - 1):
                done, future = in_flight.popleft()
                out[done] = future.result()
                bar.update(1)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # after a failure, the queued row groups do not start
        bar.close()
        reader.close()
    return out
