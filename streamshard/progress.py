"""Progress for the long subcommands: a live bar on a terminal, nothing in a log or a pipe.

A bar is redrawn with carriage returns, which a log file keeps as ``^M`` noise, so it is drawn only
when stderr is a terminal (tqdm's ``disable=None``). It never touches stdout, where ``--json`` goes.
"""

from __future__ import annotations

from typing import TextIO

from tqdm import tqdm

__all__ = ["progress_bar"]


def progress_bar(err: TextIO, *, total: int | None, unit: str, desc: str, quiet: bool = False) -> tqdm:
    """A tqdm bar on ``err`` counting ``unit``; inert (updates cost nothing) if ``quiet`` or ``err`` is no TTY."""
    return tqdm(total=total, unit=unit, desc=desc, file=err, disable=True if quiet else None,
                unit_scale=True, dynamic_ncols=True, leave=True)
