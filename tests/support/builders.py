"""Subscriptions, settings and worker.yaml files as tests need them: one builder of subscriptions,
`push_sub`, the definition a user writes (YAML/JSON); `make_sub` is the `Subscription` a worker
serves for it."""

from __future__ import annotations

import copy
import dataclasses
import uuid
from pathlib import Path
from typing import Any

import yaml

from worker.endpoint.destinations import DestinationPolicy
from worker.model.config import HttpSettings, PulsarSettings, RedisSettings, Settings, load_settings
from worker.model.subscriptions import Subscription, parse_subscription


def make_settings(broker_url: str, redis: str | RedisSettings, subs: tuple[Subscription, ...], **kw: Any) -> Settings:
    values: dict[str, Any] = {
        "pulsar": PulsarSettings(service_url=broker_url),
        "redis": redis if isinstance(redis, RedisSettings) else RedisSettings(url=redis),
        "http": HttpSettings(port=0), "destinations": DestinationPolicy(allow_private=True),
        "subscriptions": subs, "shutdown_grace_seconds": 5.0,
    }
    values.update(kw)
    return Settings(**values)


# What a test subscription has unless the test says otherwise: a short deadline, few attempts and
# short backoffs, so that retries and dead letters come within a test's time.
TEST_DEFAULTS: dict[str, Any] = {"ack_deadline_seconds": 5, "max_deliver": 3,
                                 "retry": {"min_backoff_seconds": 0.05, "max_backoff_seconds": 0.2}}


def push_sub(name: str, topic: str, url: str, **extra: Any) -> dict[str, Any]:
    """A push subscription definition as a user writes it (YAML/JSON), with TEST_DEFAULTS and the
    breaker off; `extra` overrides. The breaker is on by default in the product: there, an endpoint
    that fails every attempt dead-letters nothing until the breaker decides (five minutes), which a
    test of dead-lettering would wait for; tests/test_breaker.py tests it, on."""
    return {"name": name, "topic": topic, **copy.deepcopy(TEST_DEFAULTS),
            "deliver": {"mode": "push", "push": {"url": url, "breaker": "off"}}, **extra}


def make_sub(topic: str, url: str, **overrides: Any) -> Subscription:
    """The `Subscription` a worker serves for `push_sub`'s definition (named `sub-<random>` unless
    `name` is given); `overrides` set `Subscription` fields, unchecked, as a test may need."""
    name = overrides.pop("name", "sub-" + uuid.uuid4().hex[:8])
    served = parse_subscription(push_sub(name, topic, url), trusted=True)
    return dataclasses.replace(served, definition=None, **overrides)  # a config file's subscription, unpublished


def worker_yaml(tmp_path: Path, broker_url: str, redis: str | dict[str, Any], *subs: dict[str, Any]
                ) -> tuple[str, Settings]:
    """A worker.yaml an operator would pass with --config, and the settings a worker loads from it;
    `redis` is a URL or the whole `redis:` block (a cluster, Sentinels)."""
    doc = {"pulsar": {"service_url": broker_url}, "redis": {"url": redis} if isinstance(redis, str) else redis,
           "destinations": {"allow_private": True}, "subscriptions": list(subs)}
    path = tmp_path / "worker.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path), load_settings(path)
