"""Argument checks shared by every public constructor: one place, one wording."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: both a TypeError and a ValueError, so either handler catches it."""


def check_int(value: Any, name: str, low: int | None = None, high: int | None = None, *, none_ok: bool = False) -> Any:
    """``value`` as an int in ``[low, high]`` (either bound optional); ValueError naming ``name`` otherwise."""
    if value is None and none_ok:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be an int{_bounds(low, high)}, got bool {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ArgumentTypeError(
            f"{name} must be an int{_bounds(low, high)}{' or None' if none_ok else ''}, got {type(value).__name__} {value!r}"
        ) from None
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be an int{_bounds(low, high)}, got {value}")
    return value


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _bounds(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f" in [{low}, {high}]"
    if low is not None:
        return f" >= {low}"
    if high is not None:
        return f" <= {high}"
    return ""
