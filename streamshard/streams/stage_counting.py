"""Counting a raw-text epoch's later stages beside training, split over the ranks of a process group.

A text epoch is planned in stages (``plan/packing_stages.py``); ``PackedStream.set_epoch`` counts the
first over the ranks, and the later ones are counted on a background thread while training runs.
Alone, that thread tokenizes the whole corpus on every rank, and a data-bound rank (tokenizing what
it reads as fast as it can) cannot count a stage before training reaches it. Here the ranks split
each later stage (``io/text_counts.count_over_ranks``), so each tokenizes about 1/world of it.

Collectives from a thread need a group of their own (the training loop's collectives on the default
group go on meanwhile) and the same order on every rank: ``RankCounting`` is one gloo backend per
process over the ranks of the group that counted the first stage (the default group, or the
data-parallel group of a device mesh: ``ParquetStream(mesh=mesh["dp"])``), with group-local ranks,
over the default store under a prefix of that group's own (its global ranks, and how many counting
groups of those ranks this process made before: every data-parallel group of a mesh has its own).
It is made in the main thread, where the first stage is already counted collectively over that
group, so each of its ranks makes it in the same order; not registered with ``torch.distributed``,
so the training's ``destroy_process_group`` leaves it be. One daemon thread runs the jobs
``set_epoch`` gives it, one after the other; a job's collectives follow from gathered data only,
never from what one rank happened to count meanwhile. Ranks of different data-parallel groups read
the same data and count the same stages, each group on its own.

Counts are deterministic (the same bytes and tokenizer give the same count), so the split only
makes them come sooner: when a collective fails (a rank ended its training and exited, or destroyed
its process group; a timeout of ``SPLIT_TIMEOUT_S`` where a rank lives on without counting), this
rank counts the rest alone, for good (the group is left), with the same results. No rank waits
longer than one timeout for another. At the interpreter's exit (``atexit``) a rank still in the
group says so at its next gather (at most one round's count away) and every rank leaves at that same
gather, so no process ends inside a collective (gloo then aborts it) and none waits for one that
will not come. Without a process group (one process, DataLoader worker processes) nothing here
runs: the stages are counted alone as before. A rank's DataLoader worker processes never join the
group: they wait for what it counts (a claim of the later stages in their count share, made when
the job is added, beaten every round, released when the job ends, or a staged blend's corpus's last
job ends, or the rank leaves the group;
the counts published there stage by stage: ``io/count_share.py``) instead of counting it again.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable

import numpy as np
# Imported up front, in the thread that imports the package, not lazily by np.unique's first call in the
# counting thread: a torchrun test's rank died with RecursionError in numpy's __getattr__ importing
# numpy.ma while the training loop and the counting thread both needed it (a fork during the import is
# io/fork_imports.py's to prevent; two threads importing it at once is not).
import numpy.ma  # noqa: F401

from ..io.collective import CollectiveFailed
from ..io.count_share import Claim
from ..io.text_counts import count_over_ranks
from ..plan.packing_stages import StageCounts, Stages

SPLIT_TIMEOUT_S = 120.0  # a collective of the counting group waits this long for a rank (one round's count)

log = logging.getLogger("streamshard")

_services: list["RankCounting"] = []  # one per process group this process has counted under
_services_lock = threading.Lock()


class RankCounting:
    """The counting group of a process group (the default one or a mesh's data-parallel one) and the
    daemon thread issuing its collectives."""

    def __init__(self, parent: Any) -> None:
        import torch.distributed as dist

        # the group it was made for (a new init_process_group or mesh: a new one)
        self.parent = weakref.ref(parent)
        self.ranks = tuple(dist.get_process_group_ranks(parent))  # global ranks, in group rank order
        self.rank, self.world, self.pid = dist.get_rank(parent), dist.get_world_size(parent), os.getpid()
        # A gloo backend of our own over the default store, not a registered group: the training's
        # destroy_process_group() (often called while this thread still counts) leaves it working, so
        # the exit below can leave it in step with the other ranks. Its prefix is the group's own: the
        # mesh's other data-parallel groups make theirs at the same time over the same store.
        made = sum(service.ranks == self.ranks for service in _services)
        prefix = f"streamshard/count-stages/{'-'.join(map(str, self.ranks))}/{made}"
        store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
        self.group: Any = dist.ProcessGroupGloo(store, self.rank, self.world, timedelta(seconds=SPLIT_TIMEOUT_S))
        self.failed: str | None = None  # why this rank left the group (then it counts alone)
        self.leaving = threading.Event()  # this process is exiting: say so at the next gather, then stop
        self._jobs: queue.SimpleQueue[Callable[["RankCounting"], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="streamshard-count-ranks")
        self._thread.start()

    def add(self, job: Callable[["RankCounting"], None]) -> None:
        """Run ``job(self)`` after the jobs added before it (every rank adds the same jobs in the same order)."""
        self._jobs.put(job)

    def _run(self) -> None:
        # Every job runs, exiting or not: a job leaves the group at its first gather, in step with the
        # other ranks (a rank that skipped jobs on its own exit left the others waiting in their gather
        # for as long as its process lived), and finds the group left in the jobs after it.
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job(self)
            except Exception as exc:  # noqa: BLE001 - a job's own failures are logged by it; never end the thread
                log.warning("counting beside training failed (%s: %s)", type(exc).__name__, exc)

    def close(self) -> None:
        """At the interpreter's exit: leave the group in step with the others (the next gather says so:
        at most one round's count away), then drop it, so no collective of this thread is half-done
        when the process ends (gloo aborts the process when one is). Waits at most ``SPLIT_TIMEOUT_S``
        past that round; not at all where this rank left the group already."""
        if os.getpid() != self.pid:
            return  # a forked child (it has neither the thread nor a share in the group): leave them be
        self.leaving.set()
        self._jobs.put(None)  # wakes an idle thread
        if self.failed is None:  # else it left the group already (and may be counting alone: not waited for)
            self._thread.join(SPLIT_TIMEOUT_S + 10)
            if self._thread.is_alive():
                return  # still inside a gather with a rank that lives on silent: left to the teardown
        self.group = None  # the last reference: the group's threads end now, not in the interpreter's teardown

    def gather(self, value: Any) -> list[Any]:
        """Every rank's JSON-safe ``value``, in rank order (two all-gathers: sizes, then the padded bytes)."""
        import torch

        data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self.group.allgather([sizes], [torch.tensor([data.numel()], dtype=torch.int64)]).wait()
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:data.numel()] = data
        out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world)]
        self.group.allgather([out], [padded]).wait()
        return [json.loads(o[:int(s.item())].numpy().tobytes()) for o, s in zip(out, sizes)]

    def leave(self, exc: BaseException) -> None:
        if self.failed is None:
            self.failed = f"{type(exc).__name__}: {exc}"
            if not self.leaving.is_set():
                log.warning("counting over the ranks stopped (%s); this rank counts the rest of the text stages "
                            "alone", self.failed)


def rank_counting(group: Any = None) -> RankCounting | None:
    """This process's counting group over the ranks of ``group`` (None: the current default process
    group; else e.g. a mesh's data-parallel group), made on first call: in the main thread, at a point
    every rank of ``group`` reaches in the same order. None where it cannot be made (a warning: the
    stages are then counted alone)."""
    import torch.distributed as dist

    parent = group if group is not None else dist.distributed_c10d._get_default_group()
    with _services_lock:
        for service in _services:
            if service.parent() is parent:
                return service
        try:
            service = RankCounting(parent)
        except Exception as exc:  # noqa: BLE001 - e.g. gloo cannot find a network interface: count alone
            log.warning("the later text stages are counted by each rank alone: no gloo group for counting "
                        "(%s: %s)", type(exc).__name__, exc)
            return None
        if not _services:
            atexit.register(_close_all)
        _services.append(service)
        return service


def _close_all() -> None:
    for service in _services:
        service.close()


def count_later_stages(service: RankCounting, counts: StageCounts, stages: Stages, known: Callable[[], np.ndarray],
                       count_mine: Callable[[np.ndarray], np.ndarray], saved: Callable[[np.ndarray], None],
                       weights: np.ndarray, round_weight: float, claim: Claim | None = None,
                       last: bool = True) -> None:
    """A job of ``service``: count stages ``1..`` of an epoch in order, each split over the ranks while the
    group works (``known()``: this rank's counts, the cache's included; ``count_mine``: count row groups
    alone; ``saved``: keep the counts, e.g. in the cache and for this rank's worker processes), else
    alone (``counts.of``). Training that needs a stage being split waits for it
    (``StageCounts.claimed``) instead of counting it again; so do this rank's worker processes while
    ``claim`` (of the later stages, made when the job was added: ``io/count_share.py``) lives: it is
    beaten every round and released when the job ends (``last``: else the claim goes on to the next
    job, e.g. a blend's corpus's next stage) or this rank leaves the group. A count that fails (on
    any rank: every rank learns it) ends the job as the lone count's failure does: whoever needs that
    stage counts it and raises, naming the file and row group."""
    try:
        _count_later_stages(service, counts, stages, known, count_mine, saved, weights, round_weight, claim)
    finally:
        if claim is not None and last:
            claim.release()


def _count_later_stages(service: RankCounting, counts: StageCounts, stages: Stages, known: Callable[[], np.ndarray],
                        count_mine: Callable[[np.ndarray], np.ndarray], saved: Callable[[np.ndarray], None],
                        weights: np.ndarray, round_weight: float, claim: Claim | None) -> None:
    beat = claim.beat if claim is not None else (lambda: None)
    for k in range(1, len(stages)):
        # No return here on this rank's own exit: whether a stage's gathers happen is decided from
        # gathered data only (its first gather says this rank is leaving, and every rank leaves there).
        units = stages.units(k)
        if service.failed is None:
            try:
                with counts.claimed(units):
                    counts.fill(units, count_over_ranks(units, _known(known, counts), count_mine, service.gather,
                                                        (service.rank, service.world), weights, round_weight,
                                                        service.leaving.is_set, beat))
                _keep(saved, counts)
                continue
            except CollectiveFailed as exc:
                if exc.counts is not None:  # this rank's share and the shares gathered before: kept
                    counts.fill(units, exc.counts[units])
                    _keep(saved, counts)  # and shared with the workers before the claim goes
                service.leave(exc.__cause__ or exc)
            except Exception as exc:  # noqa: BLE001 - training counts the stage itself when it gets there
                _stage_failed(k, stages, exc)
                return
        if service.leaving.is_set():
            return  # the group is left (in step, or before): an exiting process counts nothing alone
        if claim is not None:
            claim.release()  # counted alone from here, as the workers may count: through their share's lock
        try:
            counts.of(units)
        except Exception as exc:  # noqa: BLE001 - as above
            _stage_failed(k, stages, exc)
            return


def count_later_stages_alone(counts: StageCounts, stages: Stages) -> None:
    """A background thread's work without a process group: count the stages after the first, in order."""
    for k in range(1, len(stages)):
        try:
            counts.of(stages.units(k))
        except Exception as exc:  # noqa: BLE001 - training counts the stage itself when it gets there
            _stage_failed(k, stages, exc)
            return


def _known(known: Callable[[], np.ndarray], counts: StageCounts) -> np.ndarray:
    """This rank's counts for a split (``known()``), or only those in hand where that fails. Never
    raises: a rank whose job ended on an error of its own would leave the others waiting in a gather
    (only a count's failure, which every rank learns at the same gather, ends a job on every rank)."""
    try:
        return known()
    except Exception as exc:  # noqa: BLE001 - what is not known here is counted again, in the split
        log.warning("token counts of the cache or of this rank's worker processes not used (%s: %s)",
                    type(exc).__name__, exc)
        return counts.tokens.copy()


def _keep(saved: Callable[[np.ndarray], None], counts: StageCounts) -> None:
    try:
        saved(counts.tokens)
    except Exception as exc:  # noqa: BLE001 - what is not kept is counted again where needed
        log.warning("token counts not kept (%s: %s)", type(exc).__name__, exc)


def _stage_failed(k: int, stages: Stages, exc: BaseException) -> None:
    if not threading.main_thread().is_alive():
        return  # the interpreter is exiting
    log.warning("counting stage %d of %d in the background failed (%s: %s); it is counted when training "
                "reaches it", k, len(stages), type(exc).__name__, exc)
