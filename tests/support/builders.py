"""Subscriptions, settings and worker.yaml files as tests need them: `make_sub` builds the
`Subscription` a worker serves, `push_sub` the definition a user writes (YAML/JSON)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import yaml

from worker.config import HttpSettings, PulsarSettings, RedisSettings, Settings, load_settings
from worker.destinations import DestinationPolicy
from worker.subscriptions import RetryPolicy, Subscription


def make_sub(topic: str, url: str, **overrides: Any) -> Subscription:
    values: dict[str, Any] = {
        "name": "sub-" + uuid.uuid4().hex[:8], "topic": topic, "url": url, "ack_deadline_seconds": 5,
        "max_deliver": 3, "retry": RetryPolicy(0.05, 0.2),
    }
    values.update(overrides)
    return Subscription(**values)


def make_settings(broker_url: str, redis: str | RedisSettings, subs: tuple[Subscription, ...], **kw: Any) -> Settings:
    values: dict[str, Any] = {
        "pulsar": PulsarSettings(service_url=broker_url),
        "redis": redis if isinstance(redis, RedisSettings) else RedisSettings(url=redis),
        "http": HttpSettings(port=0), "destinations": DestinationPolicy(allow_private=True),
        "subscriptions": subs, "shutdown_grace_seconds": 5.0,
    }
    values.update(kw)
    return Settings(**values)


def push_sub(name: str, topic: str, url: str, **extra: Any) -> dict[str, Any]:
    """A push subscription definition as a user writes it (YAML/JSON); `extra` overrides."""
    return {"name": name, "topic": topic, "ack_deadline_seconds": 5, "max_deliver": 2,
            "retry": {"min_backoff_seconds": 0.05, "max_backoff_seconds": 0.05},
            "deliver": {"mode": "push", "push": {"url": url}}, **extra}


def worker_yaml(tmp_path: Path, broker_url: str, redis: str | dict[str, Any], *subs: dict[str, Any]
                ) -> tuple[str, Settings]:
    """A worker.yaml an operator would pass with --config, and the settings a worker loads from it;
    `redis` is a URL or the whole `redis:` block (a cluster, Sentinels)."""
    doc = {"pulsar": {"service_url": broker_url}, "redis": {"url": redis} if isinstance(redis, str) else redis,
           "destinations": {"allow_private": True}, "subscriptions": list(subs)}
    path = tmp_path / "worker.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path), load_settings(path)
