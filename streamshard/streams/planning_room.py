"""Refuse a worker's share of a row group whose planning would not fit in memory, naming the row group.

A footer whose column chunks agree with a huge row count (2**31 rows in a 13 KB file) passes the
catalog's checks, and planning a worker's share allocates per-row arrays (positions, row numbers under
the shuffle, piece labels) before a single byte is read. Allocating them past the memory left ends in a
``MemoryError`` naming nothing, or in the OOM killer. Every stream that plans rows of a catalog's row
groups (``ParquetStream``; ``PackedStream`` over its documents) checks its schedule here first.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import CatalogError
from ..io.memory_room import available_bytes
from ..plan.batch_plan import StreamSchedule

# Bytes a planned row takes while a worker plans its share of a row group: its position, its row number
# under the shuffle, sorted, and the piece labels of a batch (int64 arrays, a few alive at once).
PLANNED_ROW_BYTES = 40
CHECKED_ABOVE = 64 << 20  # shares whose planning arrays stay under this are not checked


def check_planning_room(schedule: StreamSchedule, place: Callable[[int], str], totals: np.ndarray,
                        unit: str = "rows") -> None:
    """Raise ``CatalogError`` naming the row group when this worker's largest share of one would need more
    memory to plan than this process has left (``io/memory_room.py``). ``place(rg)`` names a row group,
    ``totals[rg]`` is its size in the schedule's ``unit`` (rows; tokens for a pack)."""
    rows = schedule.pieces.rows
    if not len(rows) or int(rows.max()) * PLANNED_ROW_BYTES <= CHECKED_ABOVE:
        return
    largest = int(np.argmax(rows))
    need, room = int(rows[largest]) * PLANNED_ROW_BYTES, available_bytes()
    if need > room:
        rg = int(schedule.pieces.rg[largest])
        raise CatalogError(f"{place(rg)}: this worker's {int(rows[largest])} of its {int(totals[rg])} {unit} "
                           f"need {need / 2**30:.1f} GiB to plan, and {room / 2**30:.1f} GiB of memory is left: "
                           "the footer's counts are damaged, or the row group is too large for this machine "
                           "(rewrite it with smaller row groups, or use more workers)")
