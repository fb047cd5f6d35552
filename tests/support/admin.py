"""What the operator API's and console's tests share: principals with their tokens (static ones in
files, as mounted secrets, and JWTs of a test issuer whose JWKS is a file), and a client that checks
every answer against the OpenAPI document."""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import jwt
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from worker.api.routes import openapi_document
from worker.model.admin_settings import AdminSettings, JwtSettings, StaticToken, parse_roles

ISSUER = "https://login.test.example/"
AUDIENCE = "push-worker"
# name -> roles: static tokens, each in a file of its own
PRINCIPALS = {"alice": ["operator:p-a"], "victor": ["viewer:p-a"], "bob": ["operator:p-b"], "root": ["admin"]}


@dataclass
class Issuer:
    """A test identity provider: signs JWTs with its key, publishes the public half as a JWKS file."""

    key: rsa.RSAPrivateKey
    kid: str

    def token(self, subject: str, roles: list[str], *, expires_in: float = 300, audience: str = AUDIENCE,
              issuer: str = ISSUER, **claims: Any) -> str:
        now = int(time.time())
        payload = {"iss": issuer, "aud": audience, "sub": subject, "iat": now, "exp": now + int(expires_in),
                   "push_worker_roles": roles, **claims}
        return jwt.encode(payload, self.key, algorithm="RS256", headers={"kid": self.kid})


def new_issuer() -> Issuer:
    return Issuer(rsa.generate_private_key(public_exponent=65537, key_size=2048), uuid.uuid4().hex[:8])


def write_jwks(path: Path, issuer: Issuer) -> None:
    public = json.loads(RSAAlgorithm.to_jwk(issuer.key.public_key()))
    path.write_text(json.dumps({"keys": [{**public, "kid": issuer.kid, "alg": "RS256", "use": "sig"}]}))


def admin_settings(directory: Path, issuer: Issuer | None = None,
                   refresh_seconds: int = 3600) -> tuple[AdminSettings, dict[str, str]]:
    """The admin listener on a free port with a static token per PRINCIPALS entry (and JWTs of
    `issuer`); returns the settings and each principal's token. Live pages reload every 15 s by
    default: here once an hour, so that no reload races a test's clicks (the live view's own test
    keeps the default)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokens: dict[str, str] = {}
    static = []
    for name, roles in PRINCIPALS.items():
        tokens[name] = f"{name}-{uuid.uuid4().hex}"
        (directory / name).write_text(tokens[name] + "\n")
        grants = parse_roles(roles)
        assert grants is not None
        static.append(StaticToken(name, str(directory / name), grants))
    jwt_settings = None
    if issuer is not None:
        write_jwks(directory / "jwks.json", issuer)
        jwt_settings = JwtSettings(ISSUER, AUDIENCE, jwks_file=str(directory / "jwks.json"))
    return AdminSettings(port=0, tokens=tuple(static), jwt=jwt_settings, refresh_seconds=refresh_seconds), tokens


def _operation(method: str, path: str) -> tuple[str, dict[str, Any]]:
    """The OpenAPI path template and operation that `path` matches."""
    for template, item in openapi_document()["paths"].items():
        pattern = "^" + re.sub(r"\{[^}]+\}", "[^/]+", template) + "$"
        if re.match(pattern, path) and method.lower() in item:
            return template, item[method.lower()]
    raise AssertionError(f"{method} {path} is not in the OpenAPI document")


def check_against_openapi(method: str, path: str, status: int, body: Any) -> None:
    """The answer's status is documented for the operation, and its body matches that schema."""
    document = openapi_document()
    template, operation = _operation(method, path)
    documented = operation["responses"].get(str(status))
    assert documented is not None, f"{method} {template} answered {status}, which the document does not list"
    if "$ref" in documented:
        documented = document["components"]["responses"][documented["$ref"].rsplit("/", 1)[1]]
    schema = documented["content"]["application/json"]["schema"]
    resolver_root = {**schema, "components": document["components"]}
    jsonschema.validate(body, resolver_root, cls=jsonschema.Draft202012Validator)


class ApiClient:
    """Calls the API as one principal; every answer is checked against the OpenAPI document."""

    def __init__(self, base: str, token: str | None) -> None:
        self.base = base
        self.token = token

    async def raw(self, path: str) -> tuple[int, bytes, dict[str, str]]:
        """A GET whose answer is not JSON (a payload download): status, bytes, headers."""
        sent = {"Authorization": f"Bearer {self.token}"} if self.token is not None else {}
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session, \
                session.get(self.base + path, headers=sent) as response:
            return response.status, await response.read(), dict(response.headers)

    async def call(self, method: str, path: str, body: Any = None, **headers: str) -> tuple[int, Any]:
        sent = dict(headers)
        if self.token is not None:
            sent["Authorization"] = f"Bearer {self.token}"
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session, \
                session.request(method, self.base + path, json=body, headers=sent) as response:
            data = await response.json(content_type=None)
            check_against_openapi(method, path.split("?")[0], response.status, data)
            return response.status, data
