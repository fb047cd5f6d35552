"""The pure parts of ownership: the balanced assignment every worker computes alike, and lease
fencing on the worker's own clock."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.fleet.leases import Lease, assign, assign_buckets, assign_slots, bucket_of, unit, unit_parts, units

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


def _bucket_loads(sub_keys: list[str], members: list[str]) -> tuple[dict[str, str], Counter[str]]:
    """Layout 2's assignment of each key (through its bucket), and each member's load."""
    buckets = assign_buckets(Counter(bucket_of(k) for k in sub_keys), members)
    owners = {k: buckets[bucket_of(k)] for k in sub_keys}
    return owners, Counter(owners.values())


@settings(max_examples=200, deadline=None)
@given(keys_, members_)
def test_layout_2_gives_every_subscription_one_owner_evenly_and_alike_on_every_worker(sub_keys, members):
    owners, load = _bucket_loads(sub_keys, members)
    assert set(owners) == set(sub_keys) and set(owners.values()) <= set(members)
    biggest = max(Counter(bucket_of(k) for k in sub_keys).values(), default=1)
    assert max(load.values(), default=0) <= -(-len(sub_keys) // len(members)) + biggest - 1
    assert owners == _bucket_loads(list(reversed(sub_keys)), list(reversed(members)))[0]


@pytest.mark.parametrize(("count", "workers"), [(1_000, 10), (100_000, 100)])
def test_layout_2_balances_a_large_fleet_within_ten_percent_and_a_join_moves_little(count, workers):
    sub_keys = [f"p-scale/s{i:06d}" for i in range(count)]
    members = [f"sim-{i}" for i in range(workers)]
    before, load = _bucket_loads(sub_keys, members)
    mean = count / workers
    assert mean * 0.9 <= min(load.values()) and max(load.values()) <= mean * 1.1, load.most_common(1)
    after, _ = _bucket_loads(sub_keys, [*members, "sim-new"])
    moved = sum(1 for k in sub_keys if before[k] != after[k])
    assert moved <= count * 6 / (workers + 1)  # ideal 1/(N+1); bounded loads move a few times that


def test_layout_2_gives_a_spread_subscriptions_slots_to_distinct_workers():
    widths = {"p-x/wide": 3, "p-x/too-wide": 5}
    first = {"p-x/wide": "w1", "p-x/too-wide": "w2"}
    slots = assign_slots(widths, first, ["w1", "w2", "w3"])
    assert {slots["p-x/wide#1"], slots["p-x/wide#2"]} == {"w2", "w3"}
    assert {slots["p-x/too-wide#1"], slots["p-x/too-wide#2"]} == {"w1", "w3"}
    assert "p-x/too-wide#3" not in slots and "p-x/too-wide#4" not in slots  # more slots than workers


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


def test_suspects_are_tried_at_most_so_many_at_once_each_for_its_time_from_when_it_serves():
    """fleet/quarantine.Trials with a hand-driven clock: at most `at_once` on trial together, the
    longest waiting first; a trial's time runs from when its dispatcher serves; a subscribe that never
    goes through ends its trial after STALLED_TRIALS periods (at least STALLED_SECONDS), so the others
    do not wait for it; the wait for a trial is measured."""
    from worker.fleet.quarantine import STALLED_SECONDS, Trials

    trials = Trials(seconds=5.0, at_once=2)
    for at, name in ((1.0, "b"), (2.0, "a"), (3.0, "c")):
        trials.suspect(name, at)
    assert all(trials.holds_back(n) for n in "abc") and trials.next() == ["b", "a"]
    assert trials.begin("b", now=100.0) == 99.0 and trials.begin("a", now=100.0) == 98.0
    assert trials.next() == [] and not trials.holds_back("a") and trials.suspected("a") and trials.on("a")
    assert trials.over(104.0) == []  # not serving yet: their time has not begun
    trials.serving("a", 104.0)
    trials.serving("a", 106.0)  # the first time it is seen serving counts
    assert trials.over(108.9) == [] and trials.over(109.0) == [("a", True)]
    trials.end("a")
    assert not trials.suspected("a") and trials.next() == ["c"]
    assert trials.over(100.0 + STALLED_SECONDS - 0.1) == [] and trials.over(100.0 + STALLED_SECONDS) == [("b", False)]
    trials.end("b")
    trials.begin("c", now=300.0)
    trials.drop("c")  # handed over mid-trial
    assert not trials.on_trial and trials.next() == []


def test_the_next_holder_serves_at_once_unless_the_dead_worker_left_memory_evidence():
    """fleet/quarantine.verdict: a death without memory evidence starts no trial; evidence naming
    nobody makes suspects of all; evidence naming one subscription leaves the others served at once
    and quarantines that one if it was on trial; 1.1.0's records (trial and memory marks, no
    evidence key) and a resumed quarantine keep their meaning."""
    from worker.fleet.quarantine import QUARANTINE, SERVE, SUSPECT, Evidence, Taken, verdict

    plain = Taken("i-dead", "w-dead")
    on_trial = Taken("i-dead", "w-dead", previous_on_trial=True)
    assert verdict("p/a", plain, None) == SERVE  # kill -9, a lost node, a crash
    assert verdict("p/a", on_trial, None) == SERVE
    assert verdict("p/a", plain, Evidence("")) == SUSPECT  # the alarm named nobody
    assert verdict("p/a", plain, Evidence("p/b")) == SERVE  # the alarm named another one
    assert verdict("p/b", on_trial, Evidence("p/b")) == QUARANTINE
    assert verdict("p/b", plain, Evidence("p/b")) == SUSPECT  # named, yet not on trial there: tried first
    assert verdict("p/a", on_trial, Evidence("p/b")) == SERVE  # on trial beside the culprit: not laid at its door
    assert verdict("p/a", Taken("i-old", "w-old", True, True), None) == QUARANTINE  # 1.1.0's marks
    assert verdict("p/a", Taken("quarantined", "w"), None) == SUSPECT  # resumed: on trial first
    assert verdict("p/a", Taken("i-dead", "w", previous_suspect=True), None) == SUSPECT  # handed over untried
    assert Evidence.parse(None) is None and Evidence.parse(b"garbage") == Evidence("")
    assert Evidence.parse(Evidence("p/b").dump("w")) == Evidence("p/b")


def test_the_alarm_names_a_trial_only_when_its_client_thread_burned_the_most_cpu():
    """memory_watch.ThreadCpu.busiest: the inflating thread is the one that burned the most CPU, the
    event loop's aside; a trial client's names its subscription, anyone else's names none, and so
    does a thread that burned too little to be inflating anything."""
    import threading

    from worker.fleet.memory_watch import INFLATING_CPU_NS, ThreadCpu

    cpu = ThreadCpu(read=lambda: {1: 0})
    main = threading.main_thread().native_id
    cpu.register(11, "p/trial-a")
    cpu.register(12, "p/trial-b")
    cpu.register(main, "p/never")  # the event loop's thread is nobody's trial
    big = INFLATING_CPU_NS * 4
    assert cpu.busiest({11: 0, 12: 0, 20: 0}, {11: big, 12: 1_000, 20: 10, main: big * 9}) == "p/trial-a"
    assert cpu.busiest({11: 0, 12: 0, 20: 0}, {11: 1_000, 12: 2_000, 20: big}) == ""  # the shared client's thread
    assert cpu.busiest({11: 0}, {11: INFLATING_CPU_NS // 2}) == ""  # too little to be inflating
    assert cpu.busiest({}, {12: big}) == "p/trial-b"  # a thread new since the reading before
    cpu.forget("p/trial-b")
    assert cpu.busiest({}, {12: big}) == ""
    assert ThreadCpu(read=lambda: {}).available is False


async def test_the_memory_watch_raises_the_alarm_once_past_the_limit_and_clears_it_below():
    """memory_watch.MemoryWatch, always on: one alarm when memory passes 75% of the limit (naming what
    ThreadCpu names), none more while it stays high, a clear once it is back below 60%."""
    import asyncio

    from worker.fleet.memory_watch import INFLATING_CPU_NS, MemoryWatch, ThreadCpu

    readings = iter([10, 80, 90, 70, 50, 50])
    inflating = []  # the thread burns CPU once memory climbs

    def memory() -> int:
        value = next(readings, 50)
        if value >= 80:
            inflating.append(True)
        return value

    cpu = ThreadCpu(read=lambda: {7: INFLATING_CPU_NS * 2 if inflating else 0})
    cpu.register(7, "p/on-trial")
    cpu.available = True
    events: list[str] = []
    done = asyncio.Event()

    def on_clear() -> None:
        events.append("clear")
        done.set()

    watch = MemoryWatch(100, asyncio.get_running_loop(), lambda named: events.append(f"alarm {named}"), on_clear,
                        cpu, read=memory)
    try:
        await asyncio.wait_for(done.wait(), 10)
    finally:
        watch.close()
    assert events == ["alarm p/on-trial", "clear"]
