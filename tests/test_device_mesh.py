"""The data-parallel rank under tensor parallelism: 4 processes as a ("dp", "tp") = (2, 2) DeviceMesh,
under torchrun + gloo on CPU. The two tp ranks of a dp group get the same batches; the dp groups split
the data exactly once. torch.distributed's default group has 4 ranks while the data's world has 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from streamshard.testing import write_corpus

from launch import check, launch

pytestmark = pytest.mark.slow  # subprocesses: run by make test, skippable with -m "not slow"

JOB = Path(__file__).resolve().parent / "frameworks" / "mesh_job.py"
LAYOUT = [[200, 150, 260]] + [[3]] * 6 + [[]] + [[0, 5, 0]] + [[40, 1, 90]]
NUM_ROWS = sum(map(sum, LAYOUT))


def torchrun(*args: str, timeout: float) -> list[dict]:
    """``mesh_job.py`` on 4 processes; every process's report (a stuck rank prints its threads' stacks)."""
    check(launch(4, JOB, *args, timeout=timeout, env={"STREAMSHARD_JOB_DUMP_AFTER": str(timeout - 20)}))
    report = Path(args[args.index("--report") + 1])
    return [json.loads((report / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mesh")
    write_corpus(str(root / "data"), LAYOUT)
    return root


@pytest.mark.parametrize("via", ["mesh", "explicit"])
def test_tp_ranks_of_a_dp_group_get_the_same_batches_and_dp_groups_split_the_data_once(corpus, via):
    """``ParquetStream(mesh=mesh["dp"])``, or ``rank=``/``world_size=`` read from it."""
    ranks = torchrun("--data", str(corpus / "data"), "--report", str(corpus / via), "--via", via, timeout=180)
    assert [(r["dp"], r["tp"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for epoch in range(2):
        passes = [r["passes"][epoch] for r in ranks]
        assert all(p["epoch"] == epoch for p in passes)
        assert passes[0]["batches"] == passes[1]["batches"]  # dp group 0: its two tp ranks
        assert passes[2]["batches"] == passes[3]["batches"]  # dp group 1
        assert len(passes[0]["batches"]) == len(passes[2]["batches"]) == passes[0]["len"]  # equal steps
        ids = np.array([i for p in (passes[0], passes[2]) for batch in p["batches"] for i in batch])
        np.testing.assert_array_equal(np.sort(ids), np.arange(NUM_ROWS))
    assert ranks[0]["passes"][0]["batches"] != ranks[0]["passes"][1]["batches"]  # each epoch its own order
    assert len({json.dumps(r["state"], sort_keys=True) for r in ranks}) == 1  # one checkpoint serves every rank


@pytest.mark.parametrize("via", ["mesh", "explicit"])  # the mesh's group splits the reads; explicit ranks read all
def test_only_one_tp_rank_per_dp_group_reading_does_not_hang(corpus, via):
    """As a pipeline's first stage (or Megatron's tp rank 0) reads for its group: ranks 1 and 3 never
    touch the data, so nothing may wait for them in a collective over all 4 processes."""
    ranks = torchrun("--data", str(corpus / "data"), "--report", str(corpus / f"first-tp-{via}"), "--readers",
                     "first-tp", "--via", via, timeout=60)
    readers = [ranks[0]["passes"], ranks[2]["passes"]]
    assert ranks[1]["passes"] == ranks[3]["passes"] == []
    for epoch in range(2):
        ids = np.array([i for passes in readers for batch in passes[epoch]["batches"] for i in batch])
        np.testing.assert_array_equal(np.sort(ids), np.arange(NUM_ROWS))
