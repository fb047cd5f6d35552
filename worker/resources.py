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


def memory_limit(root: Path = Path("/sys/fs/cgroup")) -> tuple[int | None, str]:
    """The container's memory limit in bytes, and where it was read (None: no limit found)."""
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < _NO_LIMIT_V1:
            return int(text), str(path)
    return None, ""


def held_bytes_budget(configured: int | None, root: Path = Path("/sys/fs/cgroup")) -> tuple[int, str]:
    """`max_held_bytes`: as configured, else half the container's memory limit (the process holds
    about twice a payload's size while it works on it), else 512 MiB; and why."""
    if configured is not None:
        return configured, "max_held_bytes"
    limit, where = memory_limit(root)
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
