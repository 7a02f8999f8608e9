"""Many processes on one lock: safety, kill -9, FIFO across processes, clock skew, dead waiters."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from scrapy_redislock import CountingLock
from scrapy_redislock.core import load_scripts

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent


class Proc:
    """A tests/lockproc.py subprocess whose JSON lines are collected by a reader thread."""

    def __init__(self, *args: object) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.lockproc", *map(str, args)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.records: list[dict[str, Any]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.records.append(json.loads(line))

    def wait_for(self, key: str, timeout: float = 20.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for record in self.records:
                if key in record:
                    return record
            time.sleep(0.01)
        raise AssertionError(f"no {key!r} from process within {timeout} s: {self.records}")

    def holds(self) -> list[tuple[float, float]]:
        return [tuple(r["hold"]) for r in self.records if "hold" in r]  # type: ignore[misc]

    def finish(self, timeout: float = 60) -> None:
        self.process.wait(timeout)
        self.reader.join(5)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.kill()


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda ev: (ev[0], ev[1]))
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


@pytest.mark.parametrize(("limit", "processes", "skews"), [(3, 8, [0]), (1, 4, [0]), (2, 6, [3600, -3600, 0])])
def test_never_more_holders_than_the_limit(
    redis_url: str, redis_client: redis.Redis, procs: list[Proc], limit: int, processes: int, skews: list[int]
) -> None:
    """Also with wall clocks an hour apart: the lock never reads the client's clock."""
    CountingLock(redis_client, "safety", limit=limit).set_limit(limit)
    for i in range(processes):
        procs.append(Proc(redis_url, "safety", limit, 5, 3, 2.0, "--skew", skews[i % len(skews)], "--renew"))
    for proc in procs:
        proc.finish()
    intervals = [iv for proc in procs for iv in proc.holds()]
    assert all(proc.holds() for proc in procs), "every process got grants"
    assert max_overlap(intervals) <= limit
    assert max_overlap(intervals) == limit  # the slots were actually used concurrently
    assert redis_client.xpending("redislock:{safety}:slots", "holders")["pending"] == 0


def test_killed_holder_slot_comes_back_within_ttl(redis_url: str, redis_client: redis.Redis, procs: list[Proc]) -> None:
    ttl = 0.6
    CountingLock(redis_client, "kill", limit=1, ttl=ttl).set_limit(1)
    holder = Proc(redis_url, "kill", 1, ttl, 0, 0, "--once")
    procs.append(holder)
    holder.wait_for("acquired")
    holder.kill()
    killed_at = time.monotonic()
    survivor = CountingLock(redis_client, "kill", limit=1, ttl=ttl, auto_renew=True)
    permit = survivor.acquire(timeout=5)  # blocks; the renewal thread's maintain reaps the dead lease
    waited = time.monotonic() - killed_at
    assert waited <= ttl + ttl / 3 + 0.3, waited
    survivor.release(permit)
    survivor.close()


def test_fifo_across_processes(redis_url: str, redis_client: redis.Redis, procs: list[Proc]) -> None:
    lock = CountingLock(redis_client, "fifo", limit=1, ttl=30)
    held = lock.acquire()
    order = []
    for _i in range(6):
        proc = Proc(redis_url, "fifo", 1, 30, 1, 0, "--once")
        procs.append(proc)
        proc.wait_for("ready")
        time.sleep(0.25)  # it is blocked in XREADGROUP by now
        order.append(proc)
    lock.release(held)
    grants = []
    for proc in order:
        grants.append(proc.wait_for("acquired")["acquired"])
        proc.kill()  # a killed holder: its slot comes back through the reaper ...
        _reap_now(redis_client)
    assert grants == sorted(grants)


def _reap_now(client: redis.Redis) -> None:
    """Free the killed holder's grant the way an operator would (its consumer's PEL)."""
    lock = CountingLock(client, "fifo", limit=1, ttl=30)
    for entry in client.xpending_range(lock.keys.slots, "holders", "-", "+", 10):
        owner = entry["consumer"].decode()
        script = client.register_script(load_scripts()["release_owner"])
        script(keys=[lock.keys.slots, lock.keys.owners, lock.keys.holds], args=[owner, "0"])


def test_dead_waiter_leaves_the_queue(redis_url: str, redis_client: redis.Redis, procs: list[Proc]) -> None:
    lock = CountingLock(redis_client, "waiters", limit=1, ttl=30)
    held = lock.acquire()
    first = Proc(redis_url, "waiters", 1, 30, 0, 0, "--once")
    procs.append(first)
    first.wait_for("ready")
    time.sleep(0.3)
    second = Proc(redis_url, "waiters", 1, 30, 0, 0, "--once")
    procs.append(second)
    second.wait_for("ready")
    time.sleep(0.3)
    first.kill()  # dies while queued first
    time.sleep(0.1)
    lock.release(held)
    granted = second.wait_for("acquired", timeout=5)
    assert granted["fence"] > held.fence
    assert not [r for r in first.records if "acquired" in r]


