"""The pure parts of ownership: the balanced assignment every worker computes alike, and lease
fencing on the worker's own clock."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.fleet.leases import Lease, assign, unit, unit_parts, units

pytestmark = pytest.mark.broker_independent

keys_ = st.lists(st.from_regex(r"p-[a-z]{1,6}/[a-z]{1,8}", fullmatch=True), min_size=0, max_size=60, unique=True)
members_ = st.lists(st.from_regex(r"w-[a-z0-9]{1,6}", fullmatch=True), min_size=1, max_size=8, unique=True)


@settings(max_examples=200, deadline=None)
@given(keys_, members_)
def test_every_subscription_has_exactly_one_owner_and_the_spread_is_even(sub_keys, members):
    owners = assign(sub_keys, members)
    assert set(owners) == set(sub_keys) and set(owners.values()) <= set(members)
    load = [sum(1 for o in owners.values() if o == m) for m in members]
    cap = -(-len(sub_keys) // len(members))
    assert max(load) <= cap


@settings(max_examples=200, deadline=None)
@given(keys_, members_)
def test_every_worker_computes_the_same_answer_whatever_the_order(sub_keys, members):
    assert assign(sub_keys, members) == assign(list(reversed(sub_keys)), list(reversed(members)))


def test_a_join_moves_about_one_nth_of_the_subscriptions():
    sub_keys = [f"p-x/s{i:03d}" for i in range(300)]
    before = assign(sub_keys, ["w1", "w2", "w3"])
    after = assign(sub_keys, ["w1", "w2", "w3", "w4"])
    moved = sum(1 for k in sub_keys if before[k] != after[k])
    assert 60 <= moved <= 110  # ideal 75 (a quarter); bounded loads move a little more


def test_a_lease_is_fenced_before_it_could_expire_in_redis():
    lease = Lease(ttl=10.0, margin=2.0)
    assert not lease.valid()  # never renewed: not valid
    sent = time.monotonic()
    lease.renewed(sent)
    assert lease.valid()
    assert lease.valid_until == sent + 8.0  # counted from when the renew was sent, minus the margin
    assert not lease.due(sent)  # fresh: no renew needed
    assert lease.due(sent + 3.5)  # less than half the lease left (8 - 3.5 < 5): renew
    lease.renewed(sent - 10)
    assert not lease.valid()


widths_ = st.dictionaries(st.from_regex(r"p-[a-z]{1,6}/[a-z]{1,8}", fullmatch=True), st.integers(1, 6), max_size=30)


@settings(max_examples=200, deadline=None)
@given(widths_, members_)
def test_a_subscriptions_slots_go_to_distinct_workers_as_many_as_there_are(widths, members):
    owners = assign(units(widths), members)
    for key, width in widths.items():
        holders = [owners[unit(key, slot)] for slot in range(width) if unit(key, slot) in owners]
        assert len(holders) == len(set(holders)) == min(width, len(members))
    assert assign(units(widths), members) == assign(list(reversed(units(widths))), list(reversed(members)))


def test_subscriptions_of_one_slot_are_assigned_as_before_slots_existed():
    """Slot 0 is spelt as the subscription's key: the previous release's workers, which know no
    slots, compute the same owners in a mixed fleet."""
    sub_keys = [f"p-x/s{i:03d}" for i in range(200)]
    assert units(dict.fromkeys(sub_keys, 1)) == sub_keys
    assert unit_parts("p-x/s001") == ("p-x/s001", 0) and unit_parts(unit("p-x/s001", 3)) == ("p-x/s001", 3)


def test_suspects_are_tried_one_at_a_time_each_for_its_time_from_when_it_serves():
    """fleet/quarantine.Trials with a hand-driven clock: one suspect on trial at a time, in order; the
    trial's time runs from when its dispatcher serves; a subscribe that never goes through ends the
    trial after STALLED_TRIALS periods (at least STALLED_SECONDS), so the others do not wait for it."""
    from worker.fleet.quarantine import STALLED_SECONDS, Trials

    trials = Trials(seconds=5.0)
    for name in ("b", "a", "c"):
        trials.suspect(name, "w-dead")
    assert all(trials.holds_back(n) for n in "abc") and trials.next() == "a"
    trials.begin("a", now=100.0)
    assert trials.next() == "" and not trials.holds_back("a") and trials.suspected("a")
    assert not trials.over(104.0)  # not serving yet: its time has not begun
    trials.serving(104.0)
    trials.serving(106.0)  # the first time it is seen serving counts
    assert not trials.over(108.9) and trials.over(109.0)
    assert trials.end() == "a" and not trials.suspected("a") and trials.next() == "b"
    trials.begin("b", now=200.0)
    assert not trials.over(200.0 + STALLED_SECONDS - 0.1) and trials.over(200.0 + STALLED_SECONDS)
    trials.end()
    trials.begin("c", now=300.0)
    trials.drop("c")  # handed over mid-trial
    assert trials.current == "" and trials.next() == ""
