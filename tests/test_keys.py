"""Redis key layout: every key of one subscription shares its hash tag (one Cluster slot), every
fleet-wide key shares the fleet's, and nothing else in the package spells a key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.core import keys

pytestmark = pytest.mark.broker_independent

SUB_KEY_BUILDERS = (keys.lease_key, keys.status_key, keys.seek_key, keys.seek_result_key, keys.over_since_key,
                    keys.log_key, keys.log_stats_key,
                    keys.settled_key, keys.pattern)


def hash_tag(key: str) -> str:
    """The part Redis Cluster hashes: between the first { and the next }."""
    start = key.index("{")
    return key[start + 1:key.index("}", start)]


@given(st.from_regex(r"p-[a-z0-9-]{1,20}/[a-z][a-z0-9-]{0,20}", fullmatch=True),
       st.from_regex(r"[0-9]{1,6}:[0-9]{1,6}:-?[0-9]{1,3}:-?[0-9]{1,3}", fullmatch=True))
def test_every_key_of_a_subscription_shares_its_hash_tag(sub_key, message_id):
    built = [f(sub_key) for f in SUB_KEY_BUILDERS]
    built += [keys.message_key(sub_key, message_id), keys.history_key(sub_key, message_id), keys.workers_key(sub_key),
              keys.endpoint_pause_key(sub_key),
              keys.lease_key(sub_key, 1), keys.lease_key(sub_key, 63), keys.status_key(sub_key, 2),
              keys.attempt_key(sub_key, message_id), keys.acked_key(sub_key, 5_000_000)]
    assert {hash_tag(k) for k in built} == {sub_key}
    assert keys.message_id_of(keys.attempt_key(sub_key, message_id)) == message_id
    assert keys.message_id_of(keys.message_key(sub_key, message_id)) == message_id
    assert len(set(built)) == len(built)  # no two builders collide


@given(st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True))
def test_fleet_keys_share_the_fleets_hash_tag(fleet):
    built = [keys.fleet_key(fleet, what) for what in ("members", "registry", "version", "events", "paused", "expired")]
    assert {hash_tag(k) for k in built} == {f"fleet/{fleet}"}


def test_no_module_but_keys_spells_a_redis_key():
    package = Path(keys.__file__).parent
    offenders = [str(p.relative_to(package)) for p in package.rglob("*.py") if p.name != "keys.py"
                 and re.search(r"""f?["']pw:""", p.read_text())]
    assert offenders == []
