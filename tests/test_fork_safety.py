"""Fork safety: a DataLoader worker forked while another thread of its parent holds a lock the worker needs.

A raw-text pack's counting thread reads and tokenizes beside training (making a quiet progress bar
and a reader for each round it counts) while the loader forks its worker processes. A worker that
then counted a stage itself waited forever for tqdm's lock, held at the fork by the parent's thread
(which the child does not have): CI at 4399040 failed a Lightning job's resumed run on a hang. Each
test forks while a thread holds such a lock, or is importing a module (``io/fork_imports.py``), and
fails if the child does not finish with what it needs whole.
"""

from __future__ import annotations

import fcntl
import importlib
import io
import os
import select
import signal
import struct
import sys
import termios
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from tqdm import tqdm

import streamshard as ss
from streamshard.io import fork_imports, storage
from streamshard.io.text_counts import count_text_tokens
from streamshard.progress import NoBar, progress_bar
from test_packed_text import write_texts


@contextmanager
def lock_held_by_a_thread(lock: Any = None) -> Iterator[None]:
    """``lock`` (tqdm's by default) held by another thread of this process while inside (as when a bar
    is being made)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock if lock is not None else tqdm.get_lock():
            held.set()
            release.wait()

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait()
    try:
        yield
    finally:
        release.set()
        thread.join()


def child_finishes(work: Callable[[], None], timeout: float = 20.0, lock: Any = None) -> bool:
    """Fork while ``lock`` (tqdm's by default) is held by another thread; whether the child ran ``work``
    and exited in time."""
    with lock_held_by_a_thread(lock):
        pid = os.fork()
        if pid == 0:  # the child: exit at once, whatever happens
            code = 1
            try:
                work()
                code = 0
            finally:
                os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False


def test_a_worker_forked_while_its_parent_makes_a_bar_counts_tokens(tmp_path):
    write_texts(tmp_path / "c", [[6, 5], [7]], seed=1)
    pack = ss.PackedStream(ss.ParquetStream(str(tmp_path / "c")), column="text", seq_len=8, batch_size=2,
                           tokenizer=lambda batch: [[len(w) for w in t.split()] for t in batch])
    catalog = pack.source.catalog
    every = np.arange(catalog.num_row_groups)

    def count() -> None:  # what a worker does for a stage its parent has not counted (quiet: a worker's)
        got = count_text_tokens(catalog, {}, "text", pack.text, None, quiet=True, rgs=every, threads=1)
        assert (got >= 0).all()

    assert child_finishes(count), "the forked worker hung on the bar's lock its parent's thread held"


def test_a_bar_that_is_not_drawn_takes_no_lock():
    assert isinstance(progress_bar(io.StringIO(), total=3, unit="rg", desc="x"), NoBar)  # not a terminal
    assert child_finishes(lambda: progress_bar(io.StringIO(), total=3, unit="rg", desc="x").update(1))


def test_a_child_forked_while_a_drawn_bar_is_locked_draws_its_own():
    parent_side, child_side = os.openpty()
    fcntl.ioctl(child_side, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # a width to draw in
    terminal = os.fdopen(child_side, "w")
    try:
        with progress_bar(terminal, total=3, unit="rg", desc="x") as bar:
            assert isinstance(bar, tqdm)  # a terminal: drawn

        def draw() -> None:
            with progress_bar(terminal, total=3, unit="rg", desc="drawn") as bar:
                bar.update(3)
            terminal.flush()

        assert child_finishes(draw), "the forked child hung on tqdm's lock held by its parent's thread"
        process_lock = tqdm.get_lock().locks[0]  # shared with the child: free again once it exited
        assert process_lock.acquire(timeout=5), "the child left tqdm's process lock taken"
        process_lock.release()
        drawn = b""
        while select.select([parent_side], [], [], 0.5)[0]:
            drawn += os.read(parent_side, 65536)
        assert b"drawn" in drawn
    finally:
        terminal.close()
        os.close(parent_side)


@pytest.mark.parametrize("quiet", [True, False])
def test_a_bar_on_a_pipe_or_asked_quiet_is_silent(quiet):
    out = io.StringIO()
    with progress_bar(out, total=2, unit="rg", desc="counting", quiet=quiet) as bar:
        bar.update(2)
        bar.set_postfix_str("1 MB/s")
    assert out.getvalue() == ""


def test_a_worker_forked_while_its_parent_makes_a_filesystem_makes_its_own(tmp_path):
    (tmp_path / "f").write_bytes(b"x")

    def resolve() -> None:  # what a worker's first reader does
        fs, path = storage.FileSystems({}).resolve(str(tmp_path / "f"))
        assert fs.cat_file(path) == b"x"

    assert child_finishes(resolve, lock=storage._SHARED_LOCK), "the forked worker hung on the filesystems' lock"


def write_module(directory, name: str, body: str) -> None:
    (directory / f"{name}.py").write_text(body)


def test_a_worker_forked_while_another_thread_imports_a_module_gets_it_whole(tmp_path, monkeypatch):
    # As numpy.ma imported by a counting thread's first np.unique, or pandas by pyarrow's first pa.array().
    write_module(tmp_path, "slow_to_import", "import time\ntime.sleep(0.5)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slow_to_import", raising=False)
    importer = threading.Thread(target=importlib.import_module, args=("slow_to_import",))
    importer.start()
    while "slow_to_import" not in sys.modules:
        time.sleep(0.001)
    pid = os.fork()  # inside the import: the fork waits for it
    if pid == 0:
        code = 1
        try:
            import slow_to_import
            code = 0 if slow_to_import.DONE else 1
        finally:
            os._exit(code)
    importer.join()
    deadline = time.monotonic() + 20
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the child waited forever for the module its parent's thread was importing at the fork")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0, "the child found the module half made"


def test_a_module_that_forks_while_it_is_imported_is_not_waited_for(tmp_path, monkeypatch):
    monkeypatch.setattr(fork_imports, "FORK_WAITS_FOR_IMPORTS_S", 600.0)  # waiting for itself: the test times out
    write_module(tmp_path, "forks_at_import", "import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\n"
                                              "os.waitpid(pid, 0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "forks_at_import", raising=False)
    importlib.import_module("forks_at_import")


def test_an_import_that_never_ends_delays_one_fork_only(tmp_path, monkeypatch):
    write_module(tmp_path, "never_imported", "import threading\nthreading.Event().wait(3600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    threading.Thread(target=importlib.import_module, args=("never_imported",), daemon=True).start()
    while "never_imported" not in sys.modules:
        time.sleep(0.001)
    assert "never_imported" in fork_imports.imports_in_progress()
    assert not fork_imports.wait_for_other_threads_imports(timeout=0.2)  # waited, in vain
    assert fork_imports.wait_for_other_threads_imports(timeout=0.2)  # not again


def test_a_worker_forked_while_a_thread_loads_a_lazy_submodule_finds_it_bound(tmp_path, monkeypatch):
    # numpy's pattern: the package's __getattr__ imports a submodule on first use (np.unique -> numpy.ma); a
    # child must never see the submodule imported but not yet bound to its package (numpy then recursed).
    package = tmp_path / "lazy_package"
    package.mkdir()
    write_module(package, "__init__", "import importlib\n\ndef __getattr__(name):\n"
                                      "    if name == 'part':\n        import lazy_package.part as part\n"
                                      "        return part\n    raise AttributeError(name)\n")
    write_module(package, "part", "import time\ntime.sleep(0.3)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("lazy_package", "lazy_package.part"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    lazy_package = importlib.import_module("lazy_package")
    user = threading.Thread(target=getattr, args=(lazy_package, "part"))
    user.start()
    while "lazy_package.part" not in sys.modules:
        time.sleep(0.001)

    def use() -> None:
        assert lazy_package.part.DONE

    assert child_finishes(use, lock=threading.Lock()), "the child found the submodule half made or unbound"
    user.join()
