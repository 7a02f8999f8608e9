"""A slot that is no longer held under a valid lease never goes out with a request (in-process, a
real Redis): one lost while StageScheduler kept it for a queued request (an operator reset), one
whose lease ran out while this process could not renew it (a partition: another process gets the
slot), one lost between the scheduler and the middleware, one lost while its request waited for its
key slot. Each is dropped, counted as ``redislock/<stage>/unusable``, and its request waits for a
fresh slot (in the scheduler when it is still queued)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.exceptions
from scrapy import Request
from scrapy.http import Response

from scrapy_redislock import CountingLock
from scrapy_redislock.lock.base import CommandRunner
from scrapy_redislock.lock.core import reset_lock
from scrapy_redislock.lock.permit import LockKeys, Permit
from scrapy_redislock.lock.protocol import drive
from testing.crawlproc import leftover
from testing.inprocess import Front, front, held, request
from testing.waiting import until

pytestmark = pytest.mark.integration


def reset(client: redis.Redis, stage: str) -> None:
    """What ``redislock reset`` does: every grant of the stage freed in Redis, its holders not
    told."""
    drive(reset_lock(LockKeys.of("redislock", stage)), CommandRunner(client), stage)


async def queued_with_a_ready_slot(f: Front) -> tuple[Request, Permit]:
    """A request queued in StageScheduler with a slot in hand for it (passed on by a finished
    request of the same stage; the engine has not asked yet)."""
    assert f.scheduler is not None
    first, queued = request("detail", 0), request("detail", 1)
    f.scheduler.enqueue_request(first)
    assert await f.next_request() is first
    await f.send(first)
    f.scheduler.enqueue_request(queued)
    # done: its slot is kept for the queued request
    f.middleware.request_left(first, f.crawler.spider)
    f.active.discard(first)
    (permit,) = f.slots.kept.outcomes("detail")
    assert isinstance(permit, Permit)
    return queued, permit


async def goes_out_with_a_fresh_slot(
    f: Front, client: redis.Redis, queued: Request, old: Permit
) -> Request:
    """The unusable slot was dropped: the request stays queued until the stage's wait in Redis gets
    a fresh one."""
    sent = await f.next_request(timeout=20)
    assert sent is queued
    await f.send(sent)
    fresh = f.slots.take(sent)
    assert isinstance(fresh, Permit) and fresh is not old
    assert fresh.usable(time.monotonic())
    assert held(client, "detail") == [fresh.grant]
    return sent


def test_a_slot_lost_in_the_ready_queue_is_not_handed_out(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, REDISLOCK_LOCAL_REUSE=30) as f:
            assert f.scheduler is not None
            queued, permit = await queued_with_a_ready_slot(f)
            reset(redis_client, "detail")
            await until(lambda: permit.lost)  # the renewal loop found it gone
            sent = await goes_out_with_a_fresh_slot(f, redis_client, queued, permit)
            stats = f.crawler.stats
            assert stats.get_value("redislock/detail/lost") == 1
            assert stats.get_value("redislock/detail/unusable") == 1
            f.middleware.process_response(sent, Response(sent.url, request=sent))
            await until(lambda: leftover(redis_client) == 0)

    asyncio.run(scenario())


def test_a_ready_slot_past_its_lease_is_not_handed_out(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Renewals fail (this process is cut off), the lease runs out in Redis and another process
    takes the slot: this process cannot know it is lost, but its clock says the lease is over."""

    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, REDISLOCK_LOCAL_REUSE=30) as f:
            assert f.scheduler is not None
            queued, permit = await queued_with_a_ready_slot(f)
            lock = f.locks.locks["detail"]

            async def cut_off() -> list[Permit]:
                raise redis.exceptions.ConnectionError("partitioned")

            lock.maintain = cut_off  # type: ignore[method-assign]
            rival = CountingLock(redis.Redis.from_url(redis_url), "detail", limit=1, ttl=3)
            try:
                rival_permit = await asyncio.to_thread(rival.acquire, 20)
                assert not permit.usable(time.monotonic())
                # the stale slot is dropped; the request stays queued
                assert f.scheduler.next_request() is None
                del lock.maintain  # reachable again
                assert f.crawler.stats.get_value("redislock/detail/unusable") == 1
                assert held(redis_client, "detail") == [rival_permit.grant]
                await asyncio.to_thread(rival.release, rival_permit)
                sent = await goes_out_with_a_fresh_slot(f, redis_client, queued, permit)
                f.middleware.process_response(sent, Response(sent.url, request=sent))
            finally:
                rival.close()
            await until(lambda: leftover(redis_client) == 0)

    asyncio.run(scenario())


def test_a_slot_lost_on_its_way_to_the_middleware_makes_the_request_wait_there(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, scheduler=False) as f:
            permit = await f.locks.acquire("detail", None)
            sent = request("detail", 1)
            f.slots.hand(sent, permit)
            f.active.add(sent)  # it reached the downloader (else the sweep may free its slot first)
            reset(redis_client, "detail")
            await until(lambda: permit.lost)
            waiting = f.middleware.process_request(sent)
            assert waiting is not None  # it waits for a slot instead of going out with the lost one
            await asyncio.wait_for(waiting, 10)
            fresh = f.slots.take(sent)
            assert isinstance(fresh, Permit) and fresh is not permit
            assert held(redis_client, "detail") == [fresh.grant]
            assert f.crawler.stats.get_value("redislock/detail/unusable") == 1
            f.middleware.process_response(sent, Response(sent.url, request=sent))
            await until(lambda: leftover(redis_client) == 0)

    asyncio.run(scenario())


def test_a_stage_slot_lost_while_its_request_waits_for_its_key_is_taken_again(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The key slot comes after the stage slot, so the request gives the key slot back and takes
    both again."""

    async def scenario() -> None:
        settings = {"REDISLOCK_STAGE_KEY": "domain", "REDISLOCK_KEY_LIMIT": 1}
        async with front(redis_url, {"detail": 2}, scheduler=False, **settings) as f:
            mw = f.middleware
            assert mw.throttle is not None
            first, second = request("detail", 1), request("detail", 2)
            # through the downloader, as the engine sends them (else the sweep may free the
            # second's stage slot while it waits for its key)
            await f.send(first)
            waiting = f.send(second)
            # holds its stage slot, waits for the key
            await until(lambda: [w.keyed for w in mw.throttle.waits.waits.values()] == [True])
            permit = f.slots.take(second)
            assert isinstance(permit, Permit)
            reset(redis_client, "detail")
            await until(lambda: permit.lost)
            mw.process_response(first, Response(first.url, request=first))  # the key slot is free
            await asyncio.wait_for(waiting, 10)
            fresh = f.slots.take(second)
            assert isinstance(fresh, Permit) and fresh is not permit
            assert held(redis_client, "detail") == [fresh.grant]
            assert f.crawler.stats.get_value("redislock/detail/unusable") == 1
            # the second took its key twice
            assert f.crawler.stats.get_value("redislock/keys/acquired") == 3
            mw.process_response(second, Response(second.url, request=second))
            await until(lambda: leftover(redis_client) == 0)

    asyncio.run(scenario())
