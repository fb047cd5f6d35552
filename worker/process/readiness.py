"""Whether a worker is ready, as /readyz says: Redis answers, the broker has answered, the worker
is in its fleet and its rounds go through, no other process uses its id, no task keeps failing, and
the admin process it runs beside itself (if any) is running."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from worker.model.config import Settings
from worker.runtime.supervisor import Supervisor


class Judged(Protocol):
    """What readiness reads of a worker (service.Worker)."""

    settings: Settings
    redis: Any
    served: Any
    fleet: Any
    supervisor: Supervisor
    admin: Any  # the admin process beside an embedded worker (`api.beside.AdminBeside`), or None

    @property
    def stopping(self) -> bool: ...

    @property
    def closed(self) -> bool: ...


async def readiness(w: Judged) -> tuple[bool, str]:
    """(ready, why not)."""
    if w.closed or w.stopping:
        return False, "stopping"
    try:
        assert w.redis is not None
        await asyncio.wait_for(w.redis.ping(), timeout=2)
    except Exception:
        return False, "redis unreachable"
    # The worker is judged, not each subscription: one that can never subscribe (a topic the
    # broker refuses) must not hold a rolling update forever. Until the broker has answered at
    # all, though, nothing can be delivered.
    if w.served is not None and w.served.subscribing and not await w.served.broker_reachable():
        # An authenticating broker drops a connection with a token it refuses, unanswered: to the
        # client that is the same timeout as a dead broker's, so the reason names both.
        token = " or refusing PUSH_WORKER_PULSAR_TOKEN" if w.settings.pulsar.auth_token else ""
        return False, f"broker unreachable{token}"
    fleet = w.fleet
    if fleet is not None and fleet.stepped_out:
        return False, f"cut off from the broker, serving nothing until it answers ({fleet.stepped_out})"
    if fleet is None or not fleet.members or not fleet.took_share:  # it takes its share once arrivals settle
        why = fleet.round_error if fleet else ""
        return False, f"not yet in the fleet ({why})" if why else "not yet in the fleet"
    # Past a lease period every lease has lapsed: nothing is delivered, though Redis answers PING.
    if fleet.failing_for() > w.settings.fleet.lease_seconds:
        return False, f"fleet round failing for {fleet.failing_for():.0f} s ({fleet.round_error})"
    if twin := fleet.twin_reason():
        return False, twin
    failing = w.supervisor.not_ready()
    if failing:
        return False, failing
    if w.admin is not None and w.admin.down:  # the API and console it runs beside itself
        return False, w.admin.down
    return True, "ok"
