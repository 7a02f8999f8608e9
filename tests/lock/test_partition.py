"""A process cut off from Redis (testing/netproxy.py blackholes its connections; Redis and the
other processes carry on): its waits stay in Redis's line, and the grants Redis hands them come
back to the live processes after one renewal interval, not a lease."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import redis

from scrapy_redislock import CountingLock
from scrapy_redislock.lock.permit import GROUP, LockKeys, owner_of
from testing.netproxy import LatencyProxy
from testing.waiting import wait_until

pytestmark = pytest.mark.integration

TTL = 30.0  # a lease; the renewal interval is 1 s


def blocked_reads(admin: redis.Redis) -> int:
    return sum(1 for c in admin.client_list() if c.get("cmd") == "xreadgroup" and "b" in c["flags"])


def held_by(admin: redis.Redis, name: str) -> dict[str, int]:
    """Owner -> grants it holds in Redis (every consumer of it)."""
    keys = LockKeys.of("redislock", name)
    held: dict[str, int] = {}
    for entry in admin.xpending_range(keys.slots, GROUP, "-", "+", 100):
        owner = owner_of(entry["consumer"].decode())
        held[owner] = held.get(owner, 0) + 1
    return held


def test_a_silent_process_s_waits_cost_the_others_a_renewal_interval_not_a_lease(
    redis_client: redis.Redis, redis_proxy: Callable[[], LatencyProxy]
) -> None:
    name = "partition"
    proxies = [redis_proxy() for _ in range(3)]
    a, b, c = (
        CountingLock(redis.Redis.from_url(p.url), name, limit=3, ttl=TTL, auto_renew=True)
        for p in proxies
    )
    got: list[object] = []
    threads: list[threading.Thread] = []

    def wait_in(lock: CountingLock) -> None:
        permit = lock.acquire(timeout=60)
        got.append(permit)
        lock.release(permit)

    try:
        held = [lock.try_acquire() for lock in (a, b, c)]
        assert all(held)
        for _ in range(2):  # c's two waits are first in Redis's line
            threads.append(threading.Thread(target=wait_in, args=(c,), daemon=True))
            threads[-1].start()
        wait_until(lambda: blocked_reads(redis_client) == 2, 10, "c's two waits blocked in Redis")
        proxies[2].blackhole()  # c goes silent: its waits stay in the line
        cut = time.monotonic()

        # a frees its slot: Redis hands it to c's first wait, which cannot confirm it
        assert held[0] is not None and a.release(held[0])
        wait_until(lambda: held_by(redis_client, name).get(c.owner) == 2, 5, "c's wait handed a")
        permit = a.acquire(timeout=20)  # fails before the fix: a's slot stays c's for the lease
        taken = time.monotonic() - cut
        # both of c's waits were handed a slot in turn, neither confirmed: a got it back
        assert held_by(redis_client, name) == {a.owner: 1, b.owner: 1, c.owner: 1}
        assert blocked_reads(redis_client) == 0  # c's waits have left the line
        assert taken < TTL / 3, f"a got a slot back {taken:.2f} s after the cut"
        print(f"a slot back {taken:.2f} s after the cut (2 unconfirmed grants reclaimed)")

        # between live processes the hand-off is still at once, in line order
        b_wait = threading.Thread(target=wait_in, args=(b,), daemon=True)
        b_wait.start()
        wait_until(lambda: blocked_reads(redis_client) == 1, 10, "b waits")
        a.release(permit)
        b_wait.join(10)
        assert len(got) == 1

        # c's own confirmed slot is kept for its lease: c may be downloading with it
        assert held_by(redis_client, name).get(c.owner) == 1
    finally:
        proxies[2].heal()  # c's waits wait on, and get the slots a and b give back
        for lock in (a, b):
            lock.close()
        for thread in threads:
            thread.join(30)
        c.close()
    assert len(got) == 3  # c's two waits were served once it could hear again
