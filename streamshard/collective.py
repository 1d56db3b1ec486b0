"""The few ``torch.distributed`` collectives the catalog build uses, on JSON-safe data.

torch is never imported here: if the program has not imported ``torch.distributed`` it cannot
have initialised a process group, and the build runs single-process.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def process_group() -> tuple[int, int] | None:
    """``(rank, world_size)`` when torch.distributed is initialised with more than one rank."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    world = dist.get_world_size()
    return (dist.get_rank(), world) if world > 1 else None


def broadcast(value: Any, src: int = 0) -> Any:
    """``value`` of rank ``src`` on every rank (sent as a JSON string)."""
    dist = sys.modules["torch.distributed"]
    box = [json.dumps(value) if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return json.loads(box[0])


def all_gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank (each sent as a JSON string)."""
    dist = sys.modules["torch.distributed"]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, json.dumps(value))
    return [json.loads(item) for item in out]
