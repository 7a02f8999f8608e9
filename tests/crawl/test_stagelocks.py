"""The request front's slots over StageLocks in-process (scrapy.utils.test.get_crawler, a real
Redis): the permit hand-off from the scheduler to the middleware, the one left-the-downloader sweep,
and the local hand-off of a freed slot with its fairness bound."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from scrapy_redislock.errors import AcquireTimeout
from testing.crawlproc import leftover
from testing.inprocess import front, held, request
from testing.waiting import until

pytestmark = pytest.mark.integration


def test_hand_take_finish(redis_url: str, redis_client: redis.Redis) -> None:
    """A slot handed with a request stays held while the request has it; an error is given once;
    finish frees it."""

    async def scenario() -> None:
        async with front(redis_url, {"detail": 2}, scheduler=False) as f:
            permit = await f.locks.acquire("detail", None)
            one, two = request("detail", 1), request("detail", 2)
            f.slots.hand(one, permit)
            f.slots.hand(two, AcquireTimeout("no slot"))
            assert f.slots.take(one) is permit
            assert f.slots.take(one) is permit  # still held: the request has it until it finishes
            assert isinstance(f.slots.take(two), AcquireTimeout)
            assert f.slots.take(two) is None  # an error is given once
            assert held(redis_client, "detail") == [permit.grant]
            f.slots.finish(one)
            # a second finish (process_response after request_left) does nothing
            f.slots.finish(one)
            await until(lambda: leftover(redis_client) == 0)
            assert f.crawler.stats.get_value("redislock/detail/reused") is None

    asyncio.run(scenario())


def test_the_sweep_frees_a_request_gone_from_the_downloader_at_two_ticks(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario() -> None:
        async with front(redis_url, {"detail": 2}, scheduler=False) as f:
            inside, gone = request("detail", 1), request("detail", 2)
            f.slots.hand(inside, await f.locks.acquire("detail", None))
            f.slots.hand(gone, await f.locks.acquire("detail", None))
            f.active.add(inside)
            # No await from here to the second sweep: no renewal tick of the process can run in
            # between.
            f.slots.sweep()
            assert f.slots.take(gone) is not None  # one tick out of the downloader is not enough
            f.slots.sweep()
            assert f.slots.take(gone) is None
            assert f.slots.take(inside) is not None
            await until(lambda: leftover(redis_client) == 1)
            f.active.discard(inside)

    asyncio.run(scenario())


def test_a_freed_slot_is_kept_for_a_queued_request_without_redis_and_keeps_its_grant(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Within REDISLOCK_LOCAL_REUSE the slot is kept for a queued request in the finish call itself
    (no await: no Redis round trip), the same grant stays held in Redis, and the fence is the
    grant's."""

    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, scheduler=False, REDISLOCK_LOCAL_REUSE=30) as f:
            f.slots.serve_scheduler(
                queued=lambda stage: 1, could_use=lambda stage: 1, left=None, give_back=None
            )
            permit = await f.locks.acquire("detail", None)
            one = request("detail", 1)
            f.slots.hand(one, permit)
            f.slots.finish(one)
            assert f.slots.kept("detail") == 1
            assert held(redis_client, "detail") == [permit.grant]
            assert permit.fence == int(permit.grant.split("-")[1])
            assert f.crawler.stats.get_value("redislock/detail/reused") == 1
            assert f.slots.take_kept("detail") is permit
            await f.locks.release(permit)
            assert leftover(redis_client) == 0

    asyncio.run(scenario())


def test_an_older_slot_goes_back_to_redis_and_one_no_queued_request_could_use_too(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Past REDISLOCK_LOCAL_REUSE since Redis's grant, or when no queued request could use it, the
    slot is released to Redis."""

    async def scenario() -> None:
        async with front(
            redis_url, {"detail": 1}, scheduler=False, REDISLOCK_LOCAL_REUSE=0.05
        ) as f:
            wanted = [1]
            f.slots.serve_scheduler(
                queued=lambda stage: 1, could_use=lambda stage: wanted[0], left=None, give_back=None
            )
            permit = await f.locks.acquire("detail", None)
            await until(lambda: time.monotonic() - permit.acquired_at > 0.05)
            f.slots.free(permit)
            assert f.slots.kept("detail") == 0
            await until(lambda: leftover(redis_client) == 0)

            wanted[0] = 0
            permit = await f.locks.acquire("detail", None)
            f.slots.free(permit)
            assert f.slots.kept("detail") == 0
            await until(lambda: leftover(redis_client) == 0)
            assert f.crawler.stats.get_value("redislock/detail/reused") is None

    asyncio.run(scenario())


def test_a_slot_past_its_lease_is_not_taken(redis_url: str, redis_client: redis.Redis) -> None:
    """Its lease ran out unrenewed on this process's clock (a stall, a partition): take() drops it
    (back to Redis) and the request waits for another. No await between the clock check and take():
    no renewal can move it."""

    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, scheduler=False) as f:
            permit = await f.locks.acquire("detail", None)
            one = request("detail", 1)
            f.slots.hand(one, permit)
            permit.valid_until = time.monotonic()
            assert f.slots.take(one) is None
            assert f.slots.take(one) is None  # dropped, not handed later
            assert f.crawler.stats.get_value("redislock/detail/unusable") == 1
            await until(lambda: leftover(redis_client) == 0)

    asyncio.run(scenario())


def test_a_slot_past_its_lease_is_not_passed_on(redis_url: str, redis_client: redis.Redis) -> None:
    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, scheduler=False, REDISLOCK_LOCAL_REUSE=30) as f:
            f.slots.serve_scheduler(
                queued=lambda stage: 1, could_use=lambda stage: 1, left=None, give_back=None
            )
            permit = await f.locks.acquire("detail", None)
            one = request("detail", 1)
            f.slots.hold(one, permit)
            permit.valid_until = time.monotonic()
            f.slots.finish(one)
            assert f.slots.kept("detail") == 0
            assert f.crawler.stats.get_value("redislock/detail/unusable") == 1
            assert f.crawler.stats.get_value("redislock/detail/reused") is None
            await until(lambda: leftover(redis_client) == 0)

    asyncio.run(scenario())
