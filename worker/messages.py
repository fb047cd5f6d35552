"""The delivery contract: how one Pulsar message becomes one HTTP request (headers and body)."""

from __future__ import annotations

import base64
import functools
import re
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from worker.subscriptions import Subscription

# RFC 9110 token characters; attribute names outside this never become header names.
_TOKEN_RE = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}$")
# Visible ASCII, space and tab: no CR/LF, so no header injection.
_VALUE_RE = re.compile(r"^[\t\x20-\x7e]{0,4096}$")
MAX_ATTRIBUTE_HEADERS = 64


@dataclass(frozen=True)
class Envelope:
    """What the worker knows about a message, independent of the Pulsar client objects."""

    message_id: str
    data: bytes
    topic: str
    publish_time_ms: int
    attributes: dict[str, str] = field(default_factory=dict)
    ordering_key: str | None = None
    defect: str | None = None  # why the message cannot be delivered as it is (it is dead-lettered unsent)


@dataclass(frozen=True)
class PushRequest:
    """A fully built request: send it as is."""

    headers: dict[str, str]
    body: bytes
    omitted_attributes: int = 0


def format_message_id(ledger: int, entry: int, partition: int, batch: int) -> str:
    """`ledgerId:entryId:partition:batchIndex`, the id endpoints see; stable across redeliveries."""
    return f"{ledger}:{entry}:{partition}:{batch}"


def rfc3339(ms: int) -> str:
    """Milliseconds since the epoch as an RFC 3339 UTC timestamp."""
    seconds, millis = divmod(int(ms), 1000)
    return f"{_utc_second(seconds)}.{millis:03d}Z"


@functools.lru_cache(maxsize=1024)  # messages of one burst share their second
def _utc_second(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


def header_safe(name: str, value: str) -> bool:
    """True when an attribute can travel as a header without ambiguity or injection."""
    return bool(_TOKEN_RE.match(name)) and bool(_VALUE_RE.match(value))


def build_request(sub: Subscription, env: Envelope, attempt: int) -> PushRequest:
    """Headers and body for delivery attempt `attempt` of `env` to `sub`, per the contract."""
    headers = {
        "Pubsub-Subscription": sub.name,
        "Pubsub-Topic": sub.topic,
        "Pubsub-Message-Id": env.message_id,
        "Pubsub-Delivery-Attempt": str(attempt),
        "Pubsub-Publish-Time": rfc3339(env.publish_time_ms),
    }
    if env.ordering_key is not None and header_safe("Pubsub-Ordering-Key", env.ordering_key):
        headers["Pubsub-Ordering-Key"] = env.ordering_key
    if sub.content == "wrapped":
        headers["Content-Type"] = "application/json"
        body: dict[str, Any] = {
            "subscription": sub.name,
            "message": {
                "message_id": env.message_id,
                "data": base64.b64encode(env.data).decode("ascii"),
                "attributes": env.attributes,
                "ordering_key": env.ordering_key,
                "publish_time": rfc3339(env.publish_time_ms),
                "delivery_attempt": attempt,
            },
        }
        return PushRequest(headers, orjson.dumps(body))
    omitted = 0
    content_type = env.attributes.get("content-type")
    if content_type is not None and header_safe("Content-Type", content_type):
        headers["Content-Type"] = content_type
    else:
        headers["Content-Type"] = "application/octet-stream"
        omitted += content_type is not None
    passed = 0
    for name, value in env.attributes.items():
        if name == "content-type":
            continue
        if passed < MAX_ATTRIBUTE_HEADERS and header_safe(name, value):
            headers[f"Pubsub-Attr-{name}"] = value
            passed += 1
        else:
            omitted += 1
    return PushRequest(headers, env.data, omitted)
