"""A scope's record against a real redis-server: what must outlive a transition (an operator's limit
and pin, a site's pause, reentrant hold counts) survives a retire, a reset, a restart's recovery and
a controller's expiry, and what has nothing left to remember still vanishes. One test per finding of
the third lock review (lock-audit-3 f01-f07), each of which failed before the fix."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from scrapy_redislock import CountingLock, Paused
from scrapy_redislock.lock.adaptive import AdaptiveParams, ControllerState, Sample, Window, commit
from scrapy_redislock.lock.adaptive import report as adapt_report
from scrapy_redislock.lock.base import CommandRunner
from scrapy_redislock.lock.core import forget_lock, reset_lock
from scrapy_redislock.lock.delay import pause_starts
from scrapy_redislock.lock.permit import LockKeys
from scrapy_redislock.lock.protocol import drive
from testing.redis_server import RedisServer

pytestmark = pytest.mark.integration
KEY = "key:shop.example"
KEYS = LockKeys.of("redislock", KEY)


def key_lock(client: redis.Redis, limit: int = 1, ttl: float = 3.0) -> CountingLock:
    return CountingLock(client, KEY, limit, ttl, light=True, maintain_loop=False)


def escalated(client: redis.Redis) -> tuple[CountingLock, CountingLock]:
    """A holds the key on its light path, B queued for it (the key's stream is set up) and gave up:
    a key that queued once."""
    a, b = key_lock(client), key_lock(client)
    held = a.acquire()
    assert held.light
    assert b.try_acquire() is None
    with pytest.raises(Exception):  # noqa: B017 - AcquireTimeout: B waited in the stream
        b.acquire(timeout=0.05)
    assert client.exists(KEYS.slots)
    a.release(held)
    return a, b


def retire(*locks: CountingLock) -> None:
    for lock in locks:
        lock.close(retire=True)


def test_a_sites_pause_survives_the_retire_of_the_keys_stream(redis_client: redis.Redis) -> None:
    """f01: a Retry-After pause of a key outlives the key's stream; the light path refuses during it."""
    a, b = escalated(redis_client)
    runner = CommandRunner(redis_client)
    drive(pause_starts(KEYS, 30.0, light=True), runner, KEY)
    retire(a, b)
    assert not redis_client.exists(KEYS.slots)  # retired
    newcomer = key_lock(redis_client)
    with pytest.raises(Paused) as paused:
        newcomer.try_acquire()
    assert paused.value.wait > 25
    ttl_ms = redis_client.pttl(KEYS.light)
    assert 25_000 < ttl_ms <= 30_000  # the record lasts as long as the pause, no longer


def test_an_operators_key_limit_survives_the_retire(redis_client: redis.Redis) -> None:
    """f02: ``set-limit key:<key> N`` and a pause by 0 hold after the key's stream is retired."""
    operator = key_lock(redis_client, limit=3)
    operator.set_limit(1)
    a, b = key_lock(redis_client, limit=3), key_lock(redis_client, limit=3)
    held = a.acquire()
    assert b.try_acquire() is None  # the operator's 1, not the processes' 3
    with pytest.raises(Exception):  # noqa: B017 - AcquireTimeout: B queued, the key escalated
        b.acquire(timeout=0.05)
    a.release(held)
    retire(a, b, operator)
    assert not redis_client.exists(KEYS.slots)
    takers = [key_lock(redis_client, limit=3) for _ in range(3)]
    granted = [lock.try_acquire() for lock in takers]
    assert sum(p is not None for p in granted) == 1
    assert redis_client.pttl(KEYS.light) == -1  # the operator's word lasts until `forget`
    for lock, permit in zip(takers, granted, strict=True):
        if permit is not None:
            lock.release(permit)
    key_lock(redis_client).set_limit(0)  # a pause
    waiter = key_lock(redis_client, limit=3)
    with pytest.raises(Exception):  # noqa: B017 - AcquireTimeout
        waiter.acquire(timeout=0.05)
    retire(waiter, *takers)
    assert key_lock(redis_client, limit=3).try_acquire() is None
    # forget: the operator's record goes with the lock
    assert drive(forget_lock(KEYS, light=True), CommandRunner(redis_client), KEY)
    redis_client.delete(KEYS.light)


def test_an_operator_reset_keeps_the_keys_limit_and_pause(redis_client: redis.Redis) -> None:
    runner = CommandRunner(redis_client)
    key_lock(redis_client).set_limit(2)
    a = key_lock(redis_client, limit=5)
    a.acquire()
    drive(pause_starts(KEYS, 30.0, light=True), runner, KEY)
    freed, limit = drive(reset_lock(KEYS, light=True), runner, KEY)
    assert (freed, limit) == (1, 2)
    marks = dict(redis_client.zrange(KEYS.light, 0, -1, withscores=True))
    assert set(marks) == {b"#limit", b"#pinned", b"~pause"}
    with pytest.raises(Paused):
        key_lock(redis_client, limit=5).try_acquire()


def test_a_key_with_nothing_to_remember_still_vanishes(redis_client: redis.Redis) -> None:
    a, b = escalated(redis_client)
    retire(a, b)
    assert list(redis_client.scan_iter("redislock:{key:*")) == []


def test_after_an_empty_restart_a_light_newcomer_and_a_survivor_never_both_hold() -> None:
    """f03: the survivor's recovery set-up moves the newcomer's light grant in first; the survivor
    then finds no reserved slot left and is told its lease was lost."""
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        a, s = key_lock(client), key_lock(client)
        first = a.acquire()
        with pytest.raises(Exception):  # noqa: B017 - AcquireTimeout: S queued, the key escalated
            s.acquire(timeout=0.05)
        a.release(first)
        survivor = s.acquire()
        assert not survivor.light
        server.kill()
        server.start()
        client = redis.Redis.from_url(server.url)
        newcomer = key_lock(client)
        fresh = newcomer.acquire()
        s.runner = CommandRunner(client)  # the survivor's process reconnects to the new server
        lost = s.maintain()
        assert lost == [survivor]
        newcomer.maintain()
        assert fresh.usable(time.monotonic())
        assert key_lock(client).try_acquire() is None  # one holder, the newcomer


@pytest.mark.parametrize("kind", ["empty", "rdb"])
def test_reentrant_holds_follow_their_slot_through_a_readoption(kind: str) -> None:
    """f04: the inner release after a restart keeps the mutex; the outer one frees it."""
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        a = CountingLock(client, "mutex", 1, 3.0, reentrant=True, maintain_loop=False)
        other = CountingLock(client, "mutex", 1, 3.0, maintain_loop=False)
        with a as outer:
            with a as inner:
                assert inner is outer and outer.holds == 2
                if kind == "rdb":
                    client.save()
                server.kill()
                server.start()
                assert a.maintain() == []  # re-adopted a reserved slot
                assert outer.holds == 2
            assert other.try_acquire() is None  # the inner release left it held
        assert a.maintain() == []
        assert other.try_acquire() is not None  # the outer release freed it


def test_a_debug_reload_of_an_older_snapshot_is_a_restart() -> None:
    """f05: DEBUG RELOAD NOSAVE keeps the run id; the lock still notices the dataset went back."""
    server = RedisServer(extra_args=["--enable-debug-command", "yes", "--save", "3600 1"])
    if not server.version().startswith(("7", "8", "9")):
        pytest.skip("Redis 6.2's INFO takes one section: a reload in one run is not told apart")
    with server:
        client = redis.Redis.from_url(server.url)
        a = CountingLock(client, "mutex", 1, 3.0, maintain_loop=False)
        c = CountingLock(client, "mutex", 1, 3.0, maintain_loop=False)
        c.release(c.acquire())
        client.save()
        held = a.acquire()
        client.execute_command("DEBUG", "RELOAD", "NOSAVE")
        assert c.try_acquire() is None  # every slot reserved for the survivors
        assert a.maintain() == []
        assert held.fence > 0 and held.usable(time.monotonic())


@pytest.fixture
def evicting_server() -> Iterator[RedisServer]:
    with RedisServer(extra_args=["--maxmemory", "64mb", "--maxmemory-policy", "volatile-lru"]) as s:
        yield s


def test_a_server_that_may_evict_keys_gets_no_light_grants(evicting_server: RedisServer) -> None:
    """f06: under an eviction policy a key lock uses its stream, whose keys have no expiry."""
    client = redis.Redis.from_url(evicting_server.url)
    a, b = key_lock(client), key_lock(client)
    held = a.acquire()
    assert not held.light
    assert b.try_acquire() is None
    assert all(client.pttl(key) == -1 for key in client.scan_iter("redislock:*"))
    a.release(held)


def test_an_operators_pause_of_an_adaptive_stage_outlives_its_controller(
    redis_client: redis.Redis,
) -> None:
    """f07: ``set-limit STAGE 0`` pins the stage in its record: a controller made again after its
    hash expired neither starts above the pin nor moves the lock."""
    keys = LockKeys.of("redislock", "detail")
    runner = CommandRunner(redis_client)
    lock = CountingLock(redis_client, "detail", 4, 30.0, maintain_loop=False)
    lock.set_limit(4)
    params = AdaptiveParams(window=0.01, min_samples=1, minimum=1)
    drive(adapt_report(keys, Sample(1, 0.1, 0.01), params), runner, "detail")
    operator = CountingLock(redis_client, "detail", 4, 30.0, maintain_loop=False)
    drive(operator._core.set_limit(0, pin=True), runner, "detail")
    redis_client.delete(keys.adapt)  # the controller's hash expired (no reports for a while)
    due = None
    while due is None:
        due = drive(adapt_report(keys, Sample(5, 0.5, 0.05), params), runner, "detail")
    grown = ControllerState(2.0, 2, 0.1, version=due.state.version + 1)
    drive(commit(keys, due.state.version, grown, Window(), params), runner, "detail")
    assert lock.get_limit() == 0
    assert lock.try_acquire() is None


def test_a_full_redis_refuses_new_grants_but_renews_and_takes_back_held_ones() -> None:
    """f06's end: Redis out of memory (maxmemory reached, nothing it may evict). A holder's renewal
    and release still run (their scripts carry ``allow-oom`` on Redis 7+): a full Redis never lets a
    lease run out or strands a slot."""
    with RedisServer(extra_args=["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"]) as s:
        if not s.version().startswith(("7", "8", "9")):
            pytest.skip("Lua flags (allow-oom) need Redis 7")
        client = redis.Redis.from_url(s.url)
        a = CountingLock(client, "detail", 1, 3.0, maintain_loop=False)
        b = CountingLock(client, "detail", 1, 3.0, maintain_loop=False)
        b.release(b.acquire())  # B's set-up is done before Redis is full
        held = a.acquire()
        n = 0
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            while n < 1_000_000:
                client.sadd("shop:dupefilter", *(f"{n + i:040x}" for i in range(500)))
                n += 500
        assert a.maintain() == []
        assert held.usable(time.monotonic())
        assert b.try_acquire() is None
        assert a.release(held)
        assert client.xpending(KEYS_OF_DETAIL.slots, "holders")["pending"] == 0


KEYS_OF_DETAIL = LockKeys.of("redislock", "detail")
