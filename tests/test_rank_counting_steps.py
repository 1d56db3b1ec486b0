"""The counting group's jobs stay in step across ranks whatever happens on one rank alone.

A later stage of a text epoch is split over the ranks by each rank's counting thread
(``streams/stage_counting.py``), gathering after every round. A rank whose thread ends a job, or skips
one, on something only it saw (its own exit, a cache it cannot write) leaves the other ranks' threads
waiting in their next gather: as long as its process lives, or up to the group's timeout. Then their
worker processes, which wait for those counts, stall the training with them. Here the ranks are two
threads of one process, each with its own counts and its own end of an exchange that stands in for the
gloo all-gather (a barrier with a timeout, so a rank left waiting shows as a slow, failed gather);
the torchrun tests in ``test_packed_text_stages.py`` drive the real group.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest

from streamshard.plan.packing_stages import StageCounts, Stages
from streamshard.streams.stage_counting import RankCounting, count_later_stages

WAIT_S = 10.0  # how long a gather waits for the other rank (the real group: SPLIT_TIMEOUT_S)
UNITS = 12


def _tokens(units: np.ndarray) -> np.ndarray:
    return np.asarray(units, dtype=np.int64) * 10 + 3


class Exchange:
    """Two ranks' all-gather: each puts its value, both read both once both are there."""

    def __init__(self) -> None:
        self.values: list[object] = [None, None]
        self.barrier = threading.Barrier(2, timeout=WAIT_S)
        self.gathers = [0, 0]
        self.left_waiting: list[int] = []  # ranks whose gather the other never joined

    def gather(self, rank: int, value: object) -> list[object]:
        self.values[rank] = value
        try:
            self.barrier.wait()  # BrokenBarrierError after WAIT_S: the other rank never came
            got = list(self.values)
            self.barrier.wait()
        except threading.BrokenBarrierError:
            self.left_waiting.append(rank)
            raise
        self.gathers[rank] += 1
        return got


class Ranks:
    """A rank's side of the counting group, as ``RankCounting`` presents it to a job."""

    def __init__(self, exchange: Exchange, rank: int) -> None:
        self.exchange, self.rank, self.world = exchange, rank, 2
        self.failed: str | None = None
        self.leaving = threading.Event()

    def gather(self, value: object) -> list[object]:
        return self.exchange.gather(self.rank, value)

    def leave(self, exc: BaseException) -> None:
        RankCounting.leave(self, exc)  # type: ignore[arg-type]  # the real bookkeeping


def _stages() -> Stages:
    return Stages(np.arange(UNITS, dtype=np.int64), np.array([0, 3, 6, 9, UNITS]))


def _job(service: Ranks, counts: StageCounts, saved, known=None) -> None:
    count_later_stages(service, counts, _stages(), known=known or (lambda: counts.tokens.copy()), count_mine=_tokens,
                       saved=saved, weights=np.ones(UNITS), round_weight=2.0)


def _two_ranks(saved_by_rank, known_by_rank=None) -> tuple[list[Ranks], list[StageCounts], Exchange]:
    exchange = Exchange()
    services = [Ranks(exchange, r) for r in range(2)]
    counts = []
    for _ in range(2):
        c = StageCounts(np.zeros(UNITS, np.int64), _tokens)
        c.fill(np.arange(3), _tokens(np.arange(3)))  # the first stage, counted by set_epoch
        counts.append(c)

    def run(r: int) -> None:
        known = (lambda: known_by_rank(r, counts[r])) if known_by_rank is not None else None
        _job(services[r], counts[r], lambda tokens: saved_by_rank(r, services[r], tokens), known)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * WAIT_S)
    assert not any(t.is_alive() for t in threads)
    return services, counts, exchange


def test_a_rank_exiting_between_stages_leaves_the_group_in_step_at_the_next_gather():
    """Rank 1's exit begins (atexit sets ``leaving``) just after a stage: it still comes to the next
    stage's first gather, says it is leaving there, and both ranks leave at once. Before, rank 1's job
    returned at the top of the next stage and rank 0 waited in a gather rank 1 never joined (as long
    as rank 1's process lived; here the exchange's timeout)."""

    def saved(rank, service, tokens):
        if rank == 1 and (tokens[3:6] >= 0).all():
            service.leaving.set()  # after stage 1, before stage 2

    services, counts, exchange = _two_ranks(saved)
    assert not exchange.left_waiting, f"rank {exchange.left_waiting} waited in a gather the other never joined"
    for service in services:
        assert service.failed is not None and "rank 1 of the counting group is exiting" in service.failed
    assert (counts[0].tokens[:6] == _tokens(np.arange(6))).all(), "the stages counted before are kept"
    assert (counts[1].tokens[6:] < 0).all(), "an exiting rank counts nothing alone"
    # rank 0 lives on: the rest is counted when its training needs it
    assert (counts[0].of(np.arange(UNITS)) == _tokens(np.arange(UNITS))).all()


@pytest.mark.parametrize("fails", ["saving", "known counts"])
def test_a_rank_whose_own_bookkeeping_fails_goes_on_splitting_with_the_others(fails):
    """An error of one rank's own, outside the gathers: rank 0's saving of a stage's counts raises, or
    rank 1's reading of the counts it knows (the cache and its workers' share: today each warns
    instead of raising, but any error there must not split the ranks): a warning, and the split goes
    on over both ranks to the last stage. Before, that rank's job ended there and the other waited in
    the next stage's gather until it timed out, then counted the rest alone."""

    def saved(rank, service, tokens):
        if fails == "saving" and rank == 0:
            raise OSError(28, "No space left on device")

    def known(rank, counts):
        if fails == "known counts" and rank == 1 and (counts.tokens[3:6] >= 0).all():
            raise ValueError("a damaged share")
        return counts.tokens.copy()

    services, counts, exchange = _two_ranks(saved, known)
    assert not exchange.left_waiting, f"rank {exchange.left_waiting} waited in a gather the other never joined"
    assert [s.failed for s in services] == [None, None]
    for c in counts:
        assert (c.tokens == _tokens(np.arange(UNITS))).all()


def test_an_exiting_rank_still_runs_the_jobs_queued_before_its_exit():
    """Two jobs queued on both ranks' counting threads; rank 1's exit begins before its thread takes
    the second: it still runs it far enough to say so at its first gather (rank 0 leaves there too),
    instead of dropping it and leaving rank 0 waiting in that job's gather."""
    exchange = Exchange()
    services, threads, counts = [], [], []
    for r in range(2):
        service = object.__new__(RankCounting)  # the real thread loop over a stand-in group
        service.rank, service.world, service.failed = r, 2, None
        service.leaving, service._jobs = threading.Event(), queue.SimpleQueue()
        service.gather = lambda value, r=r: exchange.gather(r, value)
        services.append(service)
        c = StageCounts(np.zeros(UNITS, np.int64), _tokens)
        c.fill(np.arange(3), _tokens(np.arange(3)))
        counts.append(c)
    first_done = threading.Event()

    def saved_first(r, tokens):
        if r == 1 and (tokens >= 0).all():
            services[1].leaving.set()  # rank 1 starts exiting as its first job ends
            services[1]._jobs.put(None)  # what close() adds after the jobs already queued
            first_done.set()

    for r, service in enumerate(services):
        service.add = RankCounting.add.__get__(service)
        service.add(lambda s, r=r: _job(s, counts[r], lambda tokens: saved_first(r, tokens)))
        later = StageCounts(np.zeros(UNITS, np.int64), _tokens)
        later.fill(np.arange(3), _tokens(np.arange(3)))
        service.add(lambda s, later=later: _job(s, later, lambda tokens: None))

    for r in range(2):
        threads.append(threading.Thread(target=services[r]._run))
        threads[-1].start()
    first_done.wait(2 * WAIT_S)
    services[0]._jobs.put(None)
    for t in threads:
        t.join(3 * WAIT_S)
    assert not any(t.is_alive() for t in threads)
    assert not exchange.left_waiting, f"rank {exchange.left_waiting} waited in a gather the other never joined"
    assert exchange.gathers[0] == exchange.gathers[1]
    for service in services:
        assert service.failed is not None and "rank 1 of the counting group is exiting" in service.failed


@pytest.fixture(autouse=True)
def _quiet_warnings(caplog):
    caplog.set_level("ERROR", logger="streamshard")
