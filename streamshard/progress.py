"""Progress for the long subcommands and a cold token count: a live bar on a terminal, nothing in a log or a pipe.

A bar is redrawn with carriage returns, which a log file keeps as ``^M`` noise, so it is drawn only
when stderr is a terminal. It never touches stdout, where ``--json`` goes.

A bar that is not drawn is a ``NoBar``, not a disabled tqdm: tqdm takes a process-wide lock to make
even a disabled bar, and a DataLoader worker forked while another thread of its parent held that
lock (a counting thread making its bar) inherited it held by a thread it does not have, so its own
first bar waited forever (the worker hung, and with it the training loop). A child forked while a
drawn bar's lock is held gets a fresh thread lock (``os.register_at_fork``) for the same reason.
"""

from __future__ import annotations

import os
import threading
from typing import Any, TextIO

from tqdm import tqdm
from tqdm.std import TqdmDefaultWriteLock

__all__ = ["NoBar", "progress_bar"]


class NoBar:
    """A bar that draws nothing and takes no lock: what ``progress_bar`` gives when nothing is shown."""

    def update(self, n: float = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "NoBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def progress_bar(err: TextIO, *, total: int | None, unit: str, desc: str, quiet: bool = False) -> tqdm | NoBar:
    """A tqdm bar on ``err`` counting ``unit``; a ``NoBar`` if ``quiet`` or ``err`` is no terminal."""
    if quiet or not _is_terminal(err):
        return NoBar()
    return tqdm(total=total, unit=unit, desc=desc, file=err, unit_scale=True, dynamic_ncols=True, leave=True)


def _is_terminal(err: TextIO) -> bool:
    try:
        return bool(err.isatty())
    except (AttributeError, ValueError, OSError):  # closed, or not a real stream
        return False


def _fresh_lock_in_child() -> None:
    """In a forked child: tqdm's thread lock anew (the parent's may have been held by a thread the child
    lacks). Its process lock is a semaphore shared with the parent, which the parent's holder releases;
    the child forgets the parent's hold count on it (as ``multiprocessing`` does for its own children),
    or the child's release would leave the semaphore taken and every process's next bar waiting."""
    TqdmDefaultWriteLock.th_lock = threading.RLock()
    process_lock = getattr(TqdmDefaultWriteLock, "mp_lock", None)
    after_fork = getattr(getattr(process_lock, "_semlock", None), "_after_fork", None)
    if callable(after_fork):
        after_fork()
    if "_lock" in vars(tqdm):
        tqdm.set_lock(TqdmDefaultWriteLock())


os.register_at_fork(after_in_child=_fresh_lock_in_child)
