"""The recovery window after Redis restarted empty lasts only as long as a survivor may still hold.

A process that saw the lock recreates a missing one with every slot reserved (``__limbo__``) for the
holders that survived; it names the owners alive at its last renewal (maintain's roster), and the
reservation ends once each of them has reported (re-registered, re-adopted or released) and two
renewal intervals have passed, not after a whole lease. A survivor that has not reported keeps its
slots reserved (the cap holds). Real redis-server, restarted empty (no persistence)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from importlib import resources

import pytest
import redis

from scrapy_redislock import CountingLock
from scrapy_redislock.lock.consumers import ROSTER_MAX
from testing.redis_server import RedisServer
from testing.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.faults]

TTL = 30.0  # a lease far longer than the waits below: waiting it out would time them out
WAIT = 10.0


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as started:
        yield started


def lock(server: RedisServer, limit: int = 2, renews: bool = False) -> CountingLock:
    """``renews``: renewed in the background every renewal interval, as in a crawl (whose renewals
    end the recovery: a blocked wait does not look)."""
    client = redis.Redis.from_url(server.url)
    return CountingLock(client, "detail", limit=limit, ttl=TTL, maintain_loop=renews)


def redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_the_roster_bound_agrees_with_the_scripts() -> None:
    lib = (resources.files("scrapy_redislock.lock") / "scripts" / "_lib.lua").read_text()
    found = re.search(r"local ROSTER_MAX = (\d+)", lib)
    assert found is not None and int(found.group(1)) == ROSTER_MAX


def test_a_lone_survivor_does_not_wait_out_the_window(server: RedisServer) -> None:
    """One process, Redis restarted empty: it re-adopts its grant, and the slot reserved for other
    survivors comes free within a couple of renewal intervals, not after the 30 s lease."""
    only = lock(server, renews=True)
    held = only.acquire(timeout=1)
    only.maintain()  # its roster: itself alone
    server.restart()  # SIGKILL and start again, empty
    assert only.maintain() == []  # recreated in limbo; it re-adopts its grant
    assert only.held == [held]
    started = time.monotonic()
    second = only.acquire(timeout=WAIT)  # would time out if it waited the lease out
    assert time.monotonic() - started < WAIT
    assert only.try_acquire() is None  # never more than the limit
    assert only.release(second) and only.release(held)
    only.close()


def test_a_survivor_that_has_not_reported_keeps_its_slots_reserved(server: RedisServer) -> None:
    """Two processes hold one slot each; Redis restarts empty. The first to renew recreates the lock
    and names both: past the floor, the other's slot stays reserved until it reports (the cap
    holds), then a released slot goes to a newcomer at once."""
    a, b = lock(server), lock(server)
    pa, pb = a.acquire(timeout=1), b.acquire(timeout=1)
    a.maintain(), b.maintain()  # rosters: both
    server.restart()
    assert a.maintain() == [] and a.held == [pa]  # a recreates in limbo, waits for b
    admin = redis.Redis.from_url(server.url)
    floor = int(admin.hget(a.keys.meta, "recover_floor") or 0)
    assert floor and admin.hget(a.keys.meta, "awaiting") == b.owner.encode()
    # past the floor and past the next reap of a renewal: still reserved for b
    wait_until(lambda: redis_ms(admin) > floor + 1100, WAIT, "the floor and a reap interval")
    assert a.maintain() == []
    newcomer = lock(server)
    assert newcomer.try_acquire() is None
    assert b.maintain() == [] and b.held == [pb]  # b re-adopts its slot, and reports
    assert newcomer.try_acquire() is None  # both slots held: the cap holds
    assert b.release(pb)
    granted = newcomer.acquire(timeout=WAIT)
    assert newcomer.try_acquire() is None
    assert newcomer.release(granted) and a.release(pa)
    for each in (a, b, newcomer):
        each.close()
    admin.close()


def test_a_survivor_that_releases_reports_too(server: RedisServer) -> None:
    """The awaited survivor closes (gives everything back) instead of renewing: the recovery ends
    all the same."""
    a, b = lock(server, renews=True), lock(server)
    pa = a.acquire(timeout=1)
    b.acquire(timeout=1)
    a.maintain(), b.maintain()
    server.restart()
    assert a.maintain() == []
    b.close()  # release_owner: reported
    started = time.monotonic()
    granted = a.acquire(timeout=WAIT)
    assert time.monotonic() - started < WAIT - 1  # a's renewals end the recovery
    assert a.try_acquire() is None
    assert a.release(granted) and a.release(pa)
    a.close()


def test_an_owner_that_knows_no_roster_waits_out_the_lease(server: RedisServer) -> None:
    """A holder that never renewed cannot tell who may hold: the reservation is for a lease, as
    before."""
    holder = lock(server, limit=1)
    holder.acquire(timeout=1)  # no renewal yet: no roster
    server.restart()
    assert len(holder.maintain()) == 0
    admin = redis.Redis.from_url(server.url)
    assert admin.hget(holder.keys.meta, "awaiting") is None
    admin.close()
    holder.close()
