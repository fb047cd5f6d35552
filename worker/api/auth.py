"""Who is asking: a bearer token checked against the static tokens (mounted secrets) or verified as a
JWT of the configured issuer (its JWKS), turned into a `Principal` with its grants.

JWTs must be signed with an asymmetric key of the issuer's JWKS (RS*, PS*, ES*, EdDSA: never `none`
or a shared secret), carry `exp`, the configured `iss` and `aud`, and a `sub`. Their roles are the
`roles_claim` (settings.py). The JWKS is fetched over TLS, kept for JWKS_TTL seconds, and fetched
again at once (at most every JWKS_REFRESH_MIN seconds) when a token names a key id it lacks: the
issuer's key rotation needs no restart.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import orjson

from worker.broker.broker_admin import read_capped
from worker.model.admin_settings import AdminSettings, Grants, JwtSettings, parse_roles
from worker.runtime import logs

ALGORITHMS = ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"]
JWKS_TTL = 300.0
JWKS_REFRESH_MIN = 30.0
JWKS_BODY_CAP = 1 << 20
LEEWAY_SECONDS = 30
MAX_TOKEN_BYTES = 16 * 1024


class Unauthorized(Exception):
    """No usable credentials: 401 (the reason goes to the log, the answer says only that)."""


@dataclass(frozen=True)
class Principal:
    subject: str
    grants: Grants
    token: str  # kept for the console's CSRF value; never logged
    expires_at: float | None = None  # a JWT's exp (epoch seconds): the console's session ends with it
    via: str = "token"  # "token" (admin.tokens) or "jwt": two namespaces of subjects, never one

    @property
    def caller(self) -> str:
        """Who the limits count: a static token's subject and a JWT's with the same name are two callers."""
        return f"{self.via}:{self.subject}"


class StaticTokens:
    """The configured tokens, each read from its file and read again when the file changes (a
    rotated Kubernetes secret). Kept as SHA-256 digests: a lookup compares no secret byte by byte."""

    def __init__(self, settings: AdminSettings) -> None:
        self.entries = settings.tokens
        self._read: dict[str, tuple[float, str]] = {}  # file -> (mtime, digest)

    def _digest_of(self, path: str) -> str | None:
        try:
            mtime = os.stat(path).st_mtime
            known = self._read.get(path)
            if known is not None and known[0] == mtime:
                return known[1]
            token = Path(path).read_text("utf-8").strip()
        except (OSError, UnicodeDecodeError):
            logs.get().warning("admin token file unreadable", file=path)
            return None
        if not token:
            return None
        digest = hashlib.sha256(token.encode()).hexdigest()
        self._read[path] = (mtime, digest)
        return digest

    def match(self, token: str) -> tuple[str, Grants] | None:
        digest = hashlib.sha256(token.encode()).hexdigest()
        for entry in self.entries:
            if self._digest_of(entry.file) == digest:
                return entry.subject, entry.grants
        return None


class Jwks:
    """The issuer's public keys, from its URL or a file."""

    def __init__(self, settings: JwtSettings, session: aiohttp.ClientSession) -> None:
        self.settings = settings
        self.session = session
        self._keys: dict[str, jwt.PyJWK] = {}
        self._at = -JWKS_TTL
        self._mtime = -1.0
        self._lock = asyncio.Lock()

    async def key(self, kid: str) -> jwt.PyJWK | None:
        now = time.monotonic()
        stale = now - self._at >= JWKS_TTL or (kid not in self._keys and now - self._at >= JWKS_REFRESH_MIN)
        if stale or self._file_changed():
            async with self._lock:
                if time.monotonic() - self._at >= min(JWKS_REFRESH_MIN, JWKS_TTL) or self._file_changed():
                    await self._load()
        return self._keys.get(kid)

    def _file_changed(self) -> bool:
        path = self.settings.jwks_file
        try:
            return path is not None and os.stat(path).st_mtime != self._mtime
        except OSError:
            return False

    async def _load(self) -> None:
        self._at = time.monotonic()
        try:
            if self.settings.jwks_file is not None:
                self._mtime = os.stat(self.settings.jwks_file).st_mtime
                raw = _read_file(self.settings.jwks_file)
            else:
                assert self.settings.jwks_url is not None
                timeout = aiohttp.ClientTimeout(total=10)
                async with self.session.get(self.settings.jwks_url, timeout=timeout, allow_redirects=False) as r:
                    raw = await read_capped(r, JWKS_BODY_CAP)
                    r.raise_for_status()
            keys: dict[str, jwt.PyJWK] = {}
            for data in orjson.loads(raw).get("keys", []):
                try:
                    key = jwt.PyJWK(data)
                except (jwt.PyJWKError, jwt.InvalidKeyError):
                    continue  # a key type this verifier does not take (an HMAC secret, say): not usable
                if key.key_id and key.algorithm_name in ALGORITHMS:
                    keys[key.key_id] = key
            self._keys = keys
        except (OSError, ValueError, AttributeError, aiohttp.ClientError, TimeoutError) as e:
            # The keys known stay in use; the log says why they were not renewed.
            logs.get().warning("admin JWKS unreadable", error=type(e).__name__, detail=str(e)[:200])


def _read_file(path: str) -> bytes:
    """A mounted JWKS: a small local file, read where the event loop may wait a moment for it."""
    with open(path, "rb") as f:
        return f.read(JWKS_BODY_CAP)


class Authenticator:
    def __init__(self, settings: AdminSettings, session: aiohttp.ClientSession) -> None:
        self.static = StaticTokens(settings)
        self.jwt_settings = settings.jwt
        self.jwks = Jwks(settings.jwt, session) if settings.jwt is not None else None

    async def principal(self, token: str) -> Principal:
        if not token or len(token) > MAX_TOKEN_BYTES:
            raise Unauthorized("no token")
        static = self.static.match(token)
        if static is not None:
            return Principal(static[0], static[1], token)
        if self.jwks is None or self.jwt_settings is None or token.count(".") != 2:
            raise Unauthorized("unknown token")
        return await self._verified(token, self.jwt_settings, self.jwks)

    async def _verified(self, token: str, settings: JwtSettings, jwks: Jwks) -> Principal:
        try:
            header = jwt.get_unverified_header(token)
            key = await jwks.key(str(header.get("kid", "")))
            if key is None or header.get("alg") != key.algorithm_name:
                raise Unauthorized("signed with a key the issuer does not publish")
            claims: dict[str, Any] = jwt.decode(
                token, key.key, algorithms=[key.algorithm_name], audience=settings.audience, issuer=settings.issuer,
                leeway=LEEWAY_SECONDS, options={"require": ["exp", "iss", "aud", "sub"]})
        except jwt.PyJWTError as e:
            raise Unauthorized(f"JWT refused: {type(e).__name__}") from None
        grants = parse_roles(claims.get(settings.roles_claim))
        if grants is None:
            raise Unauthorized(f"JWT without usable roles in {settings.roles_claim}")
        subject = claims["sub"]
        if not isinstance(subject, str) or not subject.strip() or not subject.isprintable() or len(subject) > 256:
            raise Unauthorized("JWT whose sub is not a name (empty, unprintable or over 256 characters)")
        return Principal(subject, grants, token, expires_at=float(claims["exp"]), via="jwt")
