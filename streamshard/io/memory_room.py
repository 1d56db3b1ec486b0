"""How much memory this process may still take: the least of what the machine has free, the cgroup's
room (a container's limit: where the OOM killer strikes first) and the address-space limit.

Used to refuse, with an error naming the row group, work whose size a file's footer claims before
allocating it: a process killed by the OOM killer names nothing.
"""

from __future__ import annotations

import os

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

_CGROUP_FILES = (  # (limit, usage): cgroup v2, then v1
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def available_bytes() -> int:
    """Bytes this process can likely still allocate (a best effort: each source read when present)."""
    room = [_machine_free()]
    cgroup = _cgroup_room()
    if cgroup is not None:
        room.append(cgroup)
    address_space = _address_space_room()
    if address_space is not None:
        room.append(address_space)
    return max(min(room), 0)


def _machine_free() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 1 << 62  # unknown: no bound from here


def _cgroup_room() -> int | None:
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            with open(limit_file, encoding="ascii") as f:
                limit = f.read().strip()
            with open(usage_file, encoding="ascii") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        return int(limit) - usage
    return None


def _address_space_room() -> int | None:
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            size_pages = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return soft - size_pages * os.sysconf("SC_PAGE_SIZE")
