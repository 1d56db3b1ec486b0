"""A directory of one object's own under the temp dir, where its copies in other processes meet.

A plain ``DataLoader(ds, num_workers=N)`` copies the dataset into each worker (forked or pickled),
and the copies cannot reach each other or their parent through memory. What they must agree on (the
catalog: ``io/catalog_share.py``; a raw-text pack's token counts: ``io/count_share.py``) is computed by
the first process that needs it under an exclusive ``flock`` of a file in this directory, written
there, and read by the others. The directory is named by a token the owner drew when it was made,
created by the first process that needs it, and removed when the owner is garbage-collected or its
process exits (``weakref.finalize``, in that process only); a process killed outright leaves it
behind (``streamshard-*`` in the temp dir). A process that dies holding the lock releases it (the
kernel drops an ``flock`` with the last descriptor of its file).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import stat
import tempfile
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

from ..errors import CatalogError

_forks = 0  # how many times this process has forked (a DataLoader's fork workers are forks)
# The descriptors of the locks this process has open. A child forked while one is held (a counting
# thread holds it as the loader forks its workers) inherits the descriptor, and with it the lock, which
# would then outlive the holder's release: the child closes its copies at once.
_lock_fds: set[int] = set()
_lock_fds_guard = threading.Lock()


def _before_fork() -> None:
    global _forks
    _forks += 1
    _lock_fds_guard.acquire()  # no descriptor is opened or closed across the fork


def _after_fork_in_parent() -> None:
    _lock_fds_guard.release()


def _after_fork_in_child() -> None:
    global _lock_fds_guard
    for fd in _lock_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _lock_fds.clear()
    _lock_fds_guard = threading.Lock()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


@contextmanager
def file_locked(path: str, mode: int = 0o644) -> Iterator[None]:
    """Hold an exclusive ``flock`` of ``path`` (made if missing), waiting while another process holds
    it; released if the holder dies, and never kept by a child forked meanwhile (above)."""
    with _lock_fds_guard:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
        _lock_fds.add(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        with _lock_fds_guard:
            _lock_fds.discard(fd)
            os.close(fd)  # the flock goes with the last descriptor


class ProcessShare:
    """Where the processes of one owner meet: a token and, once resolved, its directory.

    The directory is resolved on first use (``tempfile.gettempdir()`` may probe the disk) and travels
    with a pickled copy, so spawned workers use the parent's. Forked workers and the owner's cleanup
    resolve it themselves: the temp dir must not change under a running DataLoader.
    """

    prefix = "streamshard-share-"

    def __init__(self, token: str) -> None:
        self.token = token
        self._directory: str | None = None
        self._forks_at_birth = _forks
        self._pickled = False

    @classmethod
    def owned_by(cls, owner: object) -> "ProcessShare":
        """A fresh share whose directory is removed when ``owner`` is collected or this process exits.

        Creates nothing: the directory is made by the first process that needs it.
        """
        share = cls(secrets.token_hex(16))
        weakref.finalize(owner, share._remove, os.getpid())
        return share

    @property
    def directory(self) -> str:
        if self._directory is None:
            self._directory = os.path.join(tempfile.gettempdir(), f"{self.prefix}{self.token}")
        return self._directory

    def __getstate__(self) -> dict[str, Any]:
        self._pickled = True  # a spawned worker may now need what is shared without its parent's
        return {"token": self.token, "_directory": self.directory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.token, self._directory = state["token"], state["_directory"]
        self._forks_at_birth, self._pickled = _forks, False

    def may_have_workers(self) -> bool:
        """Whether a process other than this one may need what is shared: this process has forked or
        pickled the owner since the share was made, or some process has begun sharing already."""
        return self.copied() or self.started()

    def copied(self) -> bool:
        """Whether this process has forked or pickled the owner since the share was made (so a copy
        of it may run in another process)."""
        return self._pickled or _forks > self._forks_at_birth

    def started(self) -> bool:
        """Whether some process of this owner has begun sharing (then this one must join)."""
        return os.path.isdir(self.directory)

    @contextmanager
    def locked(self, name: str = "lock") -> Iterator[str]:
        """Hold the exclusive lock ``name`` of the share (waiting while another process holds it);
        yields the directory."""
        directory = self._make_directory()
        with file_locked(os.path.join(directory, name), 0o600):
            yield directory

    def _remove(self, owner_pid: int) -> None:
        if os.getpid() == owner_pid:  # a forked child inherits the finalizer; the directory is the owner's
            shutil.rmtree(self.directory, ignore_errors=True)

    def _make_directory(self) -> str:
        directory = self.directory
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise CatalogError(f"{directory} is not a directory of this user, so what the DataLoader workers "
                               "share cannot be shared through it; remove it")
        return directory

