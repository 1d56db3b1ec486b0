"""The few ``torch.distributed`` collectives the catalog build uses, on JSON-safe data.

torch is never imported here: if the program has not imported ``torch.distributed`` it cannot
have initialised a process group, and the build runs single-process.
"""

from __future__ import annotations

import json
import sys
from typing import Any


class CollectiveFailed(RuntimeError):
    """A collective that did not complete on this rank (a rank gone, the group destroyed, a timeout);
    the error it raised is its ``__cause__``. ``counts``: what the failed work had in hand (or None)."""

    counts: Any = None


def process_group(group: Any = None) -> tuple[int, int] | None:
    """``(rank, world_size)`` in ``group`` (None: the default group) when torch.distributed is
    initialised and the group has more than one rank."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    world = dist.get_world_size(group)
    return (dist.get_rank(group), world) if world > 1 else None


def broadcast(value: Any, group: Any = None) -> Any:
    """``value`` of the group's first rank on every rank of ``group`` (sent as a JSON string)."""
    dist = sys.modules["torch.distributed"]
    box = [json.dumps(value) if dist.get_rank(group) == 0 else None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return json.loads(box[0])


def all_gather(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value``, in group rank order, on every rank of ``group`` (each sent as JSON)."""
    dist = sys.modules["torch.distributed"]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, json.dumps(value), group=group)
    return [json.loads(item) for item in out]
