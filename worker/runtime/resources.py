"""What the worker may use of its container: the memory budget for held payloads and the number of
open connections, worked out at start from the cgroup's memory limit and the open-files limit, and
said in the start-up log."""

from __future__ import annotations

import resource
from pathlib import Path

DEFAULT_WORKER_HELD_BYTES = 512 * 1024 * 1024  # where no memory limit is set
# Files the worker keeps open besides push connections: Redis, the broker, its listener, logs, the
# embedded services, a Python process's own.
RESERVED_FILES = 512
MAX_CONNECTIONS = 60_000
# cgroup v2 reports "max" for no limit; v1 a huge number (a page-rounded LONG_MAX).
_NO_LIMIT_V1 = 1 << 60


def _cgroup_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """This process's cgroup paths from /proc/self/cgroup: (v1 memory controller's, v2's)."""
    v1 = v2 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and not controllers:
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v1, v2


def _limit_at(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) < _NO_LIMIT_V1 else None


def memory_limit(root: Path = Path("/sys/fs/cgroup"),
                 proc_cgroup: Path = Path("/proc/self/cgroup")) -> tuple[int | None, str]:
    """The memory limit this process runs under, in bytes, and where it was read (None: no limit
    found). The process's own cgroup is found through /proc/self/cgroup (in a container it is the
    mount's root; a nested cgroup, v1 or v2, is below it), and the smallest limit from there up to
    the root is the one that holds."""
    v1, v2 = _cgroup_paths(proc_cgroup)
    found: list[tuple[int, str]] = []
    for base, relative, name in ((root, v2, "memory.max"), (root / "memory", v1, "memory.limit_in_bytes")):
        directory = base / (relative or "/").strip("/")
        while True:
            limit = _limit_at(directory / name)
            if limit is not None:
                found.append((limit, str(directory / name)))
            if directory == base or base not in directory.parents:
                break
            directory = directory.parent
    return min(found) if found else (None, "")


def held_bytes_budget(configured: int | None, root: Path = Path("/sys/fs/cgroup"),
                      proc_cgroup: Path = Path("/proc/self/cgroup")) -> tuple[int, str]:
    """`max_held_bytes`: as configured, else half the container's memory limit (the process holds
    about twice a payload's size while it works on it), else 512 MiB; and why."""
    if configured is not None:
        return configured, "max_held_bytes"
    limit, where = memory_limit(root, proc_cgroup)
    if limit is not None:
        return max(16 << 20, limit // 2), f"half of {where}"
    return DEFAULT_WORKER_HELD_BYTES, "default (no memory limit found)"


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft open-files limit to the hard one (a container's default soft limit is often
    1,024 or 2,048: 2,015 hung sockets exhausted it); returns (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft, hard


def connections_budget(configured: int | None, soft_limit: int) -> tuple[int, str]:
    """`max_connections`: as configured, else the open-files limit less what the worker keeps open
    besides (at least 64, at most 60,000); and why."""
    if configured is not None:
        return configured, "max_connections"
    if soft_limit == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS, "default (no open-files limit)"
    budget = max(64, min(MAX_CONNECTIONS, soft_limit - RESERVED_FILES))
    return budget, f"open-files limit {soft_limit} less {RESERVED_FILES}"
