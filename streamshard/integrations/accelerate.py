"""Accelerate: refuse, before the first batch, the ways of preparing a stream that would lose rows."""

from __future__ import annotations

from typing import Any


def check_pass_context(stream: Any) -> None:
    """Called at the start of every pass of a stream; raises where Accelerate's wrapping would lose rows.

    (Being written: see the Accelerate tests.)
    """
