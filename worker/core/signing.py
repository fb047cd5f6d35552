"""Endpoint authentication: Standard Webhooks signatures and bearer tokens, from secrets that live in
files or environment variables (never in the config or the registry, which only name them).

Secrets are scoped to their project: a subscription of project P names `{secret: NAME}`, read from
`<secrets.dir>/<P>/<NAME>` and nowhere else (in Kubernetes one Secret per project, projected there).
`{env: VARIABLE}` and `{file: PATH}` name the worker's own environment and file system, so only the
operator's config file may use them; a registry entry that does is refused (`subscriptions.py`).

Signature (https://www.standardwebhooks.com): `webhook-signature: v1,<base64 HMAC-SHA256 of
"<webhook-id>.<webhook-timestamp>.<body>">`. During a rotation a subscription has two secrets and
every request carries both signatures, space-separated; an endpoint accepts a request when any one
matches a secret it knows. A secret written `whsec_<base64>` is used as its decoded bytes (the
Standard Webhooks form); any other secret is used as its UTF-8 bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import time
from collections.abc import Mapping

from worker.endpoint.secrets import SecretRef, SecretStore, SecretUnavailable


def signing_key(secret: bytes) -> bytes:
    """The HMAC key of a secret: `whsec_<base64>` decoded, anything else as is."""
    if secret.startswith(b"whsec_"):
        try:
            return base64.b64decode(secret[6:], validate=True)
        except binascii.Error:
            raise SecretUnavailable("a whsec_ secret is not valid base64") from None
    return secret


def signature(key: bytes, webhook_id: str, timestamp: int, body: bytes) -> str:
    """`v1,<base64 HMAC-SHA256>` over `id.timestamp.body`."""
    mac = hmac.new(key, f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode("ascii")


def webhook_headers(secrets: list[bytes], webhook_id: str, body: bytes, timestamp: int | None = None) -> dict[str, str]:
    """The three Standard Webhooks headers, signed with every secret given (two during a rotation)."""
    ts = int(time.time()) if timestamp is None else timestamp
    return {
        "webhook-id": webhook_id,
        "webhook-timestamp": str(ts),
        "webhook-signature": " ".join(signature(signing_key(s), webhook_id, ts, body) for s in secrets),
    }


def verify(secret: bytes, headers: Mapping[str, str], body: bytes, tolerance: int = 300,
           now: float | None = None) -> bool:
    """What an endpoint does (docs/delivery-contract.md shows the same steps): recompute, compare in constant time,
    and refuse timestamps more than `tolerance` seconds away (replays)."""
    try:
        webhook_id = headers["webhook-id"]
        ts = int(headers["webhook-timestamp"])
        offered = headers["webhook-signature"].split()
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - ts) > tolerance:
        return False
    expected = signature(signing_key(secret), webhook_id, ts, body)
    return any(hmac.compare_digest(expected, candidate) for candidate in offered)


def auth_headers(store: SecretStore, signing_secrets: tuple[SecretRef, ...], bearer_token: SecretRef | None,
                 webhook_id: str, body: bytes) -> dict[str, str]:
    """Headers a subscription's authentication adds to one request (empty when it has none).
    Raises `SecretUnavailable` rather than send a request unsigned."""
    headers: dict[str, str] = {}
    if signing_secrets:
        headers.update(webhook_headers([store.read(ref) for ref in signing_secrets], webhook_id, body))
    if bearer_token is not None:
        headers["Authorization"] = "Bearer " + bearer(store, bearer_token)
    return headers


def bearer(store: SecretStore, ref: SecretRef) -> str:
    """The bearer token `ref` names, if a header can carry it."""
    token = store.read(ref)
    if not re.fullmatch(rb"[\x21-\x7e]+", token):
        raise SecretUnavailable(f"bearer token ({ref.describe()}) has characters a header cannot carry")
    return token.decode("ascii")
