"""A process's line for a stage's slots (requests/lines.py), in-process with a real Redis: a slot
freed here goes to the request of this process waiting in the middleware, in the same call (no Redis
round trip), while its wait in Redis's line stays for the next request; the reuse bound still hands
a slot to another process waiting first; a request that gives up withdraws a wait nobody needs."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio

from scrapy_redislock import AsyncCountingLock
from scrapy_redislock.errors import AcquireTimeout
from scrapy_redislock.lock.permit import Permit
from testing.crawlproc import leftover
from testing.inprocess import Front, front, held, request
from testing.waiting import until

pytestmark = pytest.mark.integration


def blocked_waits(client: redis.Redis) -> int:
    """Clients blocked in Redis waiting for a slot (XREADGROUP ... BLOCK)."""
    return sum(
        1
        for c in client.client_list()
        if c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "")
    )


def waiting_here(f: Front) -> int:
    """Requests waiting for a detail slot in the middleware."""
    return f.slots.lines.waiting("detail")


def test_a_freed_slot_goes_to_the_request_waiting_in_line_and_its_wait_stays(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The middleware alone (or a request that bypasses StageScheduler): while a request of the
    process waits in the middleware, it waits in Redis's line: the slot its finished request frees
    still goes on locally, to that request (the oldest), and the one wait in Redis serves the next
    request; once nothing waits the slot goes back to Redis, the wait takes it and gives it back."""

    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, scheduler=False, REDISLOCK_LOCAL_REUSE=30) as f:
            requests = [request("detail", n) for n in range(4)]
            current = requests[0]
            await f.send(current)
            permit = f.slots.take(current)
            assert isinstance(permit, Permit)
            for n, waiting in enumerate(requests[1:], start=1):
                served = f.send(waiting)  # in line: in the middleware, and in Redis
                await until(lambda: waiting_here(f) == 1 and blocked_waits(redis_client) == 1)
                f.middleware.request_left(current, f.crawler.spider)  # its download is over
                f.active.discard(current)
                await asyncio.wait_for(served, 10)
                assert f.slots.take(waiting) is permit  # same grant: no round trip
                assert f.crawler.stats.get_value("redislock/detail/reused") == n
                assert blocked_waits(redis_client) == 1  # the wait in Redis stays, for the next
                current = waiting
            assert held(redis_client, "detail") == [permit.grant]
            assert f.crawler.stats.get_value("redislock/detail/acquired") == 4
            # nothing waits: the slot goes back to Redis; the line's wait takes it and gives it back
            f.middleware.request_left(current, f.crawler.spider)
            f.active.discard(current)
            await until(lambda: blocked_waits(redis_client) == 0 and leftover(redis_client) == 0)
            assert f.crawler.stats.get_value("redislock/detail/reused") == 3

    asyncio.run(scenario())


def test_past_the_reuse_bound_another_process_waiting_first_gets_the_slot(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Fairness across processes: while young the slot passes to this process's request in line; past
    REDISLOCK_LOCAL_REUSE it goes back to Redis, where the other process waited first."""

    async def scenario() -> None:
        bound = 1.0  # a stall of the test before the local pass must not age the permit past it
        async with front(
            redis_url, {"detail": 1}, scheduler=False, REDISLOCK_LOCAL_REUSE=bound
        ) as f:
            current, second, third = (request("detail", n) for n in range(3))
            await f.send(current)
            permit = f.slots.take(current)
            assert isinstance(permit, Permit)
            other_client = redis.asyncio.Redis.from_url(redis_url)
            other = AsyncCountingLock(other_client, "detail", limit=1, ttl=3)
            try:
                other_wait = asyncio.ensure_future(other.acquire())
                await until(lambda: blocked_waits(redis_client) == 1)  # the other is first
                served = f.send(second)
                await until(lambda: waiting_here(f) == 1 and blocked_waits(redis_client) == 2)
                f.middleware.request_left(current, f.crawler.spider)
                f.active.discard(current)
                await asyncio.wait_for(served, 10)  # young: passed on here
                assert f.slots.take(second) is permit and not other_wait.done()
                waiting = f.send(third)
                await until(lambda: waiting_here(f) == 1)
                await until(lambda: time.monotonic() - permit.acquired_at > bound)
                f.middleware.request_left(second, f.crawler.spider)
                f.active.discard(second)
                # old: back to Redis's line, where the other is first
                theirs = await asyncio.wait_for(other_wait, 10)
                assert theirs.fence > permit.fence and not waiting.done()
                await other.release(theirs)
                await asyncio.wait_for(waiting, 10)  # then this process's wait
                again = f.slots.take(third)
                assert isinstance(again, Permit) and again.fence > theirs.fence
                f.middleware.process_response(third, None)  # type: ignore[arg-type]
                await until(lambda: leftover(redis_client) == 0)
            finally:
                await other.aclose()
                await other_client.aclose()

    asyncio.run(scenario())


def test_a_request_that_times_out_withdraws_the_wait_nobody_needs(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """REDISLOCK_WAIT_TIMEOUT: the request fails with AcquireTimeout (counted), and the line's wait
    in Redis ends with it when no other request waits; nothing is left in Redis."""

    async def scenario() -> None:
        async with front(
            redis_url, {"detail": 1}, scheduler=False, REDISLOCK_WAIT_TIMEOUT=0.3
        ) as f:
            holder = f.slots.wait("detail", None)
            permit = await asyncio.wait_for(holder, 10)
            with pytest.raises(AcquireTimeout):
                await f.slots.wait("detail", 0.3)
            assert f.crawler.stats.get_value("redislock/detail/timeouts") == 1
            await until(lambda: blocked_waits(redis_client) == 0)
            await f.locks.release(permit)
            await until(lambda: leftover(redis_client) == 0)

    asyncio.run(scenario())


# every request of these tests has one key, 127.0.0.1, capped at 1; a slot passes on for 30 s
ONE_KEY = {"REDISLOCK_STAGE_KEY": "domain", "REDISLOCK_KEY_LIMIT": 1, "REDISLOCK_LOCAL_REUSE": 30}


def test_a_key_slot_freed_goes_to_the_request_of_its_key_waiting_in_the_middleware(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The same line for a key's slots as for a stage's (no StageScheduler: keys wait in the
    middleware, as over scrapy-redis's): a finished request's key slot goes to this process's
    request of the key waiting there, in the same call, the same grant (counted as
    ``redislock/keys/reused``); the line's wait in Redis stays for the next, and once nothing waits
    it takes its grant and gives it back, and nothing is left in Redis."""

    async def scenario() -> None:
        async with front(redis_url, {}, scheduler=False, **ONE_KEY) as f:
            throttle = f.middleware.throttle
            assert throttle is not None
            first, second = request(None, 1), request(None, 2)
            await asyncio.wait_for(f.send(first), 10)  # the key's one slot, taken at once
            (permit,) = throttle.held_scopes(first)
            served = f.send(second)
            await until(
                lambda: (
                    throttle.lines.waiting("127.0.0.1") == 1 and blocked_waits(redis_client) == 1
                )
            )
            f.middleware.request_left(first, f.crawler.spider)  # its download is over
            f.active.discard(first)
            await asyncio.wait_for(served, 10)
            assert throttle.held_scopes(second) == [permit]  # the same grant: no round trip
            assert f.crawler.stats.get_value("redislock/keys/reused") == 1
            assert blocked_waits(redis_client) == 1  # the line's wait in Redis stays
            f.middleware.request_left(second, f.crawler.spider)
            f.active.discard(second)
            await until(lambda: blocked_waits(redis_client) == 0 and leftover(redis_client) == 0)
            assert not throttle.lines.lines  # the line is forgotten once empty
            assert f.crawler.stats.get_value("redislock/keys/reused") == 1

    asyncio.run(scenario())


def test_a_light_key_slot_passed_on_still_waits_out_a_pause(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A key slot taken on the key's light path had its pause checked by that take, for its own
    request: passed on locally to a request waiting in the middleware while a Retry-After pauses the
    key, it does not let that request start before the pause ends."""

    async def scenario() -> None:
        async with front(
            redis_url, {}, scheduler=False, **ONE_KEY, REDISLOCK_RETRY_AFTER=True
        ) as f:
            throttle = f.middleware.throttle
            assert throttle is not None and throttle.locks.adaptation is not None
            first, second = request(None, 1), request(None, 2)
            await asyncio.wait_for(f.send(first), 10)
            (permit,) = throttle.held_scopes(first)
            assert permit.light
            served = f.send(second)
            await until(lambda: throttle.lines.waiting("127.0.0.1") == 1)
            paused_at = time.monotonic()  # before: the pause ends 1 s after it at the soonest
            throttle.locks.adaptation.pause("key:127.0.0.1", 1.0)  # a site's Retry-After
            await until(lambda: not throttle.locks.adaptation.pausing)
            f.middleware.request_left(first, f.crawler.spider)
            f.active.discard(first)
            await asyncio.wait_for(served, 10)
            assert throttle.held_scopes(second) == [permit]  # passed on locally
            assert time.monotonic() - paused_at >= 0.9  # and only then through the pause
            assert f.crawler.stats.get_value("redislock/retry_after/waits") == 1
            f.middleware.request_left(second, f.crawler.spider)
            f.active.discard(second)
            await until(lambda: blocked_waits(redis_client) == 0 and leftover(redis_client) == 0)

    asyncio.run(scenario())
