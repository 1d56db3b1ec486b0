"""A simulated preemption for the Lightning job scripts: every rank exits at once, at the same step.

Each rank calls ``exit_together`` at the start of the step it is preempted at. A rank that simply
called ``os._exit`` there could exit while its peer still finished the last step's gradient
all-reduce, which then failed with a lost connection (exit 1) instead of the preemption the job
simulates (CI, 1 run of many). So the ranks first meet at a file barrier (no collective: the process
group may be mid-operation), then exit with the preemption's code.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PREEMPTED = 75  # the exit code the tests expect of a preempted job
BARRIER_S = 60.0  # the longest a rank waits for the others before it exits anyway


def exit_together(directory: Path, rank: int, world_size: int, code: int = PREEMPTED) -> None:
    """Mark ``rank`` as arrived in ``directory``, wait until all ``world_size`` ranks have, then ``os._exit(code)``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank{rank}").touch()
    deadline = time.monotonic() + BARRIER_S
    while len(list(directory.glob("rank*"))) < world_size and time.monotonic() < deadline:
        time.sleep(0.01)
    os._exit(code)
