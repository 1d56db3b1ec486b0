"""A fork waits for the imports other threads of this process have in progress.

A DataLoader forks its worker processes from the training loop's thread while the package's
background threads (a raw-text pack's counting thread, the catalog's pyarrow warm-up) may be
importing a module lazily: numpy's ``np.unique`` imports ``numpy.ma`` on first use, pyarrow imports
pandas on its first ``pa.array()``. A child forked in the middle inherits the half-made module in
``sys.modules`` and its import lock held by a thread the child does not have: the child's own use of
it then fails (every ``np.unique`` of a worker raised ``RecursionError``) or waits forever.

So before every fork of this process (``os.register_at_fork``, once the package is imported) the
forking thread waits, up to ``FORK_WAITS_FOR_IMPORTS_S``, until no module is being imported by another
thread: a module is being imported while its spec says ``_initializing`` (set by importlib for the
whole of its execution), and the forking thread's own imports in progress (a module that forks while
it is imported) are the modules of the ``<module>`` frames on its own stack, which it does not wait for.
Imports take milliseconds (pandas: ~0.2 s), forks are rare (a pass's worker start): a fork checks
``sys.modules`` once (~1 ms) when nothing is being imported. Registered when the package is imported.
"""

from __future__ import annotations

import os
import sys
import time

FORK_WAITS_FOR_IMPORTS_S = 10.0  # the most a fork waits for other threads' imports (then it forks anyway)
_POLL_S = 0.002
_given_up: set[str] = set()  # imports a fork waited for in vain (a module whose top level never returns)


def imports_in_progress() -> set[str]:
    """The modules some thread of this process is importing now (their specs say ``_initializing``)."""
    busy = set()
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if spec is not None and getattr(spec, "_initializing", False):
            busy.add(name)
    return busy


def _imported_by_this_thread() -> set[str]:
    """The modules whose top level is on this thread's stack (imports this thread has in progress)."""
    names, frame = set(), sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            names.add(frame.f_globals.get("__name__", ""))
        frame = frame.f_back
    return names


def wait_for_other_threads_imports(timeout: float | None = None) -> bool:
    """Wait until no thread but this one is importing a module, at most ``timeout`` seconds (None:
    ``FORK_WAITS_FOR_IMPORTS_S``); whether none was when it returned. An import waited for in vain is
    not waited for again (a module whose top level runs for good would otherwise delay every fork)."""
    deadline = time.monotonic() + (FORK_WAITS_FOR_IMPORTS_S if timeout is None else timeout)
    while True:
        others = imports_in_progress() - _imported_by_this_thread() - _given_up
        if not others:
            return True
        if time.monotonic() >= deadline:
            _given_up.update(others)
            return False
        time.sleep(_POLL_S)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=wait_for_other_threads_imports)
