"""Redis key layout. Every key of one subscription shares the hash tag `{tenant/name}`, so a
subscription's state lives in one Redis Cluster slot and multi-key operations stay legal there."""

from __future__ import annotations

PREFIX = "pw"


def tag(subscription_key: str) -> str:
    """The hash tag for a subscription key `tenant/name`."""
    return "{" + subscription_key + "}"


def message_key(subscription_key: str, message_id: str) -> str:
    """Attempt record of one message in one subscription: hash {n: attempts, last: last status}."""
    return f"{PREFIX}:{tag(subscription_key)}:m:{message_id}"


def history_key(subscription_key: str, message_id: str) -> str:
    """Attempt history of one message in one subscription: a capped list of JSON entries."""
    return f"{PREFIX}:{tag(subscription_key)}:h:{message_id}"


def pattern(subscription_key: str) -> str:
    """A SCAN pattern for every key of one subscription (all in one cluster slot)."""
    return f"{PREFIX}:{tag(subscription_key)}:*"


def settled_key(subscription_key: str) -> str:
    """The subscription's recently settled messages (newest first, capped): `push-worker history`."""
    return f"{PREFIX}:{tag(subscription_key)}:settled"
