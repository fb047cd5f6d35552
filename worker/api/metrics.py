"""The admin process's own metrics (`pushworker_admin_*`), on a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class AdminMetrics:
    """The admin process's own metrics (`pushworker_admin_`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pushworker_admin_requests", "Requests answered, by status class", ("status",),
                                registry=r)
        # Counted, not logged one by one: an anonymous flood must not become a flood of log lines.
        self.refused_anonymous = Counter("pushworker_admin_refused_anonymous", "Requests refused for want of a "
                                         "valid token (401), and failed console logins", registry=r)
        self.limited = Counter("pushworker_admin_limited", "Requests refused by a limit: `rate` and `concurrency` "
                               "per caller (429), `connections` (503)", ("limit",), registry=r)
