"""What the fleet may ask of the worker it serves for: the one interface between them. The fleet
decides which subscriptions this worker holds; the worker serves them. `serving.Serving` implements
it, and so does the scale benchmark's simulated worker (devtools/fleet_scale.py), which serves
nothing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from worker.core.dispatcher import Fence
from worker.core.metrics import Metrics
from worker.fleet.memory_watch import ThreadCpu
from worker.fleet.seek import SeekTarget
from worker.model.subscriptions import Subscription
from worker.runtime.supervisor import Supervisor


class Served(Protocol):
    """One subscription as its worker serves it (the dispatcher): what status reports and live edits read."""

    @property
    def sub(self) -> Subscription: ...

    def update(self, sub: Subscription) -> None: ...

    @property
    def state(self) -> Any: ...

    @property
    def state_reason(self) -> str: ...

    @property
    def unsettled(self) -> int: ...

    @property
    def oldest_unsettled_ms(self) -> int | None: ...  # the publish time of the oldest message in hand

    def resume(self, resumed_at_ms: int) -> bool: ...  # `subs resume`: close a breaker opened before then

    def paused_for(self) -> float: ...  # seconds new requests still wait for a Retry-After

    def pause(self, seconds: float) -> None: ...  # another worker of the subscription got a Retry-After

    stats: Any


class ServingWorker(Protocol):
    worker_id: str
    metrics: Metrics
    supervisor: Supervisor

    @property
    def subscribe_failures(self) -> Mapping[str, str]:
        """Why a subscription's subscribe keeps failing, by key."""
        ...

    @property
    def dispatchers(self) -> Mapping[str, Served]:
        """The subscriptions it serves, by key (each a `Served`)."""
        ...

    @property
    def stopping(self) -> bool: ...

    @property
    def serving(self) -> set[str]: ...

    def add(self, sub: Subscription, lease: Fence | None = None, trial: bool = False) -> None:
        """Serve `sub`; `trial`: through a Pulsar client of its own, until `end_trial`."""
        ...

    def end_trial(self, key: str) -> None: ...

    trial_threads: ThreadCpu  # the trial clients' threads, for the memory alarm to name

    async def remove(self, key: str, grace: float | None = None, unsubscribe: bool = False) -> None: ...

    async def seek(self, key: str, target: SeekTarget) -> int: ...

    async def partitions(self, topic: str) -> int:
        """How many partitions the topic has (1 when it is not partitioned)."""
        ...
