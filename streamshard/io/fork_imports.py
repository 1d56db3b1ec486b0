"""A fork waits for the imports other threads of this process have in progress.

A DataLoader forks its worker processes from the training loop's thread while the package's
background threads (a raw-text pack's counting thread, the catalog's pyarrow warm-up) may be
importing a module lazily: numpy's ``np.unique`` imports ``numpy.ma`` on first use, pyarrow imports
pandas on its first ``pa.array()``. A child forked in the middle inherits the half-made import: its
module lock held by a thread the child does not have (the child's own import of it waits forever:
tests/test_fork_safety.py), or the module in ``sys.modules`` not yet bound to its package (numpy's
lazy ``__getattr__`` then recurses).

So before every fork of this process (``os.register_at_fork``, once the package is imported) the
forking thread waits, up to ``FORK_WAITS_FOR_IMPORTS_S``, until no other thread holds a module's
import lock: CPython's importlib holds it from the module's lookup to its binding in its package,
the whole window a child must not see. The forking thread's own imports (a module that forks while
it is imported) are not waited for. An import waited for in vain is not waited for again (a module
whose top level runs for good would otherwise delay every fork). Imports take milliseconds (pandas:
~0.2 s), forks are rare (a pass's worker start): a fork looks at the locks once when none is held.
The locks are importlib's own (``_frozen_importlib._module_locks``, CPython); where an interpreter has
none, a fork does not wait.
"""

from __future__ import annotations

import os
import threading
import time

FORK_WAITS_FOR_IMPORTS_S = 10.0  # the most a fork waits for other threads' imports (then it forks anyway)
_POLL_S = 0.002
_given_up: set[str] = set()  # imports a fork waited for in vain


def imports_in_progress() -> dict[str, int]:
    """The modules some thread of this process is importing now, and that thread's id (the owner of
    the module's import lock)."""
    try:
        import _frozen_importlib

        locks = list(_frozen_importlib._module_locks.items())
    except (ImportError, AttributeError):
        return {}
    busy = {}
    for name, ref in locks:
        lock = ref()
        owner = getattr(lock, "owner", None)
        if owner is not None:
            busy[name] = owner
    return busy


def wait_for_other_threads_imports(timeout: float | None = None) -> bool:
    """Wait until no thread but this one is importing a module, at most ``timeout`` seconds (None:
    ``FORK_WAITS_FOR_IMPORTS_S``); whether none was when it returned."""
    deadline = time.monotonic() + (FORK_WAITS_FOR_IMPORTS_S if timeout is None else timeout)
    me = threading.get_ident()
    while True:
        others = {name for name, owner in imports_in_progress().items() if owner != me} - _given_up
        if not others:
            return True
        if time.monotonic() >= deadline:
            _given_up.update(others)
            return False
        time.sleep(_POLL_S)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=wait_for_other_threads_imports)
