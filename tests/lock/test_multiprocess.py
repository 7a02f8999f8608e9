"""Many processes on one lock: the cap, kill -9, SIGSTOP, FIFO across processes, clock skew, dead
waiters.

Workers are ``python -m testing.lockproc`` subprocesses (see testing/lockproc.py); hold intervals
are time.monotonic readings, comparable across processes on one machine.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import pytest
import redis

from scrapy_redislock import CountingLock, Permit
from scrapy_redislock.lock.permit import GROUP, LockKeys
from testing.faultproc import max_overlap
from testing.lockproc import Proc

pytestmark = pytest.mark.integration


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Processes started by a test; all of them are killed afterwards."""
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.stop()


def test_max_overlap_helper() -> None:
    assert max_overlap([(0, 1), (1, 2)]) == 1
    assert max_overlap([(0, 2), (1, 3), (1.5, 1.6)]) == 3
    assert max_overlap([]) == 0


def blocked(client: redis.Redis) -> int:
    return int(client.info("clients")["blocked_clients"])


def wait_blocked(client: redis.Redis, count: int, timeout: float = 20.0) -> None:
    """Until ``count`` clients wait in XREADGROUP BLOCK (a subprocess needs a moment to start)."""
    deadline = time.monotonic() + timeout
    while blocked(client) != count:
        assert time.monotonic() < deadline, f"never {count} blocked clients (now {blocked(client)})"
        time.sleep(0.005)


def pending(client: redis.Redis, name: str) -> int:
    return int(client.xpending(LockKeys.of("redislock", name).slots, GROUP)["pending"])


@pytest.mark.parametrize(("limit", "processes"), [(3, 6), (1, 4)])
def test_never_more_holders_than_the_limit(
    redis_url: str, redis_client: redis.Redis, procs: list[Proc], limit: int, processes: int
) -> None:
    CountingLock(redis_client, "cap", limit=limit).set_limit(limit)
    for _ in range(processes):
        procs.append(Proc(redis_url, "cap", limit, 5, "--hold-ms", 3, "--loop", 1.5, "--reap"))
    for proc in procs:
        proc.finish()
    records = [r for proc in procs for r in proc.records if "hold" in r]
    assert all(proc.holds() for proc in procs), "every process got grants"
    assert all(r["released"] for r in records), "no lease was lost"
    intervals = [(r["hold"][0], r["hold"][1]) for r in records]
    assert max_overlap(intervals) <= limit
    assert max_overlap(intervals) == limit  # the slots were really used side by side
    fences = [r["fence"] for r in sorted(records, key=lambda r: r["hold"][0])]
    assert len(set(fences)) == len(fences)
    if limit == 1:
        assert fences == sorted(fences)  # a mutex: fences follow the order of the holds
    assert pending(redis_client, "cap") == 0


def test_clock_skew_does_not_break_the_cap(
    redis_url: str, redis_client: redis.Redis, procs: list[Proc]
) -> None:
    """Wall clocks an hour ahead and behind, all reaping: no live lease is reaped and the cap
    holds."""
    limit, ttl = 2, 0.5
    lost: list[Permit] = []
    mine = CountingLock(
        redis_client, "skew", limit=limit, ttl=ttl, auto_renew=True, on_lost=lost.append
    )
    skews = [3600, -3600, 3600, -3600]
    for skew in skews:
        procs.append(
            Proc(
                redis_url,
                "skew",
                limit,
                ttl,
                "--skew",
                skew,
                "--hold-ms",
                3,
                "--loop",
                8.0,  # still looping after the slowest of the four has started, under any load
                "--reap",
            )
        )
    for proc, skew in zip(procs, skews, strict=True):
        ready = proc.wait_for("ready")
        assert abs(ready["wall"] - (time.time() + skew)) < 60  # the worker's clock really is off
        proc.wait_for("hold")  # registered in Redis by now
        identity = json.loads(redis_client.hget(mine.keys.owners, ready["owner"]) or "{}")
        assert abs(identity["started"] - (time.time() + skew)) < 60  # ... also inside the lock
    permit = mine.acquire(timeout=5)  # held across many ttl while skewed workers reap
    start = time.monotonic()
    time.sleep(1.2)
    end = time.monotonic()
    assert mine.release(permit) is True and not lost and not permit.lost
    for proc in procs:
        proc.finish()
    mine.close()
    records = [r for proc in procs for r in proc.records if "hold" in r]
    assert all(proc.holds() for proc in procs) and all(r["released"] for r in records)
    intervals = [(r["hold"][0], r["hold"][1]) for r in records] + [(start, end)]
    assert max_overlap(intervals) == limit
    during = [iv for iv in intervals[:-1] if iv[0] < end and iv[1] > start]
    # one slot left for the workers while the test held one
    assert during and max_overlap(during) == 1


@pytest.mark.faults
def test_killed_holder_slot_returns_within_ttl_and_a_third(
    redis_url: str, redis_client: redis.Redis, procs: list[Proc]
) -> None:
    ttl = 0.9
    CountingLock(redis_client, "kill", limit=1, ttl=ttl).set_limit(1)
    holder = Proc(redis_url, "kill", 1, ttl, "--auto-renew", "--once")
    procs.append(holder)
    holder.wait_for("acquired")
    # it reaps while waiting
    survivor = Proc(redis_url, "kill", 1, ttl, "--auto-renew", "--hold-ms", 10, "--once")
    procs.append(survivor)
    wait_blocked(redis_client, 1)
    time.sleep(2 * ttl)
    assert survivor.first("acquired") is None  # the live holder's renewals keep the lease
    kill_sent = holder.kill()
    reaped = time.monotonic()
    acquired = survivor.wait_for("acquired", timeout=5)
    # the last renewal was at most ttl/3 before the kill; the reaper runs every ttl/3 (the holder
    # died between kill_sent and reaped: each bound is checked against the instant that cannot make
    # it fail spuriously)
    assert acquired["acquired"] - kill_sent >= 2 * ttl / 3 - 0.1, acquired["acquired"] - kill_sent
    assert acquired["acquired"] - reaped <= ttl + ttl / 3 + 0.25, acquired["acquired"] - reaped
    assert acquired["fence"] > holder.wait_for("acquired")["fence"]
    assert survivor.wait_for("released")["released"] is True


@pytest.mark.faults
def test_stopped_holder_loses_its_lease_and_hears_of_it_on_continue(
    redis_url: str, redis_client: redis.Redis, procs: list[Proc]
) -> None:
    # The slot comes back once the frozen holder's lease has run out (at most ttl after the stop)
    # and the waiter's next maintain (every ttl/3) reaps it; 0.5 s more for a busy machine's late
    # waiter (0.13 s past ttl + ttl/3 seen with a ttl of 0.6, four of these tests beside two CPU
    # burners, where 0.25 s more was the bound). A waiter that does not reap while it waits
    # (maintain_loop=False) gets it after 5 s.
    ttl = 1.5
    holder = Proc(redis_url, "stop", 1, ttl, "--auto-renew", "--once")
    procs.append(holder)
    held = holder.wait_for("acquired")
    holder.signal(signal.SIGSTOP)  # a long GC pause, a frozen VM: the connection stays open
    stopped_at = time.monotonic()
    waiter = CountingLock(redis_client, "stop", limit=1, ttl=ttl, auto_renew=True)
    permit = waiter.acquire(timeout=5)
    assert time.monotonic() - stopped_at <= ttl + ttl / 3 + 0.5
    assert permit.fence > held["fence"]
    holder.signal(signal.SIGCONT)
    continued_at = time.monotonic()
    lost = holder.wait_for("lost", timeout=5)
    assert time.monotonic() - continued_at < ttl / 3 + 0.5  # its next renewal tick reports it
    # and its stale release changes nothing
    assert lost == {"lost": held["fence"], "release": False}
    assert pending(redis_client, "stop") == 1 and waiter.release(permit) is True
    waiter.close()


def test_fifo_across_processes(
    redis_url: str, redis_client: redis.Redis, procs: list[Proc]
) -> None:
    lock = CountingLock(redis_client, "fifo", limit=1, ttl=30)
    held = lock.acquire(timeout=5)
    for i in range(5):
        procs.append(Proc(redis_url, "fifo", 1, 30, "--hold-ms", 20, "--once"))
        wait_blocked(redis_client, i + 1)  # queued before the next one starts
        time.sleep(0.02)
    assert lock.release(held) is True
    for proc in procs:
        proc.finish()
    grants = [proc.wait_for("acquired") for proc in procs]
    releases = [proc.wait_for("released") for proc in procs]
    assert [g["acquired"] for g in grants] == sorted(g["acquired"] for g in grants)  # arrival order
    assert [g["fence"] for g in grants] == sorted(g["fence"] for g in grants)
    assert all(r["released"] for r in releases)
    # one at a time
    assert all(g["acquired"] >= r["at"] for g, r in zip(grants[1:], releases, strict=False))
    assert pending(redis_client, "fifo") == 0
    lock.close()


def test_a_dead_waiter_leaves_the_queue(
    redis_url: str, redis_client: redis.Redis, procs: list[Proc]
) -> None:
    lock = CountingLock(redis_client, "waiters", limit=1, ttl=30)
    held = lock.acquire(timeout=5)
    for i in range(3):
        procs.append(Proc(redis_url, "waiters", 1, 30, "--hold-ms", 20, "--once"))
        wait_blocked(redis_client, i + 1)
    first, second, third = procs
    first.kill()  # dies while first in line
    wait_blocked(redis_client, 2)
    released_at = time.monotonic()
    lock.release(held)
    granted = second.wait_for("acquired", timeout=5)
    # handed to the next live waiter, not lost with the dead one
    assert granted["acquired"] - released_at < 0.5
    assert third.wait_for("acquired", timeout=5)["fence"] > granted["fence"] > held.fence
    second.finish()
    third.finish()
    assert first.first("acquired") is None
    assert pending(redis_client, "waiters") == 0
    assert lock.try_acquire() is not None
    lock.close()
