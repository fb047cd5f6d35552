"""CPU-limited "pods" for the benchmarks: cgroups of the v1 `cpu` controller whose CFS quota caps
what their processes together may use, as Kubernetes enforces a container's CPU limit."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def cgroups_available(controller: Path = CPU_CGROUP, limit_file: str = "cpu.cfs_quota_us") -> str:
    """Why cgroups of a v1 `controller` cannot be made here ("" when they can)."""
    if not (controller / limit_file).exists():
        return f"no cgroup v1 {controller.name} controller at {controller}"
    try:
        probe = controller / f"pw-probe-{time.monotonic_ns()}"
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return f"cannot create a cgroup there ({e.strerror}): run as root"
    return ""


@contextlib.contextmanager
def pod(name: str, cores: float) -> Iterator[Path]:
    """A cgroup whose processes together get at most `cores` of CPU time."""
    path = CPU_CGROUP / name
    path.mkdir()
    try:
        (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(int(cores * PERIOD_US)))
        yield path
    finally:
        for _ in range(50):  # its processes must be gone before it can go
            with contextlib.suppress(OSError):
                path.rmdir()
                break
            time.sleep(0.1)


def start_in(cgroup: Path, command: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
    """`command` as a process that enters `cgroup` before it execs (so every thread is limited)."""
    wrapper = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *command]
    with open(log, "ab") as out:
        return subprocess.Popen(wrapper, stdout=out, stderr=out, env={**os.environ, **env})
