"""Operator commands against a fleet's Redis: `push-worker subs apply|delete|list|get`.

Human-friendly tables by default, `--json` for scripts. Where to connect: `--redis-url`, else
$PUSH_WORKER_REDIS_URL, else the config's `redis.url`, else the URLs a worker on the embedded
default recorded in its `state_dir`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import yaml

from worker.config import Settings, load_settings
from worker.errors import ConfigError
from worker.fleet import lease_key, status_key
from worker.registry import Registry, text_of

ENDPOINTS_FILE = "endpoints.json"


def write_endpoints(state_dir: Path, pulsar_url: str, redis_url: str) -> None:
    """Record where the embedded services listen, for the operator commands (no secrets: loopback)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / ENDPOINTS_FILE).write_text(json.dumps({"pulsar_url": pulsar_url, "redis_url": redis_url}))


def connection(redis_url: str | None, config: str | None) -> tuple[str, str]:
    """(redis URL, fleet name) for an operator command."""
    settings = load_settings(config) if config else Settings()
    url = redis_url or os.environ.get("PUSH_WORKER_REDIS_URL") or settings.redis.url
    if not url:
        recorded = Path(settings.state_dir) / ENDPOINTS_FILE
        if recorded.exists():
            url = json.loads(recorded.read_text())["redis_url"]
    if not url:
        raise ConfigError("subs", "--redis-url", "is required (or --config with redis.url, or a running "
                          "embedded worker's state_dir)")
    return url, os.environ.get("PUSH_WORKER_FLEET") or settings.fleet.name


def _load_definitions(path: str) -> list[Any]:
    try:
        text = Path(path).read_text(encoding="utf-8") if path != "-" else sys.stdin.read()
    except OSError as e:
        raise ConfigError("subs apply", path, f"cannot be read ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        raise ConfigError("subs apply", path, "is not valid YAML") from None
    if isinstance(data, dict) and "subscriptions" in data:
        data = data["subscriptions"]
    return data if isinstance(data, list) else [data]


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    widths = {c: max([len(c)] + [len(str(r.get(c, ""))) for r in rows]) for c in columns}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in columns)]
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


class Admin:
    """The `subs` commands; each returns the text to print."""

    def __init__(self, redis_url: str, fleet: str, as_json: bool = False) -> None:
        self.client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=10)
        self.registry = Registry(self.client, fleet)
        self.as_json = as_json

    async def close(self) -> None:
        await self.client.aclose()

    async def apply(self, path: str) -> str:
        definitions = _load_definitions(path)
        # Validate everything before writing anything: a bad file changes nothing.
        from worker.subscriptions import parse_subscription

        for i, d in enumerate(definitions):
            parse_subscription(d, where=f"{path}[{i}]")
        results = []
        for d in definitions:
            sub, what = await self.registry.apply(d)
            results.append({"subscription": sub.key, "result": what})
        if self.as_json:
            return json.dumps(results)
        return "\n".join(f"{r['subscription']}: {r['result']}" for r in results)

    async def delete(self, name: str) -> str:
        key = await self.registry.resolve(name)
        if not await self.registry.delete(key):
            raise ConfigError("registry", name, "no such subscription")
        return json.dumps({"subscription": key, "result": "deleted"}) if self.as_json else f"{key}: deleted"

    async def _row(self, key: str, definition: dict[str, Any]) -> dict[str, Any]:
        owner = await self.client.get(lease_key(key))
        status = {text_of(k): text_of(v) for k, v in (await self.client.hgetall(status_key(key))).items()}
        project, name = key.split("/", 1)
        return {
            "project": project, "name": name, "type": definition.get("type", "shared"),
            "owner": text_of(owner) if owner else "-",
            "state": status.get("state", "unowned" if not owner else "starting"),
            "acked": int(status.get("acked", 0)), "retried": int(status.get("retried", 0)),
            "dead_lettered": int(status.get("dead_lettered", 0)), "unsettled": int(status.get("unsettled", 0)),
        }

    async def list(self) -> str:
        definitions = await self.registry.definitions()
        rows = [await self._row(k, d) for k, d in sorted(definitions.items())]
        if self.as_json:
            return json.dumps(rows)
        if not rows:
            return "no subscriptions in the registry"
        return _table(rows, ["project", "name", "type", "owner", "state", "acked", "retried", "dead_lettered",
                             "unsettled"])

    async def get(self, name: str) -> str:
        key = await self.registry.resolve(name)
        definitions = await self.registry.definitions()
        if key not in definitions:
            raise ConfigError("registry", name, "no such subscription")
        out = {"definition": definitions[key], "status": await self._row(key, definitions[key])}
        return json.dumps(out) if self.as_json else yaml.safe_dump(out, sort_keys=False).rstrip()
