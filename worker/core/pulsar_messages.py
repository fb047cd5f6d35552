"""The broker adapter's per-message part, compiled with the rest of the per-message path (#62): a
Pulsar message made an `Envelope` (its id, attributes, limits and defects). `broker/consumer.py`
holds the rest of the adapter (clients, subscribing, the consumer's fast path, errors)."""

from __future__ import annotations

import json
from typing import Any

import pulsar

from worker.core.messages import PAYLOAD_TOO_LARGE, Envelope, base64_text, format_message_id


def message_id_of(msg: pulsar.Message) -> str:
    mid = msg.message_id()
    return format_message_id(mid)


# The dead letter of a message its producer encrypted carries what decrypting it needs besides the
# private key (the payload stays as received): the data key encrypted for each key name, the IV...
ENCRYPTION_PROPERTY = "pubsub.encryption_context"
ENCRYPTED = "encrypted by its producer, and the worker holds no key"


def _encryption_json(context: Any) -> str:
    context = getattr(context, "_context", context)  # the C++ client's (the public one wraps it)
    return json.dumps({
        "algorithm": context.algorithm(), "param": base64_text(context.param()),
        "keys": [{"key": k.key, "value": base64_text(k.value()), "metadata": dict(k.metadata)}
                 for k in context.keys()],  # noqa: SIM118 - a method of the client's, not a dict's
        "compression_type": context.compression_type().name,
        "uncompressed_message_size": context.uncompressed_message_size(), "batch_size": context.batch_size(),
    }, separators=(",", ":"))


# Google Pub/Sub's limits on a message's attributes: a message over them is dead-lettered unsent
# (150,000 attributes took 297 ms to turn into one CloudEvents request, on the event loop).
MAX_ATTRIBUTES = 100
MAX_ATTRIBUTE_KEY_BYTES = 256
MAX_ATTRIBUTE_VALUE_BYTES = 1024


def attribute_defect(attributes: dict[str, str]) -> str | None:
    """Why `attributes` are over the limits, or None."""
    if len(attributes) > MAX_ATTRIBUTES:
        return f"attributes_too_large: {len(attributes)} attributes (at most {MAX_ATTRIBUTES})"
    for key, value in attributes.items():
        if len(key.encode()) > MAX_ATTRIBUTE_KEY_BYTES:
            return f"attributes_too_large: a key of {len(key.encode())} bytes (at most {MAX_ATTRIBUTE_KEY_BYTES})"
        if len(value.encode()) > MAX_ATTRIBUTE_VALUE_BYTES:
            return (f"attributes_too_large: a value of {len(value.encode())} bytes "
                    f"(at most {MAX_ATTRIBUTE_VALUE_BYTES})")
    return None


def _length(msg: Any) -> int:
    """The payload's size without copying it (the C++ message's length; the wrapper holds one)."""
    raw = getattr(msg, "_message", msg)
    length = getattr(raw, "length", None)
    return int(length()) if callable(length) else -1


def to_envelope(msg: pulsar.Message, max_payload_bytes: int = 1 << 62) -> Envelope:
    """The contract's view of a Pulsar message. A key or attributes that are not UTF-8, attributes
    over the limits, a payload over `max_payload_bytes` (no request could carry it), or a payload
    encrypted by its producer, never raise or stall here: the message comes out with a `defect`
    (and is dead-lettered with that reason, unsent), its size checked before anything is built."""
    defects = []
    key: str | None = None
    attributes: dict[str, str] = {}
    try:
        key = msg.ordering_key() or msg.partition_key() or None
    except UnicodeDecodeError:
        defects.append("ordering key is not UTF-8")
    try:
        attributes = dict(msg.properties())
    except UnicodeDecodeError:
        defects.append("attributes are not UTF-8")
    if too_many := attribute_defect(attributes):
        defects.append(too_many)
    size = _length(msg)
    handle = None
    if size > max_payload_bytes:
        defects.append(f"{PAYLOAD_TOO_LARGE}: {size} bytes (destinations.max_request_bytes is {max_payload_bytes})")
        handle = msg.message_id()  # acked by id: the client's inflated copy goes as soon as ours is made
    context = msg.encryption_context()
    if context is not None and context.is_decryption_failed():
        defects.append(ENCRYPTED)
        attributes[ENCRYPTION_PROPERTY] = _encryption_json(context)
    return Envelope(
        message_id=message_id_of(msg),
        data=msg.data() or b"",  # kept for the dead-letter topic, whatever its size: nothing is lost
        topic=msg.topic_name(),
        publish_time_ms=msg.publish_timestamp(),
        attributes=attributes,
        ordering_key=key,
        defect="; ".join(defects) or None,
        ack_handle=handle,
    )
