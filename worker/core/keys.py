"""Redis key layout. Every key of one subscription shares the hash tag `{tenant/name}`, so a
subscription's state lives in one Redis Cluster slot and multi-key operations stay legal there.
Fleet-wide keys use the tag `{fleet/<fleet name>}`: no subscription key can take it, since every
project's tenant is `p-<short>` (`subscriptions.PROJECT_PATTERN`)."""

from __future__ import annotations

PREFIX = "pw"


def tag(subscription_key: str) -> str:
    """The hash tag for a subscription key `tenant/name`."""
    return "{" + subscription_key + "}"


def message_key(subscription_key: str, message_id: str) -> str:
    """Attempt record of one message in one subscription: hash {n: attempts, last: last status}."""
    return f"{PREFIX}:{tag(subscription_key)}:m:{message_id}"


def attempt_key(subscription_key: str, message_id: str) -> str:
    """Layout 2's attempt record of one message: a string, `1` after a first attempt (expiring with the
    settled markers), `<n>,<probes>,<flags>,<last status>` once counted again, `s` once settled after
    a retry (`core/attempt_records.py`)."""
    return f"{PREFIX}:{tag(subscription_key)}:a:{message_id}"


ACKED_BUCKET_SECONDS = 300  # one hash of messages acked at their first attempt per five minutes


def acked_key(subscription_key: str, bucket: int) -> str:
    """Layout 2: the messages of one subscription acked at their first attempt during five minutes
    (`bucket` = unix time // ACKED_BUCKET_SECONDS): a hash, message id to its history (JSON) or 1."""
    return f"{PREFIX}:{tag(subscription_key)}:acked:{bucket}"


def replay_key(subscription_key: str, message_id: str) -> str:
    """An operator's replay of one message under way (a string: the replay's token, expiring): one at
    a time."""
    return f"{PREFIX}:{tag(subscription_key)}:replay:{message_id}"


def history_key(subscription_key: str, message_id: str) -> str:
    """Attempt history of one message in one subscription: a capped list of JSON entries."""
    return f"{PREFIX}:{tag(subscription_key)}:h:{message_id}"


def subscription_of(key: str) -> str:
    """The subscription key in a key of its own (`pw:{tenant/name}:...`); "" if there is none."""
    _, brace, rest = key.partition("{")
    inside, close, _ = rest.rpartition("}")
    return inside if brace and close else ""


def message_id_of(record_key: str) -> str:
    """The message id in an attempt record's key (`message_key` or `attempt_key`)."""
    _, _, rest = record_key.rpartition("}:")
    return rest.split(":", 1)[1]


def escape_glob(text: str) -> str:
    """`text` matched literally in a SCAN/KEYS pattern: a name is data, never a wildcard."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def pattern(subscription_key: str) -> str:
    """A SCAN pattern for every key of one subscription (all in one cluster slot)."""
    return f"{PREFIX}:{escape_glob(tag(subscription_key))}:*"


def message_pattern(subscription_key: str) -> str:
    """A SCAN pattern for the layout 1 attempt records of one subscription."""
    return f"{PREFIX}:{escape_glob(tag(subscription_key))}:m:*"


def attempt_pattern(subscription_key: str) -> str:
    """A SCAN pattern for the layout 2 attempt records of one subscription."""
    return f"{PREFIX}:{escape_glob(tag(subscription_key))}:a:*"


def acked_pattern(subscription_key: str) -> str:
    """A SCAN pattern for layout 2's buckets of messages acked at their first attempt."""
    return f"{PREFIX}:{escape_glob(tag(subscription_key))}:acked:*"


def settled_key(subscription_key: str) -> str:
    """The subscription's recently settled messages (newest first, capped): `push-worker history`."""
    return f"{PREFIX}:{tag(subscription_key)}:settled"


def lease_key(subscription_key: str, slot: int = 0) -> str:
    """Who serves the subscription's `slot`: the holder's worker id, with the lease's expiry. Slot 0
    is the subscription's own lease (the only one of a subscription on one worker, as before slots)."""
    return f"{PREFIX}:{tag(subscription_key)}:lease" + (f":{slot}" if slot else "")


def holder_key(subscription_key: str, slot: int = 0) -> str:
    """Who took the lease of the subscription's `slot` (a hash: the process's instance, its worker id,
    and `trial` while the subscription is on trial there), deleted when the lease is released: found
    by the next holder, it says the last one died holding it (`fleet/quarantine.py`)."""
    return f"{PREFIX}:{tag(subscription_key)}:holder" + (f":{slot}" if slot else "")


def endpoint_pause_key(subscription_key: str) -> str:
    """A `Retry-After` one of a spread subscription's workers got: exists (expiring with it) while every
    worker of the subscription holds new requests."""
    return f"{PREFIX}:{tag(subscription_key)}:endpoint-pause"


def workers_key(subscription_key: str) -> str:
    """How many workers serve the subscription now (1..max_workers), as its slot 0's holder decides."""
    return f"{PREFIX}:{tag(subscription_key)}:workers"


def config_definition_key(subscription_key: str) -> str:
    """The definition of a subscription from a worker's config file, as that worker publishes it
    (JSON, expiring: fleet/published.py)."""
    return f"{PREFIX}:{tag(subscription_key)}:config-definition"


def status_key(subscription_key: str, slot: int = 0) -> str:
    """The status report of the holder of the subscription's `slot`, for `subs list`: a hash (state,
    counters), expiring."""
    return f"{PREFIX}:{tag(subscription_key)}:status" + (f":{slot}" if slot else "")


def seek_key(subscription_key: str) -> str:
    """A pending seek request (JSON), taken by the worker holding the lease."""
    return f"{PREFIX}:{tag(subscription_key)}:seek"


def seek_result_key(subscription_key: str) -> str:
    """How the last seek ended (JSON), for the operator's command."""
    return f"{PREFIX}:{tag(subscription_key)}:seek-result"


def largest_message_key(subscription_key: str) -> str:
    """The largest payload (bytes) the subscription has carried: its next owner's prefetch is sized by it."""
    return f"{PREFIX}:{tag(subscription_key)}:largest"


def over_since_key(subscription_key: str) -> str:
    """Since when (ms) the backlog has stayed over the expiry threshold."""
    return f"{PREFIX}:{tag(subscription_key)}:backlog-over-since"


def log_key(subscription_key: str) -> str:
    """The delivery log: a stream of every attempt (entry ids are times), trimmed by age and count."""
    return f"{PREFIX}:{tag(subscription_key)}:log"


def log_stats_key(subscription_key: str) -> str:
    """The delivery log's hourly counts (`<hour>:<outcome>`, `<hour>:l<latency bin>`): the charts."""
    return f"{PREFIX}:{tag(subscription_key)}:log-stats"


def resumed_key(subscription_key: str) -> str:
    """When (ms) an operator last resumed the subscription (`subs resume`): closes its breaker."""
    return f"{PREFIX}:{tag(subscription_key)}:resumed"


def fleet_key(fleet: str, what: str) -> str:
    """A fleet-wide key (`members`, `instance:<worker id>`, `registry`, `version`, `events`, `paused`,
    `expired`, `quarantined`): all share the fleet's hash tag, so the fleet's multi-key operations stay in one
    Cluster slot."""
    return f"{PREFIX}:{tag('fleet/' + fleet)}:{what}"


def layout_since_key() -> str:
    """When (ms) Redis was switched to layout 2 (`push-worker layout upgrade`): layout 1's records are
    read beside layout 2's for `redis.attempts_ttl_seconds` after it. None on a Redis that began at 2."""
    return f"{PREFIX}:layout:since"


def layout_next_key() -> str:
    """A switch to layout 2 under way (`push-worker layout upgrade`, expiring): workers count no new
    attempt until Redis holds layout 2, or until this key is gone."""
    return f"{PREFIX}:layout:next"


def layout_key() -> str:
    """The Redis layout the keys follow (an integer, `fleet.layout.LAYOUT`): one for every fleet of the
    Redis, since subscription keys are not a fleet's own."""
    return f"{PREFIX}:layout"
