"""Accelerate: refuse, before the first batch, the ways of preparing a stream that would lose rows.

``accelerator.prepare(ss.StreamLoader(ds, ...))`` is the supported path: ``prepare`` returns an object
that is not a ``DataLoader``, module, optimizer or scheduler as it is, and the stream already splits
its rows by data-parallel rank. A plain ``DataLoader`` of a stream handed to ``prepare`` is wrapped
(``accelerate/data_loader.py``, 1.x) in one of two ways, and neither is exact for a stream:

* ``DataLoaderDispatcher`` (``dispatch_batches=True``, the default for an ``IterableDataset`` when
  batches go to a device): process 0 alone iterates, reading only rank 0's share, concatenates one
  batch per process and slices every tensor by the first tensor's length: the other ranks' rows are
  never read, list columns of different widths fail to concatenate, flat list values are cut.
* ``DataLoaderShard`` over ``IterableDatasetShard`` (``dispatch_batches=False``, several processes):
  each rank keeps one of every ``num_processes`` items of its own share (and fails on
  ``batch_size=None``): the other items are never trained.

Both adapters register themselves in Accelerate's ``GradientState`` (its documented
``dataloader_references``) and call ``dataset.set_epoch`` before they create the inner iterator; an
``IterableDatasetShard`` is the dataset a DataLoader worker sees (``get_worker_info().dataset``). That
is what ``check_pass_context`` looks at. Accelerate is never imported here: a process that has not
imported it cannot have prepared anything.
"""

from __future__ import annotations

import sys
from typing import Any

from ..errors import TopologyError

_DEPTH = 8  # how far a chain of wrapping datasets (``.dataset``) is followed


def check_pass_context(stream: Any) -> None:
    """Raise ``TopologyError`` where an Accelerate adapter around a plain ``DataLoader`` is about to
    iterate ``stream`` (it would lose or cut rows); a dict lookup in a process without Accelerate.

    Called by the stream in ``set_epoch`` and at the start of every pass. ``set_epoch`` is the call
    that catches every configuration on every rank before any batch and any collective: both adapters
    call it in the main process of every rank before they create the inner iterator (a pass starts
    later, in a DataLoader worker, and with ``dispatch_batches`` on process 0 only)."""
    data_loader = sys.modules.get("accelerate.data_loader")
    if data_loader is None:
        return
    wrapper = _worker_shard(stream, data_loader) or _registered_adapter(stream, data_loader)
    if wrapper is not None:
        raise TopologyError(_message(type(stream).__name__, *wrapper))


def _worker_shard(stream: Any, data_loader: Any) -> tuple[str, int] | None:
    """In a DataLoader worker: the dataset it was given, if an ``IterableDatasetShard`` wraps ``stream``
    (seen under every start method: the worker unpickles the wrapper with the stream)."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is None:
        return None
    chain = _chain(info.dataset, stream)
    shard = _first(chain, data_loader.IterableDatasetShard)
    return None if shard is None else ("IterableDatasetShard", getattr(shard, "num_processes", 0))


def _registered_adapter(stream: Any, data_loader: Any) -> tuple[str, int] | None:
    """An adapter being iterated over ``stream``, from Accelerate's ``GradientState`` (the process
    that iterates it, and DataLoader workers forked from it)."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return None
    for adapter in state.GradientState().dataloader_references:  # (a singleton; set up by any adapter)
        base = getattr(adapter, "base_dataloader", None) if adapter is not None else None
        chain = _chain(getattr(base, "dataset", None), stream)
        if not chain:
            continue
        shard = _first(chain, data_loader.IterableDatasetShard)
        if shard is not None:
            return "IterableDatasetShard", getattr(shard, "num_processes", 0)
        if isinstance(adapter, data_loader.DataLoaderDispatcher):
            return "DataLoaderDispatcher", getattr(getattr(adapter, "state", None), "num_processes", 0)
    return None


def _chain(dataset: Any, stream: Any) -> list[Any]:
    """``dataset``, ``dataset.dataset``, ... down to ``stream``; empty if ``stream`` is not reached."""
    chain = []
    for _ in range(_DEPTH):
        if dataset is None:
            return []
        chain.append(dataset)
        if dataset is stream:
            return chain
        dataset = getattr(dataset, "dataset", None)
    return []


def _first(chain: list[Any], kind: type) -> Any:
    return next((item for item in chain if isinstance(item, kind)), None)


def _message(name: str, wrapper: str, processes: int) -> str:
    on = f" on {processes} processes" if processes > 1 else ""
    if wrapper == "DataLoaderDispatcher":
        what = ("Accelerate's DataLoaderDispatcher (dispatch_batches=True, its default for an IterableDataset) "
                f"iterates the {name} on process 0 only, which reads only rank 0's rows, and re-slices its batches "
                "by the first tensor's length: the other ranks' rows would never be trained and list columns "
                "would be cut")
    else:
        what = (f"Accelerate's IterableDatasetShard (dispatch_batches=False{on}) keeps one of every "
                f"{processes or 'N'} batches of each rank's {name}, which already holds only that rank's rows: "
                "the other batches would never be trained")
    return (f"a plain DataLoader of a {name} was handed to accelerator.prepare(){on}: {what}. A streamshard stream "
            "splits its rows by rank itself: give Accelerate a StreamLoader instead, "
            "`loader = accelerator.prepare(ss.StreamLoader(ds, num_workers=N))` (prepare returns it unchanged; "
            "pass device=accelerator.device to StreamLoader for device batches), and "
            "`accelerator.register_for_checkpointing(loader)` to resume exactly; or keep the DataLoader out of "
            "prepare(). No DataLoaderConfiguration makes a prepared plain DataLoader of a stream exact on more "
            "than one process (on one process, DataLoaderConfiguration(dispatch_batches=False) does)")
