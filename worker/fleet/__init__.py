"""The fleet: membership and balanced ownership (`membership`), fenced leases (`leases`), the live
registry (`registry`), status reports for `subs list` (`status`), seeks and expiry (`lifecycle`)."""

from worker.fleet.leases import assign
from worker.fleet.membership import Fleet

__all__ = ["Fleet", "assign"]
