"""The `admin:` section: the operator API's and console's listener, and who may use them.

    admin:
      host: 0.0.0.0
      port: 9465
      tls: {cert_file: /etc/push-worker/tls/tls.crt, key_file: /etc/push-worker/tls/tls.key}
      auth:                      # bearer JWTs from the platform's identity provider
        issuer: https://login.example.com/
        jwks_url: https://login.example.com/.well-known/jwks.json     # or jwks_file
        audience: push-worker
        roles_claim: push_worker_roles    # a list like [operator:p-acme, viewer:p-globex] or [admin]
      tokens:                    # static tokens, each read from a mounted secret
        - {subject: ci, file: /var/run/secrets/push-worker-admin/ci, roles: [operator:p-acme]}

Roles: `viewer:<project>` reads one project's subscriptions, `operator:<project>` also acts on them,
`admin` is every project's operator. Nothing is served without a token that carries one of them.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from worker.model.subscriptions import PROJECT_PATTERN
from worker.runtime.fields import FieldReader

ROLES = ("viewer", "operator")
ROLE_RULE = "must be admin, viewer:<project> or operator:<project> (a project like p-acme)"


@dataclass(frozen=True)
class Grants:
    """What one principal may do: `admin` (every project), else a role per project."""

    admin: bool = False
    projects: dict[str, str] = field(default_factory=dict)  # project -> viewer | operator

    def sees(self, project: str) -> bool:
        return self.admin or project in self.projects

    def acts_on(self, project: str) -> bool:
        return self.admin or self.projects.get(project) == "operator"

    def describe(self) -> list[str]:
        return ["admin"] if self.admin else [f"{role}:{p}" for p, role in sorted(self.projects.items())]


def parse_roles(values: object) -> Grants | None:
    """Grants from role strings; None when any of them is not one (the caller says which rule)."""
    if not isinstance(values, list | tuple) or not values:
        return None
    admin = False
    projects: dict[str, str] = {}
    for value in values:
        if value == "admin":
            admin = True
            continue
        role, _, project = str(value).partition(":")
        if not isinstance(value, str) or role not in ROLES or not PROJECT_PATTERN.fullmatch(project):
            return None
        if projects.get(project) != "operator":  # the stronger of two roles on one project
            projects[project] = role
    return Grants(admin, projects)


@dataclass(frozen=True)
class StaticToken:
    subject: str
    file: str  # the mounted secret holding the token (read when it changes, never logged)
    grants: Grants


@dataclass(frozen=True)
class JwtSettings:
    issuer: str
    audience: str
    jwks_url: str | None = None
    jwks_file: str | None = None
    roles_claim: str = "push_worker_roles"


@dataclass(frozen=True)
class AdminSettings:
    host: str = "127.0.0.1"
    port: int = 9465
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    jwt: JwtSettings | None = None
    tokens: tuple[StaticToken, ...] = ()
    grafana_url: str = ""  # the console links each subscription to its Grafana dashboard there
    refresh_seconds: int = 15  # a subscription's page and the endpoint view reload themselves this often (0: never)


def is_loopback_url(url: str) -> bool:
    """Whether `url` names this machine (localhost or a loopback address)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _https(r: FieldReader, name: str) -> str:
    value = r.text(name)
    parts = urlsplit(value)
    if parts.scheme != "https" and not (parts.scheme == "http" and is_loopback_url(value)):
        raise r.fail(name, "must be an https:// URL (http:// only to a loopback address)")
    if not parts.hostname:
        raise r.fail(name, "must be a URL with a host")
    return value


def _jwt(a: FieldReader) -> JwtSettings:
    a.reject_unknown({"issuer", "audience", "jwks_url", "jwks_file", "roles_claim"})
    if a.has("jwks_url") == a.has("jwks_file"):
        raise a.fail("jwks_url", "give exactly one of jwks_url or jwks_file (the issuer's public keys)")
    return JwtSettings(issuer=a.text("issuer"), audience=a.text("audience"),
                       jwks_url=_https(a, "jwks_url") if a.has("jwks_url") else None,
                       jwks_file=a.text("jwks_file") if a.has("jwks_file") else None,
                       roles_claim=a.text("roles_claim", "push_worker_roles"))


def _tokens(a: FieldReader) -> tuple[StaticToken, ...]:
    raw = a.data.get("tokens") or []
    if not isinstance(raw, list):
        raise a.fail("tokens", "must be a list of {subject, file, roles}")
    out: list[StaticToken] = []
    for i, item in enumerate(raw):
        t = FieldReader(a.where, item, f"{a.prefix}tokens[{i}].")
        t.reject_unknown({"subject", "file", "roles"})
        grants = parse_roles(t.data.get("roles"))
        if grants is None:
            raise t.fail("roles", f"must be a list of roles; each {ROLE_RULE}")
        out.append(StaticToken(t.text("subject"), t.text("file"), grants))
    subjects = [t.subject for t in out]
    if len(set(subjects)) != len(subjects):
        raise a.fail("tokens", "each subject may be given once (the audit log names who acted by it)")
    return tuple(out)


def parse_admin(a: FieldReader) -> AdminSettings | None:
    """None when the section is absent: the listener is off."""
    if not a.data:
        return None
    a.reject_unknown({"host", "port", "tls", "auth", "tokens", "grafana_url", "refresh_seconds"})
    jwt = _jwt(a.sub("auth")) if a.data.get("auth") else None
    tokens = _tokens(a)
    if jwt is None and not tokens:
        raise a.fail("auth", "the admin listener needs auth (JWTs) or tokens: nothing is served anonymously")
    tls = a.sub("tls")
    tls.reject_unknown({"cert_file", "key_file"})
    if tls.data and not (tls.has("cert_file") and tls.has("key_file")):
        raise tls.fail("cert_file", "tls needs both cert_file and key_file")
    return AdminSettings(host=a.text("host", AdminSettings.host), port=a.integer("port", AdminSettings.port, 0, 65535),
                         tls_cert_file=tls.text("cert_file") if tls.data else None,
                         tls_key_file=tls.text("key_file") if tls.data else None,
                         jwt=jwt, tokens=tokens, grafana_url=_https(a, "grafana_url") if a.has("grafana_url") else "",
                         refresh_seconds=a.integer("refresh_seconds", AdminSettings.refresh_seconds, 0, 3600))
