"""CPU time of this process and every process under it: what data loading costs a node's cores.

Rows per second says how fast a loader is; CPU-seconds per million rows says what it takes from the
cores a training step also needs. A loader's CPU is spread over threads (read-ahead, producer) and,
with worker processes, over live child processes that ``getrusage(RUSAGE_CHILDREN)`` does not see
until they exit. :func:`tree_cpu_seconds` adds them up: this process (all threads), every live
descendant (read from ``/proc`` on Linux, with what each has reaped) and the children this process
has reaped. Take it before and after a pass; the difference is the pass's CPU wherever it ran.
"""

from __future__ import annotations

import os
import resource

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process, its live descendants and its reaped children.

    Off Linux (no ``/proc``) live descendants are not counted: only this process and the
    children it has reaped."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    return total + sum(_proc_cpu(pid) for pid in _descendants(os.getpid()))


def _descendants(root: int) -> list[int]:
    """Live processes under ``root`` (any depth), from ``/proc/*/stat``; [] without ``/proc``."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    children: dict[int, list[int]] = {}
    for name in names:
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(name))  # fields[1]: the parent's pid
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _proc_cpu(pid: int) -> float:
    """utime + stime + cutime + cstime of ``pid`` in seconds (0 if it has gone)."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    return sum(int(v) for v in fields[11:15]) / _TICKS  # utime stime cutime cstime


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name: [state, ppid, ...]."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()  # the name, in parentheses, may hold spaces
