"""StageScheduler in-process (scrapy.utils.test.get_crawler, a real Redis, no crawl): parking, the slot handed to
the middleware with the request, the local hand-off of a freed slot and its fairness bound, and the waiter-set hang.
The real crawls are in test_scheduler.py."""

from __future__ import annotations

import ast
import asyncio
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio

from scrapy_redislock import AsyncCountingLock
from scrapy_redislock.errors import AcquireTimeout
from scrapy_redislock.lock.core import Permit
from scrapy_redislock.requests import scheduler as scheduler_module
from testing.crawlproc import leftover
from testing.inprocess import front, held, request, until

pytestmark = pytest.mark.integration
PACKAGE = Path(__file__).resolve().parents[2] / "scrapy_redislock"


def test_the_scheduler_does_not_import_the_middleware() -> None:
    """The request front's two parts meet only in crawl/ (StageLocks, crawl.early)."""
    tree = ast.parse((PACKAGE / "requests" / "scheduler.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "scrapy_redislock.requests.middleware" not in imported
    assert not any("engine_scheduler" in line for line in (PACKAGE / "requests" / "middleware.py").open())


def test_uncapped_go_at_once_capped_go_with_their_slot(redis_url: str, redis_client: redis.Redis) -> None:
    async def scenario() -> None:
        async with front(redis_url, {"detail": 1, "comments": None}) as f:
            assert f.scheduler is not None
            first, second, free = request("detail", 1), request("detail", 2), request("comments", 1)
            for r in (first, second, free):
                f.scheduler.enqueue_request(r)
            assert f.scheduler.next_request() is free  # the capped ones are parked meanwhile
            assert await f.next_request() is first
            permit = f.locks.take(first)
            assert isinstance(permit, Permit)
            assert held(redis_client, "detail") == [permit.grant]
            assert f.scheduler.has_pending_requests() and f.scheduler.next_request() is None  # cap 1
            assert f.middleware.process_request(first) is None  # it came with its slot: nothing to wait for
            f.middleware.process_response(first, None)  # type: ignore[arg-type]
            assert await f.next_request() is second
            assert f.crawler.stats.get_value("redislock/detail/acquired") == 2

    asyncio.run(scenario())


def test_a_freed_slot_goes_to_the_next_parked_request_in_the_same_call(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """No await between the finish and the next request: no Redis round trip; the grant (and fence) stay."""

    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, REDISLOCK_LOCAL_REUSE=30) as f:
            assert f.scheduler is not None
            requests = [request("detail", n) for n in range(4)]
            for r in requests:
                f.scheduler.enqueue_request(r)
            current = await f.next_request()
            permit = f.locks.take(current)
            assert isinstance(permit, Permit)
            for expected in requests[1:]:
                f.middleware.request_left(current, f.crawler.spider)  # the download is over
                current = f.scheduler.next_request()
                assert current is expected
                assert f.locks.take(current) is permit  # same grant, same fence
            assert held(redis_client, "detail") == [permit.grant]
            assert f.crawler.stats.get_value("redislock/detail/reused") == 3
            assert f.crawler.stats.get_value("redislock/detail/acquired") == 4
            f.middleware.process_response(current, None)  # type: ignore[arg-type]
            await until(lambda: leftover(redis_client) == 0)

    asyncio.run(scenario())


def test_without_local_reuse_every_slot_goes_back_to_redis(redis_url: str, redis_client: redis.Redis) -> None:
    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, REDISLOCK_LOCAL_REUSE=0) as f:
            assert f.scheduler is not None
            for n in range(2):
                f.scheduler.enqueue_request(request("detail", n))
            first = await f.next_request()
            grant = f.locks.take(first)
            f.middleware.request_left(first, f.crawler.spider)
            assert f.scheduler.next_request() is None  # not in the same call: the slot went to Redis
            second = await f.next_request()
            again = f.locks.take(second)
            assert isinstance(grant, Permit) and isinstance(again, Permit) and again.fence > grant.fence
            assert f.crawler.stats.get_value("redislock/detail/reused") is None
            f.middleware.process_response(second, None)  # type: ignore[arg-type]

    asyncio.run(scenario())


def test_past_the_reuse_bound_a_waiting_process_gets_the_slot(redis_url: str, redis_client: redis.Redis) -> None:
    """Another process waits first in Redis's line: the slot passes on locally while young, then goes to it."""

    async def scenario() -> None:
        bound = 1.0  # a stall of the test (a busy machine) before the local pass must not age the permit past it
        async with front(redis_url, {"detail": 1}, REDISLOCK_LOCAL_REUSE=bound) as f:
            assert f.scheduler is not None
            f.scheduler.enqueue_request(request("detail", 0))
            current = await f.next_request()
            permit = f.locks.take(current)
            assert isinstance(permit, Permit)
            other_client = redis.asyncio.Redis.from_url(redis_url)
            other = AsyncCountingLock(other_client, "detail", limit=1, ttl=3)
            try:
                other_wait = asyncio.ensure_future(other.acquire())
                await until(lambda: blocked_waits(redis_client) == 1)  # the other is first in Redis's line
                for n in range(1, 4):
                    f.scheduler.enqueue_request(request("detail", n))
                assert f.scheduler.next_request() is None  # parked; their waiters queue behind the other
                f.middleware.request_left(current, f.crawler.spider)
                current = f.scheduler.next_request()
                assert current is not None and f.locks.take(current) is permit  # young: passed on locally
                assert not other_wait.done()
                await until(lambda: time.monotonic() - permit.acquired_at > bound)
                f.middleware.request_left(current, f.crawler.spider)
                assert f.scheduler.next_request() is None  # old: back to Redis's line, where the other is first
                theirs = await asyncio.wait_for(other_wait, 10)
                assert theirs.fence > permit.fence
                assert f.scheduler.next_request() is None
                await other.release(theirs)
                assert (await f.next_request()).url.endswith("/detail/2")
            finally:
                await other.aclose()
                await other_client.aclose()

    asyncio.run(scenario())


def blocked_waits(client: redis.Redis) -> int:
    """Clients blocked in Redis waiting for a slot (XREADGROUP ... BLOCK)."""
    return sum(1 for c in client.client_list() if c.get("cmd") == "xreadgroup" and "b" in c.get("flags", ""))


def test_a_finished_waiter_still_in_the_waiter_set_does_not_count(redis_url: str, redis_client: redis.Redis) -> None:
    """The hang fixed in cfbf5bc: a waiter task that has finished stays in the set until its done callback runs (a
    loop iteration later); a request parked in between must still get a waiter, or it waits for ever with the slot
    free. Here the finished task sits in the set for good: counting it would hang this test."""

    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, REDISLOCK_WAITERS_PER_STAGE=1) as f:
            assert f.scheduler is not None
            finished = asyncio.ensure_future(asyncio.sleep(0))
            await finished
            f.scheduler.waiters["detail"].add(finished)
            f.scheduler.enqueue_request(request("detail", 1))
            assert f.scheduler.next_request() is None  # parked; a live waiter must have been started beside it
            assert f.scheduler._live_waiters("detail") == 1
            r = await f.next_request(timeout=5)
            f.middleware.process_response(r, None)  # type: ignore[arg-type]

    asyncio.run(scenario())


def test_a_wait_timeout_is_handed_to_the_middleware_once(redis_url: str, redis_client: redis.Redis) -> None:
    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, REDISLOCK_WAIT_TIMEOUT=0.2) as f:
            assert f.scheduler is not None
            f.scheduler.enqueue_request(request("detail", 0))
            holder = await f.next_request()
            f.scheduler.enqueue_request(request("detail", 1))
            late = await f.next_request()
            with pytest.raises(AcquireTimeout):
                f.middleware.process_request(late)
            assert late.meta["dont_retry"] is True
            assert f.crawler.stats.get_value("redislock/detail/timeouts") == 1
            f.middleware.process_response(holder, None)  # type: ignore[arg-type]
            await until(lambda: leftover(redis_client) == 0)

    asyncio.run(scenario())


def test_an_empty_inner_scheduler_is_asked_again_only_after_a_pause(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine busy with other requests asks at every finished download; scrapy-redis's queue would answer each ask
    with a Redis command. After an empty answer the inner scheduler is left alone for a pause that doubles while it
    stays empty, the engine is woken at the pause's end if it asked meanwhile, and a request enqueued by this
    process ends the pause at once."""

    pause = 1.0  # long enough that a busy machine's stall cannot end it between two asks of the test
    monkeypatch.setattr(scheduler_module, "EMPTY_PAUSE", pause)
    monkeypatch.setattr(scheduler_module, "EMPTY_PAUSE_MOST", 10 * pause)

    async def scenario() -> None:
        async with front(redis_url, {"detail": 1, "comments": None}) as f:
            scheduler = f.scheduler
            assert scheduler is not None
            asks = 0
            inner_next = scheduler.inner.next_request

            def counted() -> object:
                nonlocal asks
                asks += 1
                return inner_next()

            scheduler.inner.next_request = counted
            assert scheduler.next_request() is None
            assert asks == 1 and scheduler._wake_after_pause is None
            for _ in range(50):  # the engine asks again and again: the inner scheduler is not asked
                assert scheduler.next_request() is None
            assert asks == 1
            assert scheduler._wake_after_pause is not None  # the engine asked during the pause: woken at its end
            await until(lambda: scheduler._wake_after_pause is None)
            assert scheduler.next_request() is None
            assert asks == 2  # after the pause: asked once more, and the next pause is twice as long
            assert scheduler._ask_inner_at - time.monotonic() > pause
            free = request("comments", 1)
            scheduler.enqueue_request(free)
            assert scheduler.next_request() is free  # this process's own request ends the pause
            assert asks == 3

    asyncio.run(scenario())
