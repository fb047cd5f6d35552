"""The memory evidence containment acts on (`fleet/containment.py`): a thread that reads the process's
memory all the time, and names what inflates when it passes the alarm.

A death leaves evidence only if the worker saw it coming: past MEMORY_ALARM of the container's limit
an OOM kill is likely on its way (a bomb inflates a GiB in a second or less), so the alarm goes out
at once and the next holders read it. Without it (kill -9, a node lost, a liveness kill, a crash)
the next holders serve the dead worker's subscriptions at once.

What inflates is named by its thread: a subscription on trial is served by a Pulsar client of its
own, whose I/O thread (the one that inflates what the broker sends) is known by its native id
(`io_thread_id`). At the alarm the thread that burned the most CPU in the last seconds, the event
loop's aside, is the inflating one: if it is a trial client's, the alarm names that subscription;
if it is anyone else's (the shared client's), it names none. Where per-thread CPU cannot be read
(no /proc/self/task) nothing is named, and the worker runs one trial at a time, whose subscription
the alarm names (`ThreadCpu.available`).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

MEMORY_ALARM = 0.75  # of the container's memory limit: past it an OOM kill is likely on its way
MEMORY_CLEAR = 0.6  # ...and back below this the danger has passed (hysteresis: no alarm per poll)
MEMORY_POLL_SECONDS = 0.01  # how often the process's memory is read
CPU_SNAPSHOT_SECONDS = 0.5  # how often the threads' CPU is read while a subscription is on trial
CPU_WINDOW_SNAPSHOTS = 6  # the alarm compares against the oldest of these (about 3 s before)
INFLATING_CPU_NS = 50_000_000  # a thread that named must have burned this much CPU in the window (50 ms)

TASKS = Path("/proc/self/task")


def _resident_bytes() -> int:
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _thread_cpu_ns(tasks: Path = TASKS) -> dict[int, int]:
    """CPU time of each of the process's threads, in ns (schedstat: on-CPU time)."""
    out = {}
    for entry in os.scandir(tasks):
        try:
            with open(f"{entry.path}/schedstat", "rb") as f:
                out[int(entry.name)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return out


class ThreadCpu:
    """Which thread burned the most CPU lately, the event loop's aside: snapshots every
    CPU_SNAPSHOT_SECONDS while a trial client's thread is registered, compared at the alarm."""

    def __init__(self, read: Callable[[], dict[int, int]] = _thread_cpu_ns) -> None:
        self._read = read
        self.available = self._probe()
        self.trial_threads: dict[int, str] = {}  # native thread id -> the unit on trial on that client
        self._snapshots: deque[tuple[float, dict[int, int]]] = deque(maxlen=CPU_WINDOW_SNAPSHOTS)
        self._main = threading.main_thread().native_id

    def _probe(self) -> bool:
        try:
            return bool(self._read())
        except OSError:
            return False

    def register(self, tid: int | None, unit: str) -> None:
        if tid is not None and tid != self._main:
            self.trial_threads[tid] = unit

    def forget(self, unit: str) -> None:
        for tid in [t for t, u in self.trial_threads.items() if u == unit]:
            del self.trial_threads[tid]

    def snapshot_if_due(self, now: float) -> None:
        if not self.available or not self.trial_threads:
            self._snapshots.clear()
            return
        if not self._snapshots or now - self._snapshots[-1][0] >= CPU_SNAPSHOT_SECONDS:
            self._snapshots.append((now, self._read()))

    def inflating(self, sample_seconds: float = 0.03) -> str:
        """The unit on trial whose client's thread is inflating, or '' when it is no trial client's
        thread (or none stands out)."""
        if not self.available or not self.trial_threads:
            return ""
        if self._snapshots:
            before = self._snapshots[0][1]
        else:  # no history yet: a short sample
            before = self._read()
            time.sleep(sample_seconds)
        return self.busiest(before, self._read())

    def busiest(self, before: dict[int, int], after: dict[int, int]) -> str:
        """From two readings: the trial unit whose thread burned the most CPU between them, if that
        thread burned the most of all (the event loop's aside) and at least INFLATING_CPU_NS."""
        spent = {tid: cpu - before.get(tid, 0) for tid, cpu in after.items() if tid != self._main}
        if not spent:
            return ""
        top = max(spent, key=spent.__getitem__)
        if spent[top] < INFLATING_CPU_NS:
            return ""
        return self.trial_threads.get(top, "")


class MemoryWatch:
    """A thread that reads the process's resident memory every MEMORY_POLL_SECONDS and calls, on the
    event loop, `on_alarm(named)` once it passes MEMORY_ALARM of `limit` (`named`: the unit on trial
    that inflates, or ''), and `on_clear()` once it is back below MEMORY_CLEAR. A thread, not a
    task: while the client inflates a bomb the event loop may be slow, and the alarm must go out
    before the OOM kill."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop, on_alarm: Callable[[str], Any],
                 on_clear: Callable[[], Any], cpu: ThreadCpu,
                 read: Callable[[], int] = _resident_bytes) -> None:
        self.threshold = int(limit * MEMORY_ALARM)
        self.clear_below = int(limit * MEMORY_CLEAR)
        self.cpu = cpu
        self.high = False
        self._loop, self._on_alarm, self._on_clear, self._read = loop, on_alarm, on_clear, read
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="memory watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(MEMORY_POLL_SECONDS):
            resident = self._read()
            if not self.high and resident >= self.threshold:
                self.high = True
                named = self.cpu.inflating()
                self._loop.call_soon_threadsafe(self._on_alarm, named)
            elif self.high and resident < self.clear_below:
                self.high = False
                self._loop.call_soon_threadsafe(self._on_clear)
            self.cpu.snapshot_if_due(time.monotonic())


def io_thread_id(client: Any, topic: str, timeout: float) -> asyncio.Future[int | None]:
    """The native id of the I/O thread of a fresh Pulsar client (the thread that inflates what its
    consumers receive): the thread that answers its first lookup. None when the answer came on the
    caller's thread (the client answered from a cache, or failed before connecting)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[int | None] = loop.create_future()
    caller = threading.get_native_id()

    def settle(tid: int | None) -> None:
        if not future.done():
            future.set_result(tid)

    def answered(*_: Any) -> None:
        tid = threading.get_native_id()
        loop.call_soon_threadsafe(settle, None if tid == caller else tid)

    client._client.get_topic_partitions_async(topic, answered)  # the asyncio wrapper's C++ client
    loop.call_later(timeout, settle, None)
    return future
