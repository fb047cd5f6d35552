"""Worker configuration: a YAML file, validated at load, with environment overrides for connections.

Environment variables (they win over the file, so secrets need not live in it):
  PUSH_WORKER_PULSAR_URL     pulsar.service_url
  PUSH_WORKER_PULSAR_TOKEN   pulsar auth token (never read from the file)
  PUSH_WORKER_PULSAR_ADMIN_URL  pulsar.admin_url
  PUSH_WORKER_REDIS_URL      redis.url (may carry a password; it is never logged)
  PUSH_WORKER_REDIS_PASSWORD the Redis password for cluster and sentinel modes (never read from the file)
  PUSH_WORKER_REDIS_SENTINEL_PASSWORD  the Sentinels' own password (never read from the file)
  PUSH_WORKER_STATE_DIR      state_dir
  PUSH_WORKER_HTTP_PORT      http.port
  PUSH_WORKER_FLEET          fleet.name
  PUSH_WORKER_ID             this worker's id in the fleet (default: hostname-pid; use the pod name)

Traces follow OpenTelemetry's own variables (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_HEADERS,
OTEL_TRACES_SAMPLER, OTEL_RESOURCE_ATTRIBUTES, OTEL_BSP_*...): `_tracing` below.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import os
import re
import sys
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import yaml

from worker.endpoint.destinations import DestinationPolicy
from worker.endpoint.oidc import OidcIssuer, OidcKey
from worker.endpoint.secrets import SecretRef
from worker.model import deprecations
from worker.model.admin_settings import AdminSettings, is_loopback_url, parse_admin
from worker.model.subscriptions import (
    ERROR_AFTER_SECONDS,
    NAME_PATTERN,
    NAME_RULE,
    Subscription,
    is_push,
    parse_subscription,
)
from worker.runtime.errors import ConfigError, ConfigErrors
from worker.runtime.fields import FieldReader, bounds, declared, read, setting, yaml_fields

T = TypeVar("T")

PULSAR_SCHEMES = ("pulsar", "pulsar+ssl")
REDIS_SCHEMES = ("redis", "rediss", "unix")
REDIS_MODES = ("standalone", "cluster", "sentinel")

DEFAULT_MAX_MESSAGE_BYTES = 5 * 1024 * 1024  # Apache Pulsar's default maxMessageSize


DEFAULT_STATE_DIR = Path(".push-worker")


@dataclass(frozen=True)
class PulsarSettings:
    """Broker connection. `service_url` None means: start an embedded pulsar-lite under state_dir."""

    service_url: str | None = setting(None, read_by_hand=True, kind="pulsar:// or pulsar+ssl:// URL",
                                      help="the broker (none: an embedded pulsar-lite under state_dir); "
                                           "$PUSH_WORKER_PULSAR_URL overrides it, $PUSH_WORKER_PULSAR_TOKEN is "
                                           "its token")
    tls_trust_certs_file: str | None = setting(None, read_by_hand=True, kind="path",
                                               help="the CA for pulsar+ssl:// and an https admin_url")
    auth_token: str | None = field(default=None, repr=False)  # environment only
    operation_timeout_seconds: int = setting(30, 1, 600, help="a broker call (subscribe, publish, seek) gives up "
                                                              "after this")
    admin_url: str | None = setting(None, read_by_hand=True, kind="http(s) URL",
                                    help="the backlog's source: the admin REST API ($PUSH_WORKER_PULSAR_ADMIN_URL)")
    metrics_url: str | None = setting(None, read_by_hand=True, kind="http(s) URL",
                                      help="...or the broker's Prometheus endpoint")
    backlog_interval_seconds: float = setting(15.0, 1.0, 3600.0, help="how often the backlog is read")
    # The broker's largest message (its maxMessageSize): a consumer prefetches no more of these than
    # fit in its share of max_held_bytes_per_subscription (prefetch.py).
    max_message_bytes: int = setting(DEFAULT_MAX_MESSAGE_BYTES, 1024, 2**31 - 1,
                                     help="the broker's maxMessageSize: bounds what a consumer prefetches")


@dataclass(frozen=True)
class RedisSettings:
    """Redis connection. `url` None in standalone mode means: start an embedded redis-server under
    state_dir. Cluster: `url` or `nodes` name seed nodes. Sentinel: `sentinels` and `master_name`."""

    url: str | None = setting(None, read_by_hand=True, hidden=True, kind="redis://, rediss:// or unix:// URL",
                              help="Redis (none in standalone mode: an embedded redis-server under state_dir); "
                                   "$PUSH_WORKER_REDIS_URL overrides it")
    mode: str = setting("standalone", choices=REDIS_MODES, read_by_hand=True,
                        help="what the other fields mean depends on it")
    nodes: tuple[str, ...] = setting((), read_by_hand=True, kind="list of host:port",
                                     help="cluster seed nodes (mode cluster)")
    sentinels: tuple[str, ...] = setting((), read_by_hand=True, kind="list of host:port",
                                         help="the Sentinels (mode sentinel)")
    master_name: str | None = setting(None, read_by_hand=True, help="the name the Sentinels monitor")
    username: str | None = setting(None, read_by_hand=True, help="the ACL user ($PUSH_WORKER_REDIS_PASSWORD is "
                                                                  "the password in cluster and sentinel modes)")
    password: str | None = field(default=None, repr=False)  # cluster/sentinel data nodes (environment only)
    sentinel_password: str | None = field(default=None, repr=False)  # environment only
    tls: bool = setting(False, read_by_hand=True, help="TLS to cluster nodes or Sentinels and the master "
                                                       "(standalone: a rediss:// URL)")
    tls_ca_file: str | None = setting(None, read_by_hand=True, kind="path", help="the CA for tls")
    attempts_ttl_seconds: int = setting(7 * 24 * 3600, 60, 10**8, help="attempt records expire after this much "
                                                                        "quiet")
    history_ttl_seconds: int = setting(3 * 24 * 3600, 60, 10**8, help="how long `push-worker show` can see a "
                                                                       "message's attempts")
    # The same for a message acked at its first attempt: most messages, with nothing to investigate,
    # so kept briefly (0: not kept). Redis holds about 350 bytes per message for this long.
    acked_history_ttl_seconds: int = setting(3600, 0, 10**8, help="... when it was acked at its first attempt "
                                                                  "(0: not kept)")
    # How long a settled message's counter stays as a marker: a copy the broker redelivers within
    # this (its ack was lost to a crash or a broker outage) is acked without a request.
    settled_ttl_seconds: int = setting(600, 60, 10**8, help="a settled message's marker: a redelivered copy is "
                                                            "acked unsent")
    # The delivery log (a Redis stream per subscription: every attempt with its headers both ways):
    # what the API's and the console's search read. Whichever bound comes first (docs/sizing.md#redis).
    delivery_log_seconds: int = setting(3 * 24 * 3600, 3600, 90 * 24 * 3600,
                                        help="how long the delivery log keeps an attempt")
    delivery_log_attempts: int = setting(100_000, 0, 10_000_000,
                                         help="the most attempts the delivery log keeps per subscription (0: none, "
                                              "no log)")


@dataclass(frozen=True)
class HttpSettings:
    """The worker's own HTTP listener for /metrics, /healthz and /readyz."""

    host: str = setting("127.0.0.1", read_by_hand=True, help="/metrics, /healthz, /readyz, the OIDC keys")
    port: int = setting(9464, 0, 65535, read_by_hand=True, help="$PUSH_WORKER_HTTP_PORT overrides it")


@dataclass(frozen=True)
class FleetSettings:
    """Membership and lease timing. Takeover after a crash happens within about `lease_seconds`."""

    name: str = setting("default", read_by_hand=True, help="workers with the same Redis and fleet name share the "
                                                           "subscriptions ($PUSH_WORKER_FLEET overrides it)")
    lease_seconds: float = setting(10.0, 2.0, 300.0, help="a killed worker's subscriptions are taken over within "
                                                          "about this")
    heartbeat_seconds: float = setting(1.0, 0.1, 60.0, help="heartbeat and lease renewal period (at most "
                                                            "lease_seconds / 2)")
    error_after_seconds: float = setting(ERROR_AFTER_SECONDS, 0.0, 86400.0,
                                         help="an endpoint failing every attempt this long: state Error")
    expire_backlog: int = setting(10_000, 1, 10**12, help="a backlog at or above this...")
    expire_after_seconds: float = setting(3600.0, 1.0, 30 * 86400.0,
                                          help="...for this long: state Expired (the platform's policy)")
    max_subscriptions_per_project: int = setting(1000, 1, 100_000,
                                                 help="a project's registry entries beyond this are Invalid")
    broker_lost_after_seconds: float = setting(30.0, 5.0, 3600.0, help="a worker whose broker has not answered "
                                               "this long hands its subscriptions to the others until it does")
    backlog_per_worker: int = setting(5000, 1, 10**12, help="a subscription with max_workers > 1 gets one more "
                                                            "worker while its backlog exceeds this per serving "
                                                            "worker (the HPA's per-replica target)")
    spread_quiet_seconds: float = setting(300.0, 0.0, 86_400.0, help="...and one fewer after its backlog stayed "
                                                                     "below what one fewer is for this long")
    trial_seconds: float = setting(5.0, 0.0, 600.0, help="a subscription whose holder died with its memory "
                                   "alarm raised is served on trial, on a Pulsar client of its own, for this "
                                   "long by the next holder; a death on trial that the alarm lays at its door "
                                   "quarantines it (0: no trials, no quarantine)")
    trials_at_once: int = setting(32, 1, 1000, help="suspects on trial at once on one worker, each on a Pulsar "
                                                    "client of its own")


@dataclass(frozen=True)
class TracingSettings:
    """OpenTelemetry traces of deliveries, exported by OTLP over HTTP: off unless an endpoint is
    configured here or by OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT (the standard variables win)."""

    endpoint: str | None = setting(None, read_by_hand=True, kind="http(s) URL",
                                   help="the OTLP/HTTP receiver, e.g. http://otel-collector:4318 (/v1/traces is "
                                        "added); none: no traces ($OTEL_EXPORTER_OTLP_ENDPOINT overrides it)")
    sample_ratio: float = setting(1.0, 0.0, 1.0, help="the share of new traces sampled; a message whose publisher "
                                                      "sampled it or not follows its publisher "
                                                      "($OTEL_TRACES_SAMPLER overrides it)")
    max_queue_size: int = setting(2048, 1, 1_000_000, help="spans waiting for export; beyond it they are dropped "
                                                           "and counted ($OTEL_BSP_MAX_QUEUE_SIZE overrides it)")
    service_name: str = setting("push-worker", read_by_hand=True,
                                help="the service.name of the spans ($OTEL_SERVICE_NAME overrides it)")
    # Resolved at load, not settings: the traces URL (None: off), and whether OTEL_TRACES_SAMPLER chose.
    traces_url: str | None = None
    sampler_from_environment: bool = False

    @property
    def enabled(self) -> bool:
        return self.traces_url is not None


# Payload bytes of the messages one subscription holds at once (taken from the broker, not settled):
# `max_ack_pending` in bytes. The process holds about three times as much for them (the payload,
# its base64 and the JSON body); docs/sizing.md sizes the pod's memory from it.
DEFAULT_MAX_HELD_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Settings:
    """Everything a worker process needs, validated."""

    pulsar: PulsarSettings = setting(PulsarSettings, section=True, help="the broker")
    redis: RedisSettings = setting(RedisSettings, section=True, help="Redis")
    state_dir: Path = setting(DEFAULT_STATE_DIR, read_by_hand=True,
                              help="the embedded broker's and Redis's data: one worker per state_dir "
                                   "($PUSH_WORKER_STATE_DIR overrides it)")
    http: HttpSettings = setting(HttpSettings, section=True, help="the worker's own listener")
    destinations: DestinationPolicy = setting(DestinationPolicy, section=True, help="where pushes may go")
    subscriptions: tuple[Subscription, ...] = setting((), section=True, help="the config file's subscriptions")
    fleet: FleetSettings = setting(FleetSettings, section=True, help="membership and leases")
    shutdown_grace_seconds: float = setting(30.0, 0.0, 3600.0, help="how long requests under way may finish "
                                                                    "after SIGTERM")
    max_held_bytes_per_subscription: int = setting(DEFAULT_MAX_HELD_BYTES, 1 << 20, 64 << 30,
                                                   help="memory one subscription's unsettled messages may take")
    # Every subscription's together; None: half the container's memory limit.
    max_held_bytes: int | None = setting(None, 16 << 20, 1 << 40, read_by_hand=True,
                                         help="all subscriptions together (none: half the container's memory "
                                              "limit, or 512 MiB)")
    secrets_dir: Path | None = setting(None, read_by_hand=True, yaml="secrets.dir",
                                       help="project secrets: {secret: NAME} is <dir>/<project>/NAME")
    oidc: OidcIssuer | None = setting(None, read_by_hand=True, kind="{issuer, signing_keys}",
                                      help="the fleet's OIDC issuer and signing keys (deliver.push.oidc)")
    tracing: TracingSettings = setting(TracingSettings, section=True, help="OpenTelemetry traces (off unless "
                                                                           "configured); docs/observability.md")
    admin: AdminSettings | None = setting(None, read_by_hand=True, kind="{host, port, tls, auth, tokens}",
                                          help="the operator API and console's listener (none: off); "
                                               "docs/operator-api.md")
    log_format: str = setting("auto", choices=("auto", "json", "console"), yaml="log.format",
                              help="auto: console on a terminal, JSON otherwise")
    log_level: str = setting("info", choices=("debug", "info", "warning", "error"), yaml="log.level",
                             help="the least severe line written")
    # Not a setting: a warning line for each key given under a deprecated spelling (model/deprecations.py).
    deprecated: tuple[str, ...] = ()


def _url(r: FieldReader, name: str, schemes: tuple[str, ...], env_name: str = "",
         env: Mapping[str, str] | None = None) -> str | None:
    """A URL field, or the environment variable that overrides it; either is checked the same way."""
    if env_name and env and env.get(env_name):
        return check_url(env[env_name], schemes, "environment", env_name)
    if not r.has(name):
        return None
    value = r.text(name)
    if url_rule_broken(value, schemes):
        raise r.fail(name, url_rule(schemes))
    return value


def url_rule(schemes: tuple[str, ...]) -> str:
    rule = f"must be a URL with scheme {' or '.join(schemes)} and a host (e.g. {schemes[0]}://host:port)"
    if schemes == PULSAR_SCHEMES:
        rule += ", without credentials (the token comes from $PUSH_WORKER_PULSAR_TOKEN)"
    return rule


def url_rule_broken(value: str, schemes: tuple[str, ...]) -> bool:
    try:
        parts = urlsplit(value)
        _ = parts.port  # a port that is not a number raises here
    except ValueError:
        return True
    if schemes == PULSAR_SCHEMES and "@" in parts.netloc:  # the client would take user:pw@ for a host name
        return True
    return parts.scheme not in schemes or (parts.scheme != "unix" and not parts.hostname)


def check_url(value: str, schemes: tuple[str, ...], where: str, name: str) -> str:
    """`value` if it is a URL of one of `schemes` with a host, else a ConfigError naming `name`."""
    if url_rule_broken(value, schemes):
        raise ConfigError(where, name, url_rule(schemes))
    return value


def _addresses(r: FieldReader, name: str) -> tuple[str, ...]:
    """A list of host:port strings."""
    value = r.data.get(name) or []
    rule = "must be a list of host:port addresses (e.g. [redis-0:6379, redis-1:6379])"
    if not isinstance(value, list):
        raise r.fail(name, rule)
    for i, item in enumerate(value):
        host, _, port = str(item).rpartition(":")
        if not isinstance(item, str) or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise r.fail(f"{name}[{i}]", f"must be host:port (got {item!r})")
    return tuple(value)


def _redis_topology(rd: FieldReader, url: str | None, env: Mapping[str, str]) -> dict[str, Any]:
    """Mode and the fields that go with it; a field of another mode is an error, not ignored."""
    mode = rd.choice("mode", REDIS_MODES, "standalone")
    nodes, sentinels = _addresses(rd, "nodes"), _addresses(rd, "sentinels")
    master_name = rd.text("master_name") if rd.has("master_name") else None
    if nodes and mode != "cluster":
        raise rd.fail("nodes", "is for redis.mode cluster only")
    if (sentinels or master_name) and mode != "sentinel":
        raise rd.fail("sentinels" if sentinels else "master_name", "is for redis.mode sentinel only")
    if mode == "cluster" and not (url or nodes):
        raise rd.fail("nodes", "is required with redis.mode cluster (seed nodes as host:port), or set redis.url")
    if mode == "sentinel":
        if not sentinels:
            raise rd.fail("sentinels", "is required with redis.mode sentinel (host:port of each Sentinel)")
        if not master_name:
            raise rd.fail("master_name", "is required with redis.mode sentinel (the name the Sentinels monitor)")
        if url:
            raise rd.fail("url", "is not used with redis.mode sentinel (the Sentinels name the master)")
    tls = rd.data.get("tls", False)
    if not isinstance(tls, bool):
        raise rd.fail("tls", "must be true or false")
    if mode == "standalone" and (tls or rd.has("tls_ca_file")):
        raise rd.fail("tls" if tls else "tls_ca_file",
                      "is for redis.mode cluster or sentinel (standalone: a rediss:// URL)")
    return {"mode": mode, "nodes": nodes, "sentinels": sentinels, "master_name": master_name,
            "username": rd.text("username") if rd.has("username") else None,
            "password": env.get("PUSH_WORKER_REDIS_PASSWORD") or None,
            "sentinel_password": env.get("PUSH_WORKER_REDIS_SENTINEL_PASSWORD") or None,
            "tls": tls, "tls_ca_file": rd.text("tls_ca_file") if rd.has("tls_ca_file") else None}


def _destinations(d: FieldReader) -> DestinationPolicy:
    d.reject_unknown(yaml_fields(DestinationPolicy))
    allow_private = d.data.get("allow_private", False)
    if not isinstance(allow_private, bool):
        raise d.fail("allow_private", "must be true or false")
    cidrs = d.data.get("allow_cidrs") or []
    if not isinstance(cidrs, list):
        raise d.fail("allow_cidrs", "must be a list of CIDRs like 10.20.0.0/16")
    networks = []
    for i, cidr in enumerate(cidrs):
        try:
            networks.append(ipaddress.ip_network(cidr, strict=True) if isinstance(cidr, str) else None)
        except ValueError:
            networks.append(None)
        if networks[-1] is None:
            raise d.fail(f"allow_cidrs[{i}]", f"must be a network in CIDR form like 10.20.0.0/16 (got {cidr!r})")
    return declared(
        DestinationPolicy, d,
        allow_private=allow_private,
        allow_cidrs=tuple(n for n in networks if n is not None),
        max_connections=(d.integer("max_connections", 0, *bounds(DestinationPolicy, "max_connections"))
                         if d.has("max_connections") else None),
    )


def _oidc(o: FieldReader) -> OidcIssuer | None:
    """`oidc: {issuer, signing_keys: [{file|env, key_id}, ...]}`: the first key signs, all are published."""
    if not o.data:
        return None
    o.reject_unknown({"issuer", "signing_keys"})
    issuer = o.text("issuer")
    if url_rule_broken(issuer, ("https", "http")):
        raise o.fail("issuer", url_rule(("https", "http")))
    raw = o.data.get("signing_keys")
    if not isinstance(raw, list) or not 1 <= len(raw) <= 4:
        raise o.fail("signing_keys", "must be a list of one to four {file: PATH or env: VARIABLE, key_id: ID} "
                                     "(the first signs; the others are published during a rotation)")
    keys = []
    for i, item in enumerate(raw):
        k = FieldReader(o.where, item, f"{o.prefix}signing_keys[{i}].")
        k.reject_unknown({"file", "env", "key_id"})
        if k.has("file") == k.has("env"):
            raise o.fail(f"signing_keys[{i}]", "must have exactly one of file or env")
        ref = SecretRef(file=k.text("file")) if k.has("file") else SecretRef(env=k.text("env"))
        keys.append(OidcKey(ref, k.text("key_id")))
    ids = [key.key_id for key in keys]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise o.fail("signing_keys", f"key_id {dup!r} is given twice (each published key needs its own)")
    return OidcIssuer(issuer, tuple(keys))


def parse_settings(data: Any, env: Mapping[str, str] | None = None) -> Settings:
    """Validate a parsed config document (plus environment overrides) into `Settings`."""
    env = os.environ if env is None else env
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("", "config", f"must be a mapping of settings (pulsar, redis, subscriptions, ...), "
                                        f"not a {type(data).__name__}")
    data, deprecated = deprecations.respell(data)
    r = FieldReader("config", data)
    broken: list[ConfigError] = []  # every rule broken, not only the first: `check` names them all

    def section(read_it: Callable[[], T], instead: T) -> T:
        try:
            return read_it()
        except ConfigError as e:
            broken.append(e)
            return instead

    section(lambda: r.reject_unknown(yaml_fields(Settings)), None)
    pulsar = section(lambda: _pulsar(r.sub("pulsar"), env), PulsarSettings())
    redis = section(lambda: _redis(r.sub("redis"), env), RedisSettings())
    http = section(lambda: _http(r.sub("http"), env), HttpSettings())
    destinations = section(lambda: _destinations(r.sub("destinations")), DestinationPolicy())
    fleet = section(lambda: _fleet(r.sub("fleet"), env), FleetSettings())
    tracing = section(lambda: _tracing(r.sub("tracing"), env), TracingSettings())
    log = section(lambda: _log(r.sub("log")), FieldReader("config", {}, "log."))
    secrets_dir = section(lambda: _secrets_dir(r.sub("secrets")), None)
    oidc = section(lambda: _oidc(r.sub("oidc")), None)
    no_subs: tuple[Subscription, ...] = ()
    subs = section(lambda: _subscriptions(r, section), no_subs)
    admin = section(lambda: parse_admin(r.sub("admin")), None)
    settings = section(lambda: declared(
        Settings, r,
        pulsar=pulsar,
        redis=redis,
        # Absolute at load: the embedded broker runs with the state dir as its working directory.
        state_dir=Path(env.get("PUSH_WORKER_STATE_DIR") or r.text("state_dir", str(DEFAULT_STATE_DIR))).absolute(),
        http=http,
        destinations=destinations,
        subscriptions=subs,
        fleet=fleet,
        tracing=tracing,
        max_held_bytes=r.integer("max_held_bytes", 0, *bounds(Settings, "max_held_bytes")) if r.has("max_held_bytes")
        else None,
        secrets_dir=secrets_dir,
        oidc=oidc,
        admin=admin,
        log_format=read(Settings, log, "log_format"),
        log_level=read(Settings, log, "log_level"),
    ), None)
    if broken:
        raise broken[0] if len(broken) == 1 else ConfigErrors(broken)
    assert settings is not None
    return dataclasses.replace(settings, deprecated=deprecated) if deprecated else settings


def _pulsar(p: FieldReader, env: Mapping[str, str]) -> PulsarSettings:
    p.reject_unknown(yaml_fields(PulsarSettings))  # before a field read by hand is judged
    return declared(
        PulsarSettings, p,
        service_url=_url(p, "service_url", PULSAR_SCHEMES, "PUSH_WORKER_PULSAR_URL", env),
        tls_trust_certs_file=p.text("tls_trust_certs_file") if p.has("tls_trust_certs_file") else None,
        auth_token=env.get("PUSH_WORKER_PULSAR_TOKEN") or None,
        admin_url=_url(p, "admin_url", ("http", "https"), "PUSH_WORKER_PULSAR_ADMIN_URL", env),
        metrics_url=_url(p, "metrics_url", ("http", "https")),
    )


def _redis(rd: FieldReader, env: Mapping[str, str]) -> RedisSettings:
    rd.reject_unknown(yaml_fields(RedisSettings))  # before the topology's rules name a field
    redis_url = _url(rd, "url", REDIS_SCHEMES, "PUSH_WORKER_REDIS_URL", env)
    return declared(RedisSettings, rd, url=redis_url, **_redis_topology(rd, redis_url, env))


def _http(h: FieldReader, env: Mapping[str, str]) -> HttpSettings:
    h.reject_unknown(yaml_fields(HttpSettings))
    low, high = bounds(HttpSettings, "port")
    port = h.integer("port", HttpSettings.port, low, high)
    if env.get("PUSH_WORKER_HTTP_PORT"):
        try:
            port = int(env["PUSH_WORKER_HTTP_PORT"])
        except ValueError:
            raise ConfigError("environment", "PUSH_WORKER_HTTP_PORT", "must be an integer") from None
        if not low <= port <= high:
            raise ConfigError("environment", "PUSH_WORKER_HTTP_PORT", f"must be in {low}..{high} (got {port})")
    return HttpSettings(host=h.text("host", HttpSettings.host), port=port)


def _fleet(f: FieldReader, env: Mapping[str, str]) -> FleetSettings:
    f.reject_unknown(yaml_fields(FleetSettings))
    fleet_name = env.get("PUSH_WORKER_FLEET") or f.text("name", FleetSettings.name)
    if not NAME_PATTERN.fullmatch(fleet_name):
        if env.get("PUSH_WORKER_FLEET"):
            raise ConfigError("environment", "PUSH_WORKER_FLEET", NAME_RULE)
        raise f.fail("name", NAME_RULE)
    # The id names the worker in leases, status and consumer names: a space or control character
    # would garble them (a pod name, the default in deploy/, is at most 253 such characters).
    if env.get("PUSH_WORKER_ID") and not re.fullmatch(r"[\x21-\x7e]{1,253}", env["PUSH_WORKER_ID"]):
        raise ConfigError("environment", "PUSH_WORKER_ID", "must be 1-253 visible ASCII characters (the pod name)")
    fleet = declared(FleetSettings, f, name=fleet_name)
    if fleet.heartbeat_seconds * 2 > fleet.lease_seconds:
        raise f.fail("heartbeat_seconds", f"must be at most half of lease_seconds ({fleet.lease_seconds:g})")
    return fleet


def _tracing(t: FieldReader, env: Mapping[str, str]) -> TracingSettings:
    """The `tracing:` section under OpenTelemetry's standard variables, which win: the endpoint
    (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as it is, or OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces), off
    by OTEL_SDK_DISABLED or OTEL_TRACES_EXPORTER=none. The SDK reads the rest itself (headers,
    timeout, sampler, resource attributes, batch sizes)."""
    t.reject_unknown(yaml_fields(TracingSettings))
    base = _url(t, "endpoint", ("http", "https"))
    queue = env.get("OTEL_BSP_MAX_QUEUE_SIZE")
    settings = declared(TracingSettings, t, endpoint=base, service_name=t.text("service_name", "push-worker"))
    if queue:
        if not queue.isdigit() or not 1 <= int(queue) <= 1_000_000:
            raise ConfigError("environment", "OTEL_BSP_MAX_QUEUE_SIZE", "must be an integer in 1..1000000")
        settings = dataclasses.replace(settings, max_queue_size=int(queue))
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter not in ("", "otlp", "none"):
        raise ConfigError("environment", "OTEL_TRACES_EXPORTER", "must be otlp or none (the worker exports OTLP "
                                                                 "over HTTP)")
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or exporter == "none":
        return settings
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = env.get(name, "").strip()
        if protocol and protocol != "http/protobuf":
            raise ConfigError("environment", name, "must be http/protobuf: the worker exports OTLP over HTTP "
                                                   "(the collector's port 4318), not gRPC")
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        url, source = env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"], "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    elif env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or base:
        source = "OTEL_EXPORTER_OTLP_ENDPOINT" if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") else "tracing.endpoint"
        url = (env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or base or "").rstrip("/") + "/v1/traces"
    else:
        return settings
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError("environment" if source.startswith("OTEL") else "config", source,
                          "must be an http:// or https:// URL")
    for name in ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS"):
        # Headers carry the collector's credentials: never in clear text beyond this machine.
        if env.get(name) and parts.scheme == "http" and not is_loopback_url(url):
            raise ConfigError("environment", name, f"are sent only over https:// ({source} is http:// to "
                                                   f"{parts.hostname})")
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip()
    if sampler and sampler not in SAMPLERS:
        raise ConfigError("environment", "OTEL_TRACES_SAMPLER", f"must be one of {', '.join(SAMPLERS)}")
    argument = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if sampler.endswith("traceidratio") and argument and not _ratio(argument):
        raise ConfigError("environment", "OTEL_TRACES_SAMPLER_ARG", "must be a number in 0..1 (the share sampled)")
    return dataclasses.replace(settings, traces_url=url, sampler_from_environment=bool(sampler))


# The samplers the SDK knows by OTEL_TRACES_SAMPLER without another package.
SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
            "parentbased_traceidratio")


def _ratio(text: str) -> bool:
    try:
        return 0.0 <= float(text) <= 1.0
    except ValueError:
        return False


def _log(log: FieldReader) -> FieldReader:
    log.reject_unknown({"format", "level"})
    return log


def _secrets_dir(sec: FieldReader) -> Path | None:
    sec.reject_unknown({"dir"})
    return Path(sec.text("dir")).absolute() if sec.has("dir") else None


def _subscriptions(r: FieldReader, section: Callable[[Callable[[], Any], Any], Any]) -> tuple[Subscription, ...]:
    """The config file's push subscriptions, each judged alone (`section` keeps what each breaks)."""
    raw_subs = r.data.get("subscriptions") or []
    if not isinstance(raw_subs, list):
        raise r.fail("subscriptions", "must be a list")
    subs: list[Subscription] = []
    seen: set[str] = set()

    def one(i: int, item: Any) -> None:
        sub = parse_subscription(item, where=f"subscriptions[{i}]", trusted=True)
        if sub.key in seen:
            raise ConfigError(f"subscription {sub.name!r}", "name", "is defined twice in this project")
        seen.add(sub.key)
        subs.append(sub)

    for i, item in enumerate(raw_subs):
        if is_push(item):
            section(functools.partial(one, i, item), None)
    return tuple(subs)


def load_settings(path: str | Path, env: Mapping[str, str] | None = None) -> Settings:
    """Read and validate a YAML config file."""
    return parse_settings(read_yaml(str(path), "config"), env)


def read_yaml(path: str, where: str) -> Any:
    """A YAML file's content (`-`: standard input); a ConfigError naming `where` and the file if it
    cannot be read or is not YAML in UTF-8."""
    try:
        raw = Path(path).read_bytes() if path != "-" else sys.stdin.buffer.read()
    except OSError as e:
        raise ConfigError(where, path, f"cannot be read ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(where, path, f"is not UTF-8 text (byte {e.start})") from None
    return parse_yaml(text, where, path)


def parse_yaml(text: str, where: str, name: str) -> Any:
    """YAML text's content (the safe subset, a key given twice refused); a ConfigError naming
    `where` and `name` and the line when it is not YAML."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader, with duplicate keys refused
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None)
        raise ConfigError(where, name, f"is not valid YAML{at}" + (f" ({problem})" if problem else "")) from None
    except RecursionError:  # PyYAML's composer recurses per level: 900 nested brackets exhaust the stack
        raise ConfigError(where, name, "is nested too deep") from None


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe subset, refusing a key given twice in one mapping: PyYAML keeps the last one
    silently, so a second `max_deliver:` line further down would quietly override the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor`: keys given beside it override the merged ones, as YAML says
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # refused later, by the base class, as a key that cannot be one
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)
