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
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

FILE_RECHECK_SECONDS = 10.0  # a rotated secret file (Kubernetes Secret volume) is picked up this soon


class SecretUnavailable(Exception):
    """A secret a subscription names cannot be read now (its variable unset, its file missing)."""


SECRET_NAME_RULE = "must be a secret name: 1-63 of a-z 0-9 . _ - starting with a letter or digit, without '..'"  # noqa: S105 - a rule, not a secret
_SECRET_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")


def secret_name_ok(name: str) -> bool:
    """A name that can only mean one file inside a project's directory (no separator, no `..`)."""
    return bool(_SECRET_NAME.fullmatch(name)) and ".." not in name


@dataclass(frozen=True)
class SecretRef:
    """Where a secret lives: a project's named secret (`secret` with its `project`), or, for the
    operator's config file only, an environment variable or a file."""

    env: str | None = None
    file: str | None = None
    secret: str | None = None
    project: str | None = None

    def describe(self) -> str:
        if self.secret is not None:
            return f"secret {self.secret} of project {self.project}"
        return f"env {self.env}" if self.env else f"file {self.file}"


class SecretStore:
    """Reads secrets, caching file contents briefly so a rotated file is picked up without a restart.
    `secrets_dir`: where project secrets live (`secrets.dir`), one directory per project."""

    def __init__(self, environ: Mapping[str, str] | None = None, secrets_dir: Path | None = None) -> None:
        self.environ = os.environ if environ is None else environ
        self.secrets_dir = secrets_dir
        self._files: dict[str, tuple[float, bytes]] = {}

    def read(self, ref: SecretRef) -> bytes:
        if ref.env is not None:
            value = self.environ.get(ref.env)
            if not value:
                raise SecretUnavailable(f"environment variable {ref.env} is not set")
            return value.strip().encode()
        path = self._project_file(ref) if ref.secret is not None else ref.file
        assert path is not None
        cached = self._files.get(path)
        if cached is not None and time.monotonic() - cached[0] < FILE_RECHECK_SECONDS:
            return cached[1]
        try:
            content = Path(path).read_bytes().strip()
        except OSError as e:
            raise SecretUnavailable(f"{ref.describe()}: file {path} cannot be read ({e.strerror})") from None
        if not content:
            raise SecretUnavailable(f"{ref.describe()}: file {path} is empty")
        self._files[path] = (time.monotonic(), content)
        return content

    def _project_file(self, ref: SecretRef) -> str:
        """`<secrets.dir>/<project>/<name>`, resolved; a link that leaves the project's directory is
        refused (Kubernetes' own `..data` links stay inside it)."""
        if self.secrets_dir is None:
            raise SecretUnavailable(f"{ref.describe()}: the worker has no secrets.dir to read project secrets from")
        assert ref.secret is not None and ref.project is not None
        if not secret_name_ok(ref.secret) or not secret_name_ok(ref.project):
            raise SecretUnavailable(f"{ref.describe()}: not a valid secret or project name")
        root = os.path.realpath(self.secrets_dir)
        project_dir = os.path.realpath(self.secrets_dir / ref.project)
        if not project_dir.startswith(root + os.sep):  # the project's directory is a link out of secrets.dir
            raise SecretUnavailable(f"{ref.describe()}: the project's directory links outside secrets.dir")
        path = os.path.realpath(os.path.join(project_dir, ref.secret))
        if not path.startswith(project_dir + os.sep):
            raise SecretUnavailable(f"{ref.describe()}: the file links outside the project's directory")
        return path


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
