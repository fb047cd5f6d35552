"""OAuth 2.0 client credentials (RFC 6749, section 4.4) for push requests (`deliver.push.oauth2`):
the worker fetches an access token from the subscription's token URL with its client id and its
project's client secret (HTTP Basic, as section 2.3.1 asks every server to accept), sends it as
`Authorization: Bearer`, keeps it until shortly before `expires_in` runs out, and fetches a new
one after the endpoint answers 401.

The token URL is fetched through the same guarded client as push requests: the destination policy
applies to it (a private or special-purpose address is refused unless admitted), the client secret
goes over plain http only to an address admitted for credentials, and the answer is read with a
cap. A token that cannot be had makes the attempt `not_sent` with the reason (`SecretUnavailable`:
not a subclass, which the compiled dispatcher could not catch as one): nothing is ever sent
without it."""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from yarl import URL

from worker.endpoint.secrets import SecretRef, SecretStore, SecretUnavailable

TOKEN_ANSWER_CAP = 64 * 1024  # bytes of a token endpoint's answer read at most
FETCH_SECONDS = 10.0  # a token endpoint's whole answer, at most
RENEW_BEFORE = 0.1  # a token is renewed when this share of its lifetime is left (at least 5 s before)
DEFAULT_LIFETIME = 300.0  # seconds, for an answer without expires_in
MAX_TOKENS = 10_000  # tokens cached at once


@dataclass(frozen=True)
class OAuth2:
    """`deliver.push.oauth2`."""

    token_url: str
    client_id: str
    client_secret: SecretRef
    scope: str | None = None
    audience: str | None = None


@dataclass
class _Token:
    value: str
    renew_at: float


class TokenAnswer(Protocol):
    status: int
    body: bytes


class TokenClient(Protocol):
    """What fetches the tokens: the worker's own HTTP client (`core.http1.Client` fits), so that a
    fetch goes through the destination policy and the project's share of connections."""

    async def post(self, url: URL, headers: dict[str, str], body: bytes, cap: int,
                   deadline: float | None = None, credentials: bool = False, owner: str = "",
                   tls: Any = None, keep_body: bool = False) -> TokenAnswer: ...


class OAuth2Tokens:
    """Access tokens per (token URL, client, secret, scope, audience), fetched once for all the
    requests that need one at the same moment."""

    def __init__(self, secrets: SecretStore, client: TokenClient) -> None:
        self.secrets = secrets
        self.client = client
        self._tokens: dict[bytes, _Token] = {}
        self._fetching: dict[bytes, asyncio.Future[_Token]] = {}

    async def token(self, oauth: OAuth2, owner: str) -> str:
        """A token for `oauth` (`owner`: the project, whose share of connections the fetch takes)."""
        secret = self.secrets.read(oauth.client_secret)
        key = _key(oauth, secret)
        known = self._tokens.get(key)
        if known is not None and time.monotonic() < known.renew_at:
            return known.value
        fetching = self._fetching.get(key)
        if fetching is None:
            fetching = self._fetching[key] = asyncio.ensure_future(self._fetch(oauth, secret, owner))
            fetching.add_done_callback(lambda _: self._fetching.pop(key, None))
        token = await asyncio.shield(fetching)
        if len(self._tokens) >= MAX_TOKENS:
            self._tokens.clear()
        self._tokens[key] = token
        return token.value

    def refused(self, oauth: OAuth2) -> None:
        """The endpoint answered 401 with a token of `oauth`: the next request fetches a new one."""
        self._tokens.pop(_key(oauth, self.secrets.read(oauth.client_secret)), None)

    async def _fetch(self, oauth: OAuth2, secret: bytes, owner: str) -> _Token:
        form = {"grant_type": "client_credentials"}
        if oauth.scope:
            form["scope"] = oauth.scope
        if oauth.audience:
            form["audience"] = oauth.audience
        # Section 2.3.1: id and secret form-encoded, then joined for Basic.
        basic = (urllib.parse.quote(oauth.client_id, safe="") + ":" +
                 urllib.parse.quote(secret.decode(errors="replace"), safe=""))
        headers = {"Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json",
                   "Authorization": "Basic " + base64.b64encode(basic.encode()).decode()}
        started = time.monotonic()
        where = f"token endpoint {oauth.token_url}"
        try:
            answer = await self.client.post(URL(oauth.token_url), headers, urllib.parse.urlencode(form).encode(),
                                            TOKEN_ANSWER_CAP, FETCH_SECONDS, credentials=True, owner=owner,
                                            keep_body=True)
        except TimeoutError:
            raise SecretUnavailable(f"{where}: no answer in {FETCH_SECONDS:g}s") from None
        except Exception as e:  # refused by the destination policy, connection or protocol errors
            raise SecretUnavailable(f"{where}: {type(e).__name__}: {e}"[:300]) from None
        if answer.status != 200:
            raise SecretUnavailable(f"{where} answered {answer.status}")
        token, lifetime = _read_token(answer.body)
        if token is None:
            raise SecretUnavailable(f"{where}: the answer has no bearer access_token")
        return _Token(token, started + max(lifetime - max(5.0, lifetime * RENEW_BEFORE), 0.0))


@functools.lru_cache(maxsize=MAX_TOKENS)  # per request otherwise: a hash of the settings each time
def _key(oauth: OAuth2, secret: bytes) -> bytes:
    """Whose token: the client at that token URL with that secret (a rotated secret gets its own)."""
    return hashlib.sha256(orjson.dumps([oauth.token_url, oauth.client_id, oauth.scope, oauth.audience])
                          + secret).digest()


def _read_token(body: bytes) -> tuple[str | None, float]:
    """The access token and its lifetime in seconds from a token answer (section 5.1)."""
    try:
        data: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, 0.0
    if not isinstance(data, dict):
        return None, 0.0
    token, kind, expires = data.get("access_token"), data.get("token_type", "bearer"), data.get("expires_in")
    # A header cannot carry every character: a token that could not be sent as it is, is none.
    if not isinstance(token, str) or not token.isascii() or not token.isprintable() or not token or \
            not isinstance(kind, str) or kind.lower() != "bearer":
        return None, 0.0
    lifetime = float(expires) if isinstance(expires, int | float) and not isinstance(expires, bool) and \
        0 < expires < 10**8 else DEFAULT_LIFETIME
    return token, lifetime
