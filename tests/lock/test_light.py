"""The light path of a lock met at run time (``light=True``), against a real redis-server: a grant
of an idle lock is one zset member (no stream, nothing to retire); the first caller that finds every
slot held escalates the lock into its stream, where everyone queues first come, first served, and
light grants that moved are released and renewed there; the cap holds across the switch."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
import redis.asyncio

from scrapy_redislock import AsyncCountingLock, CountingLock, InvalidArgument, LockError
from scrapy_redislock.lock.permit import LockKeys

pytestmark = pytest.mark.integration
NAME = "key:a.example"
KEYS = LockKeys.of("redislock", NAME)


def left(client: redis.Redis) -> list[str]:
    return sorted(k.decode() for k in client.scan_iter("redislock:{key:*"))


def commands(client: redis.Redis) -> int:
    """Commands Redis ran so far (those inside scripts included), less the INFO calls of this."""
    stats = client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


def light_lock(client: redis.Redis, limit: int = 2, ttl: float = 30.0) -> CountingLock:
    return CountingLock(client, NAME, limit, ttl, light=True, maintain_loop=False)


def test_an_idle_lock_costs_one_zset_member_and_leaves_nothing(redis_client: redis.Redis) -> None:
    lock = light_lock(redis_client)
    lock.release(lock.acquire())  # the scripts are loaded (EVALSHA's first NOSCRIPT is not counted)
    redis_client.delete(KEYS.light)
    before = commands(redis_client)
    permit = lock.acquire()
    took = commands(redis_client) - before
    before = commands(redis_client)
    assert lock.release(permit)
    released = commands(redis_client) - before
    assert permit.light and permit.fence == 0
    permit = lock.acquire()
    assert permit.usable(time.monotonic())
    assert left(redis_client) == [KEYS.light]  # no stream, no registration
    lock.release(permit)
    assert (took, released) == (5, 2)  # EVALSHA TIME ZCARD ZADD PEXPIREAT; EVALSHA ZREM
    assert lock.close(retire=True) == 0
    assert left(redis_client) == []  # the last grant given back: the zset is gone


def test_the_cap_holds_on_the_light_path(redis_client: redis.Redis) -> None:
    a, b, c = (light_lock(redis_client) for _ in range(3))
    first, second = a.acquire(), b.acquire()
    assert first.light and second.light
    assert c.try_acquire() is None  # full: no stream set up for a try
    assert left(redis_client) == [KEYS.light]
    a.release(first)
    third = c.try_acquire()
    assert third is not None and third.light


def test_a_limit_an_operator_set_holds(redis_client: redis.Redis) -> None:
    """An operator's limit (the zset's limit member) holds for every process whatever its own."""
    redis_client.zadd(KEYS.light, {"#limit": 1})
    five = [
        CountingLock(redis_client, NAME, 5, 30.0, light=True, maintain_loop=False) for _ in "ab"
    ]
    first = five[0].acquire()
    assert first.light
    assert five[1].try_acquire() is None
    five[0].release(first)
    assert redis_client.zrange(KEYS.light, 0, -1) == [b"#limit"]  # it stays for the next ones


def test_a_dead_holders_lease_runs_out(redis_client: redis.Redis) -> None:
    dead = light_lock(redis_client, limit=1, ttl=0.3)
    dead.acquire()  # never released nor renewed
    other = light_lock(redis_client, limit=1, ttl=0.3)
    assert other.try_acquire() is None
    deadline = time.monotonic() + 5
    permit = None
    while permit is None and time.monotonic() < deadline:
        time.sleep(0.01)  # polls until the dead holder's lease has run out
        permit = other.try_acquire()
    assert permit is not None and permit.light


def test_a_waiter_escalates_and_a_light_release_hands_it_the_slot(
    redis_client: redis.Redis,
) -> None:
    holder, waiter = light_lock(redis_client, limit=1), light_lock(redis_client, limit=1)
    held = holder.acquire()
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=10)))
    thread.start()
    while not redis_client.exists(KEYS.slots) or not redis_client.xinfo_consumers(
        KEYS.slots, "holders"
    ):
        time.sleep(0.001)
    # the light grant moved into the stream, held by its owner; the zset is marked
    assert redis_client.zscore(KEYS.light, "~stream") == -1
    assert redis_client.hget(KEYS.migrated, held.token) is not None
    assert redis_client.xpending(KEYS.slots, "holders")["pending"] == 1
    # a newcomer queues behind the waiter (no light grant while the stream is in use)
    newcomer = light_lock(redis_client, limit=1)
    assert newcomer.try_acquire() is None
    newcomer.close(retire=True)
    assert holder.release(held)  # ZREM finds nothing: freed in the stream, handed to the waiter
    thread.join(10)
    assert got and not got[0].light  # type: ignore[attr-defined]
    assert redis_client.xpending(KEYS.slots, "holders")["pending"] == 1
    waiter.release(got[0])  # type: ignore[arg-type]
    holder.close(retire=True)
    waiter.close(retire=True)
    assert left(redis_client) == []  # retired: stream, zset and map gone; next taker is light
    again = light_lock(redis_client).acquire()
    assert again.light


def test_a_moved_grant_is_renewed_as_a_stream_grant(redis_client: redis.Redis) -> None:
    holder = light_lock(redis_client, limit=1, ttl=2.0)
    waiter = light_lock(redis_client, limit=1, ttl=2.0)
    held = holder.acquire()
    thread = threading.Thread(target=lambda: waiter.acquire(timeout=10))
    thread.start()
    while not redis_client.hget(KEYS.migrated, held.token):
        time.sleep(0.001)
    grant = redis_client.hget(KEYS.migrated, held.token).decode()
    assert holder.maintain() == []  # renews it: it becomes the stream grant it moved to
    assert not held.light and held.grant == grant and held.fence > 0
    assert held in holder.held
    # renewed in the stream from now on: still held after more than its lease
    for _ in range(4):
        time.sleep(0.6)
        assert holder.maintain() == []
    assert not thread.is_alive() or redis_client.xpending(KEYS.slots, "holders")["pending"] == 1
    assert holder.release(held)
    thread.join(10)
    assert not thread.is_alive()
    waiter.close(retire=True)
    holder.close(retire=True)


def test_escalation_keeps_the_cap_with_several_light_holders(redis_client: redis.Redis) -> None:
    """3 light holders of a lock of 3, then a waiter: the stream has 0 free slots, 3 held."""
    holders = [light_lock(redis_client, limit=3) for _ in range(3)]
    permits = [lock.acquire() for lock in holders]
    waiter = light_lock(redis_client, limit=3)
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=10)))
    thread.start()
    while redis_client.hlen(KEYS.migrated) < 3:
        time.sleep(0.001)
    info = redis_client.xinfo_groups(KEYS.slots)[0]
    assert info["pending"] == 3 and info.get("lag", 0) == 0  # "lag" is Redis 7's
    time.sleep(0.1)
    assert not got  # nothing free: the waiter waits
    holders[1].release(permits[1])
    thread.join(10)
    assert got and redis_client.xpending(KEYS.slots, "holders")["pending"] == 3


def test_an_asyncio_lock_on_the_light_path(admin_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(admin_url)
        try:
            lock = AsyncCountingLock(client, NAME, 1, 30.0, light=True, maintain_loop=False)
            permit = await lock.acquire()
            assert permit.light
            assert await lock.maintain() == []
            assert await lock.release(permit)
            assert await lock.aclose(retire=True) == 0
        finally:
            await client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("kwargs", [{"reentrant": True, "limit": 1}, {"replicas": 1, "limit": 2}])
def test_light_is_for_a_plain_lock(redis_client: redis.Redis, kwargs: dict) -> None:
    limit = kwargs.pop("limit")
    with pytest.raises(InvalidArgument, match="light=True"):
        CountingLock(redis_client, NAME, limit, 30.0, light=True, **kwargs)


def test_light_acquires_need_a_limit(redis_client: redis.Redis) -> None:
    with pytest.raises(LockError, match="needs a limit"):
        CountingLock(redis_client, NAME, None, 30.0, light=True).acquire()


def test_a_pause_refuses_light_takes_until_it_ends(redis_client: redis.Redis) -> None:
    """pause_starts (a site's Retry-After): a light take is refused with Paused, saying how long is
    left, on Redis's clock; after it, the key is taken again, and a later, shorter pause does not
    shorten it."""
    from scrapy_redislock import Paused
    from scrapy_redislock.lock.base import CommandRunner
    from scrapy_redislock.lock.delay import pause_starts
    from scrapy_redislock.lock.protocol import drive

    runner = CommandRunner(redis_client)
    until = drive(pause_starts(KEYS, 0.5, light=True), runner, NAME)
    assert drive(pause_starts(KEYS, 0.1, light=True), runner, NAME) == until  # only ever later
    lock = light_lock(redis_client)
    with pytest.raises(Paused) as paused:
        lock.try_acquire()
    assert 0 < paused.value.wait <= 0.5 and paused.value.until == pytest.approx(until, abs=0.002)
    with pytest.raises(Paused):
        lock.acquire()
    deadline = time.monotonic() + 5
    permit = None
    while permit is None and time.monotonic() < deadline:
        try:
            permit = lock.try_acquire()
        except Paused as again:
            time.sleep(again.wait)
    assert permit is not None and permit.light
    lock.release(permit)
    assert redis_client.zscore(KEYS.light, "~pause") is None  # an ended pause is dropped


def test_a_start_checked_with_no_gap_waits_out_a_pause(redis_client: redis.Redis) -> None:
    """A stage, or a key queueing in its stream, checks its start against a pause: a booking with
    a gap of 0 waits until the pause ends and writes nothing when there is none."""
    from scrapy_redislock.lock.base import CommandRunner
    from scrapy_redislock.lock.delay import book_start, pause_starts
    from scrapy_redislock.lock.protocol import drive

    runner = CommandRunner(redis_client)
    free = drive(book_start(KEYS, 0.0), runner, NAME)
    assert free.confirmed and free.wait == 0
    assert not redis_client.exists(KEYS.gate) and not redis_client.exists(KEYS.started)
    until = drive(pause_starts(KEYS, 0.3), runner, NAME)
    held = drive(book_start(KEYS, 0.0), runner, NAME)
    assert not held.confirmed and 0 < held.wait <= 0.3
    assert held.at == pytest.approx(until, abs=0.001)
