"""Reading what a schedule says: decoded row groups in, batches of tensors out.

The one delivery path of every stream. A :class:`~streamshard.plan.batch_plan.Schedule` decides each
batch; this module fetches the row groups its specs name (``read_ahead`` reads in flight on
background threads: pyarrow decodes without the GIL), converts each one once on the thread that
read it (``convert/gather.py``), holds it until the last batch that needs it, and gathers each batch's
rows from the reads it names, padded, the batches of a block (``Schedule.blocks``: a shuffle
window's, at most 65,536 rows) together (``Gatherer.build_block``). Schemas with inner list levels
convert each batch's rows instead (``build``). Memory: the groups the current block still
shares with later ones plus ``read_ahead`` groups read ahead, and no read ahead while those would
weigh more than ``READ_AHEAD_BYTES`` decoded (``weigh``), never a file; of a group this worker
owns only part of, only that part (the read names its rows, ``Read.rows``; ``local_rows`` maps
row numbers into it).

A failed read ends the pass: reads queued behind it fail with the same error instead of starting
(a hung store would otherwise cost a full retry deadline per queued read), and a conversion error
names the file and row group of the rows it came from (``describe``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import torch

from ..plan.batch_plan import BatchBlock, BatchSpec, Read, Schedule
from ..convert.batches import CORPUS, concat, padding_like, with_ids
from ..errors import ConversionError
from ..convert.gather import Gatherer, convert_read, gatherable
from ..convert.part_convert import convert_part
from ..io.reader import ReadStats, StreamedPart
from ..convert.tensors import Batch, BatchConverter

_MAX_LOOKAHEAD = 64  # batch specs computed ahead to find the next reads, for schedules without upcoming_reads
_PENDING = object()  # not resolved yet
# Read threads beyond ``read_ahead``, for the reads one batch needs together (a shuffle window's ~16-28
# row groups at its start): these run at once rather than ``read_ahead`` at a time, which on object
# storage is a round trip per ``read_ahead`` reads. They hold nothing more (the batch needs them all);
# threads start only as reads wait for one.
_TOGETHER = 32
# Read-ahead stops while the reads held and in flight would weigh more than this (their estimated
# decoded bytes, ``weigh``): ``read_ahead`` counts reads, so without it a worker whose next reads are
# huge row groups would hold ``read_ahead`` more of them. Four streamed groups' worth
# (``io/reader.py`` STREAM_ABOVE_BYTES): ordinary groups (the common case) never reach it unshuffled
# (1 + ``read_ahead`` of them), and groups whose compressed bytes show them small weigh nothing.
# The current block's reads are always read, whatever they weigh: progress never waits on it.
READ_AHEAD_BYTES = 256 * 1024 * 1024
# On object storage each read is a round trip, and ``read_ahead`` small groups in flight do not cover one:
# a worker whose next groups take less than a round trip each to decode waits on the store between them
# (16 groups of 0.4 MB over 2 workers at 20 ms: the epoch's reads came in 4-5 rounds). There, reads
# ahead go on past ``read_ahead`` while the reads ahead fetch at most this many compressed bytes (up to
# ``_TOGETHER`` more reads): about what a worker decodes in a round trip of a slow store. Still within
# ``READ_AHEAD_BYTES`` decoded; never on local disk, where a read costs no round trip.
READ_AHEAD_FETCH_BYTES = 8 * 1024 * 1024


@dataclass
class DeliveryStats:
    """Where a worker's time went, for ``ParquetStream.stats_hook`` (``streamshard bench`` reads it).

    ``worker``: which of the rank's workers; ``busy_s``: producing batches (inside ``next()``); ``wait_s``: the part of it blocked on row-group
    reads; ``convert_s``: building batches of tensors from the reads; ``prepare_s``: converting each
    read once for that, on the read-ahead threads (summed over them, like the reader's times; a
    streamed row group's decoding interleaves with its conversion and is counted here too);
    ``reads``: the reader's own counters (bytes fetched, fetch and decode seconds, summed over the
    read-ahead threads); ``most_reads_held`` / ``most_held_bytes``: the most reads held or in flight
    at once after a block's reads were started, and the most estimated decoded bytes they weighed
    (what ``READ_AHEAD_BYTES`` bounds).
    """

    reads: ReadStats
    worker: int = 0  # the rank's worker (DataLoader process or StreamLoader thread) these are of
    rows: int = 0
    batches: int = 0
    busy_s: float = 0.0
    wait_s: float = 0.0
    convert_s: float = 0.0
    prepare_s: float = 0.0
    most_reads_held: int = 0  # the most row-group reads held or in flight at once (read-ahead's reach)
    most_held_bytes: int = 0  # their estimated decoded bytes at that (``weigh``; 0 for groups surely small)


class _Ready:
    """A finished read, for the synchronous path (``read_ahead=0``)."""

    def __init__(self, table: pa.Table) -> None:
        self._table = table

    def result(self) -> pa.Table:
        return self._table


def deliver(
    schedule: Schedule, start: int, read: Callable[[Read], Any], convert: BatchConverter | None, read_ahead: int,
    stats: DeliveryStats | None = None, assemble: Callable[[BatchSpec, dict[int, Any]], Batch] | None = None,
    *, describe: Callable[[Read], str] | None = None, weigh: Callable[[Read], int] | None = None,
    read_ahead_bytes: int | None = None, fetched: Callable[[Read], int | None] | None = None,
    read_ahead_fetch_bytes: int | None = None, together: Callable[[list[Read]], list[int]] | None = None,
) -> Iterator[Batch]:
    """Batches ``start..steps-1`` of ``schedule``, read through ``read``; timings into ``stats``.

    ``assemble(spec, reads)`` replaces the default (Arrow rows -> ``convert`` -> padding) for
    streams whose reads are not plain row groups (token packing); it gets every spec, padding
    ones included. ``describe(read)`` says where a read's rows come from (``"<url> row group 3"``);
    a ``ConversionError`` then names the reads whose rows failed to convert. ``weigh(read)``: its
    estimated decoded bytes; read-ahead then stops while the reads held and in flight would exceed
    ``read_ahead_bytes`` (default ``READ_AHEAD_BYTES``; None ``weigh``: reads weigh nothing).
    ``fetched(read)``: the compressed bytes the read fetches from object storage (None: not a remote read,
    or unknown); reads ahead then go on past ``read_ahead`` while those of the reads ahead stay within
    ``read_ahead_fetch_bytes`` (default ``READ_AHEAD_FETCH_BYTES``): small groups on a slow store keep
    enough reads in flight to cover a round trip. Only for schedules that name their upcoming reads.
    ``together(reads)``: told of the reads started in one round before they start (the reader then
    fetches a file's small groups among them in one GET: ``RowGroupReader.read_together``); returns the
    order to start them in (positions in ``reads``)."""
    gatherer = Gatherer(convert) if assemble is None and gatherable(convert) else None
    if gatherer is not None:  # each read converted once, on the thread that read it
        read = _converting(read, convert, describe, stats)
    else:  # a streamed part (``read`` may return one) is joined into its table
        read = _joined(read)
    blocks = schedule.blocks(start)  # consecutive batches built together (one for most schedules)
    upcoming = schedule.upcoming_reads(start) if read_ahead else None
    pending: dict[int, Future | _Ready] = {}
    submitted: set[int] = set()  # keys read this pass (a finished read is never read again)
    lookahead: deque[BatchBlock] = deque()
    pool = (ThreadPoolExecutor(max_workers=read_ahead + _TOGETHER, thread_name_prefix="streamshard-read")
            if read_ahead else None)
    resolved: dict[int, Any] = {}  # finished reads' results (a Future's result() locks, per batch and read)
    template: Batch | None = None
    exhausted = False
    failed: list[BaseException] = []  # the first failed read: the pass ends there
    budget = READ_AHEAD_BYTES if read_ahead_bytes is None else read_ahead_bytes
    weights: dict[int, int] = {}  # estimated decoded bytes of each pending read (weighed ones only)
    deferred: list[tuple[int, Read]] = []  # an upcoming read taken but over the budget: the next one to read
    fetch_budget = READ_AHEAD_FETCH_BYTES if read_ahead_fetch_bytes is None else read_ahead_fetch_bytes
    fetch_sizes: dict[int, int | None] = {}  # compressed bytes of each pending read from object storage
    fresh: list[tuple[int, Read]] = []  # reads submitted this round, not started yet

    def weight(key: int, what: Read) -> int:
        if weigh is None:
            return 0
        if key not in weights:
            try:
                weights[key] = int(weigh(what))
            except Exception:  # noqa: BLE001 - the read itself reports what is wrong
                weights[key] = 0
        return weights[key]

    def fits(key: int, what: Read) -> bool:
        """Whether reading ``what`` ahead keeps the pending reads within the byte budget."""
        if weigh is None:
            return True
        held = sum(weights.get(k, 0) for k in pending)
        return held + weight(key, what) <= budget

    def fetch_size(key: int, what: Read) -> int | None:
        if key not in fetch_sizes:
            try:
                fetch_sizes[key] = fetched(what) if fetched is not None else None
            except Exception:  # noqa: BLE001 - the read itself reports what is wrong
                fetch_sizes[key] = None
        return fetch_sizes[key]

    def small_enough(key: int, what: Read, current: dict[int, Read]) -> bool:
        """Whether reading ``what`` ahead past ``read_ahead`` keeps the remote reads ahead within
        ``fetch_budget`` compressed bytes (every one of them known to be remote)."""
        if fetched is None:
            return False
        sizes = [fetch_sizes.get(k) for k in pending if k not in current]
        mine = fetch_size(key, what)
        if mine is None or any(size is None for size in sizes):
            return False
        return sum(sizes) + mine <= fetch_budget  # type: ignore[arg-type]

    def guarded(what: Read) -> Any:
        if failed:  # queued behind a failure: do not start (the consumer gets that failure)
            raise failed[0]
        try:
            return read(what)
        except BaseException as exc:
            failed.append(exc)
            raise

    def submit(key: int, what: Read) -> None:
        submitted.add(key)
        if fetched is not None:
            fetch_size(key, what)
        if pool is None:
            pending[key] = _Ready(read(what))
        else:  # started by ``start_submitted``, with the others of this round
            pending[key] = None  # type: ignore[assignment]
            fresh.append((key, what))

    def start_submitted() -> None:
        """Start the reads submitted this round, announced together first (``together``: a file's small
        groups on object storage are then fetched in one GET)."""
        if together is not None and len(fresh) > 1:
            try:
                order = together([what for _, what in fresh])
                fresh[:] = [fresh[i] for i in order] if sorted(order) == list(range(len(fresh))) else fresh
            except Exception:  # noqa: BLE001 - only an optimisation: each read reports what is wrong itself
                pass
        for key, what in fresh:
            pending[key] = pool.submit(guarded, what)
        fresh.clear()

    def results(keys: Iterable[int]) -> dict[int, Any]:
        out = {}
        for key in keys:
            value = resolved.get(key, _PENDING)
            if value is _PENDING:
                value = resolved[key] = pending[key].result()
            out[key] = value
        return out

    def pull() -> bool:
        nonlocal exhausted
        if exhausted:
            return False
        block = next(blocks, None)
        if block is None:
            exhausted = True
            return False
        lookahead.append(block)
        return True

    try:
        while True:
            began = time.perf_counter()
            if not (lookahead or pull()):
                break
            block = lookahead[0]
            for key, what in block.reads.items():
                if key not in pending:
                    submit(key, what)
            if pool is not None:  # keep `read_ahead` reads in flight beyond the current block's
                if weigh is not None:  # what the current block holds counts against the byte budget
                    for key, what in block.reads.items():
                        weight(key, what)
                ahead, j = sum(1 for k in pending if k not in block.reads), 1
                # however many batches away; past ``read_ahead`` only small remote reads (``small_enough``)
                while upcoming is not None and ahead < read_ahead + (_TOGETHER if fetched is not None else 0):
                    key, what = deferred.pop() if deferred else next(upcoming, (None, None))
                    if key is None:
                        break
                    if key not in submitted:
                        if not fits(key, what) or (ahead >= read_ahead and not small_enough(key, what, block.reads)):
                            deferred.append((key, what))
                            break
                        submit(key, what)
                        ahead += 1
                over = False
                while (upcoming is None and not over and ahead < read_ahead and j < _MAX_LOOKAHEAD
                       and (j < len(lookahead) or pull())):
                    for key, what in lookahead[j].reads.items():
                        if key not in submitted:
                            if not fits(key, what):
                                over = True
                                break
                            submit(key, what)
                            ahead += 1
                    j += 1
                start_submitted()
            if stats is not None:
                stats.most_reads_held = max(stats.most_reads_held, len(pending))
                stats.most_held_bytes = max(stats.most_held_bytes, sum(weights.get(k, 0) for k in pending))
            lookahead.popleft()
            batches: Iterator[Batch]
            if assemble is not None or len(block.read):
                waited = time.perf_counter()
                tables = results(block.reads)
                converting = time.perf_counter()
                if assemble is not None:
                    batches = (assemble(spec, tables if block.count == 1 else {k: tables[k] for k in spec.reads})
                               for spec in map(block.spec, range(block.count)))
                else:
                    assert convert is not None  # every stream without its own assemble converts Arrow rows
                    if gatherer is not None:
                        batches = gatherer.build_block(block, tables)  # each batch made as it is asked for
                    else:
                        batches = (_build_placed(spec, tables, convert, describe)
                                   for spec in map(block.spec, range(block.count)))
                if stats is not None:
                    stats.wait_s += converting - waited
                    stats.convert_s += time.perf_counter() - converting
            else:  # padding only
                assert convert is not None
                if template is None:
                    template = _donor(schedule, read, convert, describe, gatherer)
                batches = iter([pad_batch(template, block.padding[0], convert)])
            cuts = block.cuts.tolist()
            for j in range(block.count):
                converting = time.perf_counter()
                batch = next(batches)
                if assemble is None and len(block.read):
                    template = batch
                if stats is not None:
                    done_at = time.perf_counter()
                    stats.convert_s += done_at - converting
                    stats.busy_s += done_at - began
                    stats.rows += cuts[j + 1] - cuts[j]
                    stats.batches += 1
                yield batch
                began = time.perf_counter()
            for key in block.done:
                pending.pop(key, None)
                resolved.pop(key, None)
                weights.pop(key, None)
                fetch_sizes.pop(key, None)
    finally:
        for future in pending.values():
            if isinstance(future, Future):
                future.cancel()
        pending.clear()
        resolved.clear()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _donor(schedule: Schedule, read: Callable[[Read], Any], convert: BatchConverter,
           describe: Callable[[Read], str] | None, gatherer: Gatherer | None) -> Batch:
    spec = schedule.shape_donor()
    if spec is None:  # an empty dataset: a 0-row batch keeps the keys
        empty = pa.Table.from_batches([], schema=convert.schema)
        return with_ids(convert(empty), np.zeros(0, dtype=np.int64))
    reads = {k: read(r) for k, r in spec.reads.items()}
    return gatherer.build(spec, reads) if gatherer is not None else _build_placed(spec, reads, convert, describe)


def _converting(read: Callable[[Read], pa.Table], convert: BatchConverter, describe: Callable[[Read], str] | None,
                stats: DeliveryStats | None) -> Callable[[Read], Any]:
    """``read``, then the read's rows converted once (``gather.convert_read``), timed into
    ``stats.prepare_s``; a conversion error names the file and row group they came from."""
    lock = threading.Lock()  # several read-ahead threads add to one total

    def read_converted(what: Read) -> Any:
        got = read(what)
        began = time.perf_counter()
        try:
            if isinstance(got, StreamedPart):  # a huge group's part: decoded as it converts (timed here too)
                return convert_part(got, got.rows, convert)
            return convert_read(got, convert)
        except ConversionError as exc:
            if describe is None:
                raise
            raise ConversionError(f"{exc} (in the rows of {describe(what)})") from None
        finally:
            if stats is not None:
                with lock:
                    stats.prepare_s += time.perf_counter() - began
    return read_converted


def _joined(read: Callable[[Read], Any]) -> Callable[[Read], Any]:
    """``read``, with a ``StreamedPart`` joined into one table."""
    def read_table(what: Read) -> Any:
        got = read(what)
        return got.table() if isinstance(got, StreamedPart) else got
    return read_table


def _build_placed(spec: BatchSpec, tables: dict[int, pa.Table], convert: BatchConverter,
                  describe: Callable[[Read], str] | None) -> Batch:
    """``build``; a ``ConversionError`` names the file and row group of the rows that failed (``describe``)."""
    try:
        return build(spec, tables, convert)
    except ConversionError as exc:
        if describe is None:
            raise
        keys = list(spec.reads)
        culprits = [k for k in keys if _fails(spec, tables, convert, k)] if len(keys) > 1 else keys
        places = ", ".join(describe(spec.reads[k]) for k in (culprits or keys))
        raise ConversionError(f"{exc} (in the rows of {places})") from None


def _fails(spec: BatchSpec, tables: dict[int, pa.Table], convert: BatchConverter, key: int) -> bool:
    """Whether the spec's rows from read ``key`` alone fail to convert (only asked after a batch failed)."""
    try:
        convert(_take(tables[key], spec.reads[key].local_rows(spec.row[spec.read == key])))
    except ConversionError:
        return True
    return False


def spec_table(spec: BatchSpec, tables: dict[int, pa.Table]) -> pa.Table:
    """The spec's real rows as one Arrow table, in delivered order."""
    keys = list(spec.reads)
    parts = []
    for key in keys:
        rows = spec.row if len(keys) == 1 else spec.row[spec.read == key]
        parts.append(_take(tables[key], spec.reads[key].local_rows(rows)))
    if len(parts) == 1:
        return parts[0]
    if len({p.schema for p in parts}) > 1:  # nullability flags may differ between files or corpora
        parts = [p.cast(parts[0].schema) for p in parts]
    table = pa.concat_tables(parts)
    rank = np.empty(int(spec.read.max()) + 1, dtype=np.int64)
    rank[np.asarray(keys)] = np.arange(len(keys))
    grouped = rank[spec.read]
    if np.all(grouped[1:] >= grouped[:-1]):
        return table
    order = np.argsort(grouped, kind="stable")  # table row m holds delivered row order[m]
    where = np.empty_like(order)
    where[order] = np.arange(len(order))
    return table.take(pa.array(where))


def _take(table: pa.Table, rows: np.ndarray) -> pa.Table:
    if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and np.all(np.diff(rows) == 1):
        return table.slice(int(rows[0]), len(rows))  # contiguous: zero-copy
    batches = table.to_batches()
    if len(batches) <= 1:
        return table.take(pa.array(rows))
    # A streamed read is many record batches; pyarrow's take on chunked list columns concatenates
    # every chunk first (a copy of the whole part per batch), so take from each batch on its own.
    starts = np.cumsum([0] + [b.num_rows for b in batches[:-1]])
    which = np.searchsorted(starts, rows, side="right") - 1
    order = np.argsort(which, kind="stable")
    picked, bounds = which[order], np.flatnonzero(np.diff(which[order])) + 1
    parts = [batches[int(picked[a])].take(pa.array(rows[order[a:b]] - starts[picked[a]]))
             for a, b in zip(np.r_[0, bounds], np.r_[bounds, len(rows)])]
    grouped = pa.Table.from_batches(parts, schema=table.schema).combine_chunks()  # this batch's rows only
    if np.all(order[1:] > order[:-1]):
        return grouped
    where = np.empty_like(order)
    where[order] = np.arange(len(order))
    return grouped.take(pa.array(where))


def build(spec: BatchSpec, tables: dict[int, pa.Table], convert: BatchConverter) -> Batch:
    """Convert a spec's rows to tensors, with ``sample_id`` (and ``corpus``), then its padding."""
    batch = with_ids(convert(spec_table(spec, tables)), spec.sample_id)
    if spec.corpus is not None:
        batch[CORPUS] = torch.from_numpy(np.array(spec.corpus, dtype=np.int64, copy=True))
    if spec.padding:
        batch = concat(batch, padding_like(batch, spec.padding, convert.ragged_keys))
    return batch


def pad_batch(template: Batch, rows: int, convert: BatchConverter) -> Batch:
    """A batch of ``rows`` padding rows shaped like ``template``."""
    return padding_like(template, rows, convert.ragged_keys)
