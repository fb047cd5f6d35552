"""The fleet: membership and balanced ownership (`membership`), fenced leases (`leases`), the live
registry (`registry`), what may be served (`admission`), status reports for `subs list` (`status`),
seeks (`seek`), the backlog report and expiry (`expiry`)."""

from worker.fleet.leases import assign
from worker.fleet.membership import Fleet

__all__ = ["Fleet", "assign"]
