"""Apply a function to every tensor in a nested batch, keeping the batch's structure.

A batch is a tensor or any nesting of mappings, lists, tuples, namedtuples and dataclass
instances around tensors. The device prefetcher uses this to stage and move every tensor of
a batch without knowing its layout; containers without tensors come back untouched.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["map_tensors"]


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """Return ``batch`` with ``fn`` applied to every tensor leaf, keeping the structure.

    Walks dicts (and other mappings), lists, tuples, namedtuples and dataclass instances.
    Every other leaf (strings, numbers, ``None``, numpy arrays, ...) is returned as is, and a
    container holding no tensor is returned as the very same object.
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return _map_mapping(fn, batch)
    if isinstance(batch, (list, tuple)):
        return _map_sequence(fn, batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return _map_dataclass(fn, batch)
    return batch


def _map_mapping(fn: Callable[[torch.Tensor], Any], batch: Mapping) -> Any:
    items = {key: map_tensors(fn, value) for key, value in batch.items()}
    if all(items[key] is value for key, value in batch.items()):
        return batch
    if type(batch) is dict:
        return items
    try:  # keep the mapping's own type (OrderedDict, defaultdict, ...) when it copies
        clone = copy.copy(batch)
        clone.update(items)
        return clone
    except (TypeError, AttributeError):
        return items


def _map_sequence(fn: Callable[[torch.Tensor], Any], batch: list | tuple) -> Any:
    items = [map_tensors(fn, value) for value in batch]
    if all(new is old for new, old in zip(items, batch)):
        return batch
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*items)
    if type(batch) in (list, tuple):
        return type(batch)(items)
    try:
        return type(batch)(items)
    except TypeError:
        return items


def _map_dataclass(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    mapped = {name: map_tensors(fn, value) for name, value in fields.items()}
    if all(mapped[name] is value for name, value in fields.items()):
        return batch
    # copy + object.__setattr__ works for frozen and init=False fields and skips __post_init__
    clone = copy.copy(batch)
    for name, value in mapped.items():
        object.__setattr__(clone, name, value)
    return clone
