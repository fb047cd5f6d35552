"""The delivery contract: how one Pulsar message becomes one HTTP request (headers and body)."""

from __future__ import annotations

import functools
import hashlib
import re
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson
import pybase64

from worker.model.subscriptions import Subscription

# RFC 9110 token characters; attribute names outside this never become header names.
_TOKEN_RE = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}$")
# Visible ASCII, space and tab: no CR/LF, so no header injection.
_VALUE_RE = re.compile(r"^[\t\x20-\x7e]{0,4096}$")
MAX_ATTRIBUTE_HEADERS = 64


# Built per message: slotted, not frozen (a frozen dataclass took about 4x as long to build: each
# field goes through object.__setattr__). Treated as values all the same: nothing changes them.
@dataclass(slots=True)
class Envelope:
    """What the worker knows about a message, independent of the Pulsar client objects."""

    message_id: str
    data: bytes
    topic: str
    publish_time_ms: int
    attributes: dict[str, str] = field(default_factory=dict)
    ordering_key: str | None = None
    defect: str | None = None  # why the message cannot be delivered as it is (it is dead-lettered unsent)
    # What to ack in place of the client's message, when the worker is to let go of that one at once:
    # an oversize message's payload is then held once (here), not also in the client's copy.
    ack_handle: Any = None

    @property
    def defect_status(self) -> str:
        """The dead letter's `last_status` for the defect: its leading word when it names one
        (`payload_too_large: ...`), else `unreadable`."""
        word = (self.defect or "").split(":", 1)[0]
        return word if word in DEFECT_STATUSES else "unreadable"


PAYLOAD_TOO_LARGE = "payload_too_large"  # the same word as an attempt's Result.TOO_LARGE
DEFECT_STATUSES = (PAYLOAD_TOO_LARGE, "attributes_too_large")


@dataclass(slots=True)
class PushRequest:
    """A fully built request: send it as is."""

    headers: dict[str, str]
    body: bytes
    omitted_attributes: int = 0


# `ledger:entry:partition:batch` in ASCII digits, each in the client's range (str.isdigit takes '²').
_MESSAGE_ID = re.compile(r"(0|[1-9][0-9]{0,18}):(0|[1-9][0-9]{0,18}):(-1|0|[1-9][0-9]{0,9}):(-1|0|[1-9][0-9]{0,9})")
_LIMITS = (1 << 63, 1 << 63, 1 << 31, 1 << 31)


def parse_message_id(text: str) -> tuple[int, int, int, int] | None:
    """(ledger, entry, partition, batch) of an id `format_message_id` writes; None for anything else."""
    match = _MESSAGE_ID.fullmatch(text)
    if match is None:
        return None
    ledger, entry, partition, batch = (int(part) for part in match.groups())
    if any(value >= limit for value, limit in zip((ledger, entry, partition, batch), _LIMITS, strict=True)):
        return None
    return ledger, entry, partition, batch


def format_message_id(mid: Any) -> str:
    """A Pulsar MessageId as `ledgerId:entryId:partition:batchIndex`, the id endpoints see; stable
    across redeliveries."""
    return f"{mid.ledger_id()}:{mid.entry_id()}:{mid.partition()}:{mid.batch_index()}"


def rfc3339(ms: int) -> str:
    """Milliseconds since the epoch as an RFC 3339 UTC timestamp."""
    seconds, millis = divmod(int(ms), 1000)
    return f"{_utc_second(seconds)}.{millis:03d}Z"


@functools.lru_cache(maxsize=1024)  # messages of one burst share their second
def _utc_second(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


def base64_text(data: bytes) -> str:
    """Standard base64 (RFC 4648, padded). pybase64 (SIMD) encodes 1 MiB in about 0.15 ms where the
    standard library takes 2.5 ms (measured): the bulk of a large wrapped message's cost."""
    return pybase64.b64encode(data).decode("ascii")


def header_safe(name: str, value: str) -> bool:
    """True when an attribute can travel as a header without ambiguity or injection."""
    return bool(_TOKEN_RE.fullmatch(name)) and bool(_VALUE_RE.fullmatch(value))


def _case_clashes(attributes: dict[str, str]) -> frozenset[str]:
    """Attribute names that differ only in case. Header names do not: `Foo` and `foo` would arrive as
    one header sent twice, which RFC 9110 (5.3) forbids and an endpoint cannot tell apart (most read
    the first for both), so neither is sent as a header."""
    if len(attributes) < 2:
        return frozenset()
    # ASCII only (a header name is a token, and lower() keeps a token a token): a non-ASCII name such
    # as the Kelvin sign would fold onto an ASCII one. isascii() spares a second regex per name.
    folded = [name.lower() for name in attributes if name != "content-type" and name.isascii()]
    if len(set(folded)) == len(folded):
        return frozenset()
    counts = Counter(folded)
    return frozenset(name for name in attributes if name != "content-type" and counts[name.lower()] > 1)


def memory_per_payload_byte(sub: Subscription) -> float:
    """What a message held for `sub` costs in memory per payload byte: the Pulsar client's copy and
    the worker's, and while a request is under way a body that encodes it in base64 (4/3 of it).
    Counting payload bytes alone, three projects' 4 MiB messages took a worker to 869 MiB against a
    512 MiB `max_held_bytes`."""
    raw_body = sub.content == "raw" or (sub.content == "cloudevents" and sub.cloudevents.mode == "binary")
    return 2.0 if raw_body else 2.0 + 4 / 3


# W3C Trace Context (Level 1): version 00-fe, a non-zero trace id and parent id, lower-case hex.
_TRACEPARENT_RE = re.compile(r"(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
TRACESTATE_MAX = 512  # characters a tracestate may hold (W3C: at least 512 must be propagated)


def trace_headers(attributes: dict[str, str]) -> dict[str, str]:
    """The W3C `traceparent` and `tracestate` a message's publisher set in its properties, as the
    request's headers: passed on as they are (never trusted for anything else), a malformed one not
    at all."""
    parent = attributes.get("traceparent")
    if parent is None or not _TRACEPARENT_RE.fullmatch(parent):
        return {}
    state = attributes.get("tracestate")
    if state is None or len(state) > TRACESTATE_MAX or not header_safe("tracestate", state):
        return {"traceparent": parent}
    return {"traceparent": parent, "tracestate": state}


def build_request(sub: Subscription, env: Envelope, attempt: int) -> PushRequest:
    """Headers and body for delivery attempt `attempt` of `env` to `sub`, per the contract."""
    request = _request(sub, env, attempt)
    if "traceparent" in env.attributes:  # the publisher's trace goes on to the endpoint, in every format
        request.headers.update(trace_headers(env.attributes))
    return request


def _request(sub: Subscription, env: Envelope, attempt: int) -> PushRequest:
    headers = {
        "Pubsub-Subscription": sub.name,
        "Pubsub-Topic": sub.topic,
        "Pubsub-Message-Id": env.message_id,
        "Pubsub-Delivery-Attempt": str(attempt),
        "Pubsub-Publish-Time": rfc3339(env.publish_time_ms),
    }
    if env.ordering_key is not None and header_safe("Pubsub-Ordering-Key", env.ordering_key):
        headers["Pubsub-Ordering-Key"] = env.ordering_key
    if sub.content == "cloudevents":
        return _cloudevent(sub, env, attempt, headers)
    if sub.content == "gcp":
        headers["Content-Type"] = "application/json"
        return PushRequest(headers, orjson.dumps(_gcp_body(sub, env, attempt)))
    if sub.content == "wrapped":
        headers["Content-Type"] = "application/json"
        return PushRequest(headers, orjson.dumps({"subscription": sub.name, "message": _wrapped(env, attempt)}))
    omitted = 0
    content_type = env.attributes.get("content-type")
    if content_type is not None and header_safe("Content-Type", content_type):
        headers["Content-Type"] = content_type
    else:
        headers["Content-Type"] = "application/octet-stream"
        omitted += content_type is not None
    passed = 0
    clashing = _case_clashes(env.attributes)
    for name, value in env.attributes.items():
        if name == "content-type":
            continue
        if passed < MAX_ATTRIBUTE_HEADERS and header_safe(name, value) and name not in clashing:
            headers[f"Pubsub-Attr-{name}"] = value
            passed += 1
        else:
            omitted += 1
    return PushRequest(headers, env.data, omitted)


def _wrapped(env: Envelope, attempt: int) -> dict[str, Any]:
    """`content: wrapped`: one message's envelope."""
    return {"message_id": env.message_id, "data": base64_text(env.data), "attributes": env.attributes,
            "ordering_key": env.ordering_key, "publish_time": rfc3339(env.publish_time_ms),
            "delivery_attempt": attempt}


# -- several messages a request (deliver.push.batch) ------------------------------------------------

BATCH_ENTRY_OVERHEAD = 512  # bytes of a batch entry besides its data and attributes (ids, times, names)


def batch_entry_bytes(env: Envelope) -> int:
    """At least what `env` adds to a batch's body: its data in base64, its attributes escaped at worst
    (6 bytes a character, as \\u0000), the rest of its entry. Batches are cut by this estimate, before
    their attempt numbers (in the body) are known."""
    attributes = sum(len(k) + len(v) for k, v in env.attributes.items()) + len(env.ordering_key or "")
    return (len(env.data) + 2) // 3 * 4 + 6 * attributes + BATCH_ENTRY_OVERHEAD


def batch_id(message_ids: list[str]) -> str:
    """A batch's id (its `webhook-id` when signed): the same messages make the same id, so a batch
    sent again as it was can be recognised; any other batch gets another."""
    return "batch_" + hashlib.blake2b("\n".join(message_ids).encode(), digest_size=12).hexdigest()


def build_batch_request(sub: Subscription, messages: list[tuple[Envelope, int]]) -> PushRequest:
    """One request for several messages, each with its attempt number, in order: `content: wrapped`
    as `{"subscription", "messages": [<envelope>, ...]}`, `content: cloudevents` in the JSON batch
    format (`application/cloudevents-batch+json`: an array of structured events)."""
    headers = {"Pubsub-Subscription": sub.name, "Pubsub-Topic": sub.topic}
    if sub.content == "cloudevents":
        events, omitted = [], 0
        for env, attempt in messages:
            event, left_out = _structured_event(sub, env, attempt)
            events.append(event)
            omitted += left_out
        headers["Content-Type"] = "application/cloudevents-batch+json"
        return PushRequest(headers, orjson.dumps(events), omitted)
    headers["Content-Type"] = "application/json"
    return PushRequest(headers, orjson.dumps({"subscription": sub.name,
                                              "messages": [_wrapped(env, attempt) for env, attempt in messages]}))


# -- CloudEvents 1.0, HTTP binding ------------------------------------------------------------------

# Extension attribute names: lower-case letters and digits, at most 20 (CloudEvents 1.0); the
# context attributes' own names are not extensions.
_EXTENSION_RE = re.compile(r"^[a-z0-9]{1,20}$")
_CONTEXT_NAMES = frozenset({"specversion", "id", "source", "type", "datacontenttype", "dataschema", "subject",
                            "time", "data", "data_base64", "deliveryattempt"})
# A CloudEvents String holds no control characters (CloudEvents 1.0, "Type System"); nor can a
# lone surrogate be sent as UTF-8.
_CE_STRING_RE = re.compile(r"^[^\x00-\x1f\x7f-\x9f\ud800-\udfff]{0,4096}$")
# The HTTP binding (1.0.2, 3.1.3.2) percent-encodes every `ce-` header value's space, double quote,
# percent sign and anything outside printable ASCII, as UTF-8: "café 50%" is sent as "caf%C3%A9%2050%25".
_CE_HEADER_SAFE = "".join(c for c in map(chr, range(0x21, 0x7F)) if c not in ' "%')


def _ce_header(value: str) -> str:
    return urllib.parse.quote(value, safe=_CE_HEADER_SAFE)


def _cloudevent(sub: Subscription, env: Envelope, attempt: int, headers: dict[str, str]) -> PushRequest:
    """`content: cloudevents`: one event per message, binary (context in `ce-` headers, the payload
    as the body) or structured (`application/cloudevents+json`). The Pubsub-* headers stay."""
    if sub.cloudevents.mode != "binary":
        event, omitted = _structured_event(sub, env, attempt)
        headers["Content-Type"] = "application/cloudevents+json"
        return PushRequest(headers, orjson.dumps(event), omitted)
    context, extensions, content_type, omitted = _event_attributes(sub, env, attempt)
    headers["Content-Type"] = content_type or "application/octet-stream"
    for name, value in (*context.items(), *extensions.items()):
        headers[f"ce-{name}"] = _ce_header(value)
    return PushRequest(headers, env.data, omitted)


def _structured_event(sub: Subscription, env: Envelope, attempt: int) -> tuple[dict[str, Any], int]:
    """The event of `env` in the JSON format (its data inline when it is JSON, else in base64), and how
    many of its attributes were left out."""
    context, extensions, content_type, omitted = _event_attributes(sub, env, attempt)
    event = {**context, **extensions}
    if content_type is not None:
        event["datacontenttype"] = content_type
    payload = _json_payload(env.data, content_type)
    if payload is not _NOT_JSON:
        event["data"] = payload
    else:
        event["data_base64"] = base64_text(env.data)
    return event, omitted


def _event_attributes(sub: Subscription, env: Envelope,
                      attempt: int) -> tuple[dict[str, Any], dict[str, str], str | None, int]:
    """An event's context attributes, its extensions, its content type (None: unknown or unsafe) and
    how many of the message's attributes could not be carried."""
    ce = sub.cloudevents
    context: dict[str, Any] = {
        "specversion": "1.0", "id": env.message_id, "source": ce.source or f"//pulsar/{sub.topic}",
        "type": ce.type, "time": rfc3339(env.publish_time_ms),
    }
    omitted = 0
    if env.ordering_key is not None:
        if _CE_STRING_RE.fullmatch(env.ordering_key):
            context["subject"] = env.ordering_key
        else:
            omitted += 1
    content_type = env.attributes.get("content-type")
    if content_type is not None and not header_safe("Content-Type", content_type):
        content_type, omitted = None, omitted + 1
    extensions: dict[str, str] = {}
    for name, value in env.attributes.items():
        if name == "content-type":
            continue
        if _EXTENSION_RE.fullmatch(name) and name not in _CONTEXT_NAMES and _CE_STRING_RE.fullmatch(value):
            extensions[name] = value
        else:
            omitted += 1
    extensions["deliveryattempt"] = str(attempt)
    return context, extensions, content_type, omitted


_NOT_JSON = object()


def _json_payload(data: bytes, content_type: str | None) -> Any:
    """The payload as JSON when the message says it is JSON and it parses; else _NOT_JSON."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        return _NOT_JSON
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return _NOT_JSON


# -- the Google Cloud Pub/Sub push format -------------------------------------------------------------

def _gcp_body(sub: Subscription, env: Envelope, attempt: int) -> dict[str, Any]:
    """Google's push JSON: a PubsubMessage (protobuf JSON: empty data, attributes and ordering key
    left out; the id and publish time also under their snake_case names, as Google sends them)."""
    message: dict[str, Any] = {}
    if env.data:
        message["data"] = base64_text(env.data)
    if env.attributes:
        message["attributes"] = env.attributes
    published = rfc3339(env.publish_time_ms)
    message.update({"messageId": env.message_id, "message_id": env.message_id,
                    "publishTime": published, "publish_time": published})
    if env.ordering_key:
        message["orderingKey"] = env.ordering_key
    return {"message": message, "subscription": f"projects/{sub.tenant}/subscriptions/{sub.name}",
            "deliveryAttempt": attempt}


def dead_letter_properties(
    env: Envelope, topic: str, subscription: str, attempts: int, last_status: str
) -> dict[str, str]:
    """The original properties plus where the message came from and why it gave up."""
    props = dict(env.attributes)
    props.update({
        "pubsub.original_message_id": env.message_id,
        "pubsub.original_topic": topic,
        "pubsub.original_publish_time": str(env.publish_time_ms),
        "pubsub.subscription": subscription,
        "pubsub.delivery_attempts": str(attempts),
        "pubsub.last_status": last_status,
    })
    return props
