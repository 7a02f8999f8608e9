"""StageScheduler in-process (scrapy.utils.test.get_crawler, a real Redis, no crawl): capped
requests stay in the inner scheduler, in its order, until they can go; at most
REDISLOCK_WAITERS_PER_STAGE waits per stage in Redis's line get their slots; the local hand-off of a freed
slot and its fairness bound; scrapy-redis's queue stays shared and is not polled while empty. The
real crawls are in test_scheduler.py."""

from __future__ import annotations

import ast
import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import redis.asyncio
from redis.backoff import ConstantBackoff, NoBackoff
from redis.retry import Retry
from scrapy import Request, signals

from scrapy_redislock import AsyncCountingLock
from scrapy_redislock.lock.permit import Permit
from scrapy_redislock.requests.scheduler import _one_try
from testing.crawlproc import leftover
from testing.inprocess import front, held, request
from testing.netproxy import LatencyProxy
from testing.waiting import until

pytestmark = pytest.mark.integration
PACKAGE = Path(__file__).resolve().parents[2] / "scrapy_redislock"


def test_the_scheduler_does_not_import_the_middleware() -> None:
    """The request front's two parts meet only in crawl/ (StageLocks, crawl.early)."""
    tree = ast.parse((PACKAGE / "requests" / "scheduler.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "scrapy_redislock.requests.middleware" not in imported
    assert "engine_scheduler" not in (PACKAGE / "requests" / "middleware.py").read_text()


def prioritized(stage: str | None, n: int, priority: int) -> Request:
    r = request(stage, n)
    return r.replace(priority=priority)


def test_capped_requests_wait_in_the_scheduler_in_its_order(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A full stage's requests stay queued (pending, counted by len) while other stages' go past
    them: none leaves to wait for its slot in the downloader (where it would take one of
    CONCURRENT_REQUESTS); the process's one wait in Redis for the stage gets a slot, which the
    highest-priority request takes; a freed slot passes to the next queued one, same grant."""

    async def scenario() -> None:
        async with front(
            redis_url, {"detail": 1, "comments": None}, REDISLOCK_WAITERS_PER_STAGE=1
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None
            d0, d1, free = request("detail", 0), request("detail", 1), request(None, 0)
            for r in (d0, d1, free):
                scheduler.enqueue_request(r)
            urgent = prioritized("detail", 2, 5)
            scheduler.enqueue_request(urgent)
            # no detail slot in hand yet: the uncapped request goes past, no detail leaves
            assert scheduler.next_request() is free
            assert scheduler.next_request() is None
            assert f.slots.lines.lines["detail"].asks  # the stage's wait in Redis
            # the wait's grant is kept for the queued requests: the highest priority takes it
            urgent_out = await f.next_request()
            assert urgent_out is urgent
            permit = f.slots.take(urgent)
            assert isinstance(permit, Permit) and held(redis_client, "detail") == [permit.grant]
            f.send(urgent)
            # cap 1: d0 and d1 wait in the scheduler, not in the downloader
            assert scheduler.next_request() is None
            assert scheduler.has_pending_requests() and len(scheduler) == 2
            assert f.slots.lines.waiting("detail") == 0 and set(f.active) == {urgent}
            f.middleware.process_response(urgent, None)  # type: ignore[arg-type]
            f.active.discard(urgent)
            # the freed slot was kept for the next queued request, with no round trip (same grant)
            assert scheduler.next_request() is d0
            assert f.slots.take(d0) is permit
            assert f.crawler.stats.get_value("redislock/detail/reused") == 1
            f.send(d0)
            f.middleware.process_response(d0, None)  # type: ignore[arg-type]
            f.active.discard(d0)
            assert scheduler.next_request() is d1
            await f.send(d1)
            f.middleware.process_response(d1, None)  # type: ignore[arg-type]
            assert not scheduler.has_pending_requests()
            assert f.crawler.stats.get_value("scheduler/enqueued") == 4  # each request counted once
            assert f.crawler.stats.get_value("scheduler/dequeued") == 4

    asyncio.run(scenario())


def test_priority_order_within_and_across_stages(redis_url: str) -> None:
    """A cap that never binds changes nothing in the order once the stages have slots in hand:
    priority first, across stages too; equal priorities in the queue's order (FIFO here). Before
    its first grant a capped stage's requests stay queued, so the uncapped request goes first."""

    async def scenario() -> None:
        async with front(
            redis_url, {"detail": 64, "comments": 64}, REDISLOCK_WAITERS_PER_STAGE=8
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None
            wanted = [
                prioritized("detail", 0, 0),
                prioritized("comments", 1, 3),
                prioritized("detail", 2, 0),
                prioritized("detail", 3, 7),
                prioritized("comments", 4, 0),
                prioritized(None, 5, 5),
            ]
            for r in wanted:
                scheduler.enqueue_request(r)
            first = await f.next_request()  # before any grant: the uncapped request
            order = [int(first.url.rsplit("/", 1)[1])]
            f.send(first)
            # each stage's waits got a slot for each of its queued requests (8 waits a stage)
            await until(
                lambda: f.slots.kept.count("detail") == 3 and f.slots.kept.count("comments") == 2
            )
            while len(order) < len(wanted):
                r = await f.next_request()
                order.append(int(r.url.rsplit("/", 1)[1]))
                f.send(r)
            assert order == [5, 3, 1, 0, 2, 4]
            await until(lambda: len(f.slots.holding()) == 5)
            for r in list(f.slots.holding()):
                f.middleware.process_response(r, None)  # type: ignore[arg-type]

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "priority_queue",
    ["scrapy.pqueues.DownloaderAwarePriorityQueue", "scrapy.pqueues.ScrapyPriorityQueue"],
)
def test_priority_order_holds_after_a_sub_queues_top_priority_ran_out_beside_start_requests(
    redis_url: str, priority_queue: str
) -> None:
    """Scrapy's priority queue leaves its current priority on one it emptied while start requests
    remain (its next pop moves on); peeked then, it raised KeyError (or, without the downloader's
    slots, ranked its head by that priority). StageScheduler peeks whenever two sub-queues could
    go: the uncapped callback request at priority 2 goes first (detail has no slot yet); then, with
    detail's slot in hand, detail's request at priority 1 before the start request at 0."""

    async def scenario() -> None:
        async with front(
            redis_url,
            {"detail": 64},
            REDISLOCK_WAITERS_PER_STAGE=8,
            SCHEDULER_PRIORITY_QUEUE=priority_queue,
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None
            start = prioritized(None, 0, 0)
            start.meta["is_start_request"] = True
            callback, detail = prioritized(None, 1, 2), prioritized("detail", 2, 1)
            for r in (start, callback, detail):
                scheduler.enqueue_request(r)
            assert await f.next_request() is callback
            f.send(callback)
            await until(lambda: f.slots.kept.count("detail") == 1)
            assert await f.next_request() is detail
            f.send(detail)
            assert await f.next_request() is start
            f.send(start)
            await until(lambda: len(f.slots.holding()) == 1)
            for r in list(f.slots.holding()):
                f.middleware.process_response(r, None)  # type: ignore[arg-type]

    asyncio.run(scenario())


def test_a_freed_slot_goes_to_the_next_queued_request_in_the_same_call(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """No await between the finish and the next request: no Redis round trip; the grant (and fence)
    stay."""

    async def scenario() -> None:
        async with front(
            redis_url, {"detail": 1}, REDISLOCK_LOCAL_REUSE=30, REDISLOCK_WAITERS_PER_STAGE=1
        ) as f:
            assert f.scheduler is not None
            requests = [request("detail", n) for n in range(4)]
            for r in requests:
                f.scheduler.enqueue_request(r)
            current = await f.next_request()
            assert current is requests[0]
            await f.send(current)
            permit = f.slots.take(current)
            assert isinstance(permit, Permit)
            for expected in requests[1:]:
                f.middleware.request_left(current, f.crawler.spider)  # the download is over
                current = f.scheduler.next_request()
                assert current is expected
                assert f.slots.take(current) is permit  # same grant, same fence
            assert held(redis_client, "detail") == [permit.grant]
            assert f.crawler.stats.get_value("redislock/detail/reused") == 3
            assert f.crawler.stats.get_value("redislock/detail/acquired") == 4
            f.middleware.process_response(current, None)  # type: ignore[arg-type]
            await until(lambda: leftover(redis_client) == 0)

    asyncio.run(scenario())


def test_a_request_back_in_the_scheduler_with_its_stage_slot_does_not_leak_it(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Cap 2. A request left with a slot passed on by a finished request, and a middleware before
    StageLockMiddleware sent it straight back (it returned the request itself: Scrapy schedules it
    again); it leaves again with the next freed slot. The slot it came back with is freed (it once
    was dropped unreleased: held by nobody, 1 of the stage's 2 slots, until the spider closed)."""

    async def scenario() -> None:
        async with front(
            redis_url, {"detail": 2}, REDISLOCK_LOCAL_REUSE=30, REDISLOCK_WAITERS_PER_STAGE=2
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None
            holders = [request("detail", 0), request("detail", 1)]
            for r in holders:
                scheduler.enqueue_request(r)
            for r in holders:
                assert await f.next_request() is r  # with a slot the stage's waits got
                await f.send(r)
            again = request("detail", 2)
            scheduler.enqueue_request(again)
            f.middleware.process_response(holders[0], None)  # type: ignore[arg-type]
            f.active.discard(holders[0])
            assert scheduler.next_request() is again  # with the slot passed on
            first = f.slots.permit_of(again)
            assert first is not None
            scheduler.enqueue_request(again)  # back, unseen by the middleware
            f.middleware.process_response(holders[1], None)  # type: ignore[arg-type]
            f.active.discard(holders[1])
            assert scheduler.next_request() is again  # with the other slot
            second = f.slots.permit_of(again)
            assert second is not None and second is not first
            await f.send(again)
            f.middleware.process_response(again, None)  # type: ignore[arg-type]
            await until(lambda: not f.locks.releasing)
            assert held(redis_client, "detail") == [], (first.grant, second.grant)

    asyncio.run(scenario())


def test_without_local_reuse_every_slot_goes_back_to_redis(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, REDISLOCK_LOCAL_REUSE=0) as f:
            assert f.scheduler is not None
            for n in range(2):
                f.scheduler.enqueue_request(request("detail", n))
            first = await f.next_request()
            await f.send(first)
            grant = f.slots.take(first)
            f.middleware.request_left(first, f.crawler.spider)
            f.active.discard(first)
            # back to Redis: the next request waits in the scheduler for a new grant
            second = await f.next_request()
            await f.send(second)
            again = f.slots.take(second)
            assert (
                isinstance(grant, Permit)
                and isinstance(again, Permit)
                and again.fence > grant.fence
            )
            assert f.crawler.stats.get_value("redislock/detail/reused") is None
            f.middleware.process_response(second, None)  # type: ignore[arg-type]

    asyncio.run(scenario())


def test_past_the_reuse_bound_a_waiting_process_gets_the_slot(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Another process waits first in Redis's line: the slot passes on locally while young, then
    goes to it."""

    async def scenario() -> None:
        bound = 1.0  # a stall of the test (a busy machine) before the local pass must not age the permit past it
        async with front(redis_url, {"detail": 1}, REDISLOCK_LOCAL_REUSE=bound) as f:
            assert f.scheduler is not None
            f.scheduler.enqueue_request(request("detail", 0))
            current = await f.next_request()
            await f.send(current)
            permit = f.slots.take(current)
            assert isinstance(permit, Permit)
            other_client = redis.asyncio.Redis.from_url(redis_url)
            other = AsyncCountingLock(other_client, "detail", limit=1, ttl=3)
            try:
                other_wait = asyncio.ensure_future(other.acquire())
                # the other is first in Redis's line
                await until(lambda: blocked_waits(redis_client) == 1)
                for n in range(1, 4):
                    f.scheduler.enqueue_request(request("detail", n))
                f.middleware.request_left(current, f.crawler.spider)
                f.active.discard(current)
                current = f.scheduler.next_request()
                # young: passed on locally
                assert current is not None and f.slots.take(current) is permit
                assert not other_wait.done()
                await until(lambda: time.monotonic() - permit.acquired_at > bound)
                f.middleware.request_left(current, f.crawler.spider)
                f.active.discard(current)
                # old: back to Redis's line, where the other is first
                theirs = await asyncio.wait_for(other_wait, 10)
                assert theirs.fence > permit.fence
                # the next queued request waits in the scheduler, this process's wait in Redis's
                # line after the other's
                assert f.scheduler.next_request() is None
                await other.release(theirs)
                third = await f.next_request()
                assert third.url.endswith("/detail/2")
                mine = f.slots.take(third)
                assert isinstance(mine, Permit) and mine.fence > theirs.fence
                await f.send(third)
                f.middleware.process_response(third, None)  # type: ignore[arg-type]
            finally:
                await other.aclose()
                await other_client.aclose()

    asyncio.run(scenario())


def blocked_waits(client: redis.Redis) -> int:
    """Clients blocked in Redis waiting for a slot (XREADGROUP ... BLOCK)."""
    return sum(
        1
        for c in client.client_list()
        if c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "")
    )


def test_a_shared_queue_stays_shared_and_an_empty_sub_queue_is_looked_at_not_popped(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Over scrapy-redis's scheduler, a process takes from the shared queue only what can go (the
    rest stays in Redis, split by stage). A sub-queue found empty is not popped again however often
    the engine asks: a look at the lengths of the queue's keys finds what another process pushes
    into it, and wakes the engine for it; looks that find nothing wake nothing; a request this
    process pushes is popped at once."""
    shared = {
        "REDISLOCK_SCHEDULER_INNER": "scrapy_redis.scheduler.Scheduler",
        "REDIS_URL": redis_url,
        "SCHEDULER_PERSIST": False,
        "REDISLOCK_WAITERS_PER_STAGE": 1,
    }

    async def scenario() -> None:
        async with front(redis_url, {"detail": 1, "comments": None}, **shared) as f:
            scheduler = f.scheduler
            assert scheduler is not None and scheduler.shared is not None
            queues = scheduler.shared
            for n in range(5):
                scheduler.enqueue_request(request("detail", n))  # pushed in the queue thread
            await until(lambda: redis_client.zcard("unit:requests:detail") == 5)
            first = await f.next_request()
            assert first.url.endswith("/detail/0")
            waiting = f.send(first)
            # the rest stays in Redis for every process to take
            assert scheduler.next_request() is None
            assert redis_client.zcard("unit:requests:detail") == 4
            await waiting
            asks = {"n": 0}  # pops of the spider's own key (scrapy-redis's, in a script)
            base = queues.queues[None]
            take = queues._take

            def counted(stage: str | None) -> Any:
                asks["n"] += stage is None
                return take(stage)

            queues._take = counted  # type: ignore[method-assign]
            # the first is done: its slot is kept for detail's next request, which comes from Redis
            f.middleware.process_response(first, None)  # type: ignore[arg-type]
            f.active.discard(first)
            second = await f.next_request()
            assert second.url.endswith("/detail/1")
            f.send(second)
            await until(lambda: queues._known_empty(None))  # the spider's own key: found empty
            asked = asks["n"]
            wakes = {"n": 0}
            looks = {"n": 0}
            wake, look = queues.wake, queues.look
            assert look is not None

            def counted_wake() -> None:
                wakes["n"] += 1
                wake()

            async def counted_look() -> None:
                looks["n"] += 1
                await look()

            queues.wake, queues.look = counted_wake, counted_look
            # the engine asks again and again: the empty key is not popped meanwhile, and the looks
            # that find it empty wake nothing
            for _ in range(50):
                assert scheduler.next_request() is None
                await asyncio.sleep(0.01)
            await until(lambda: looks["n"] >= 2)
            assert (asks["n"], wakes["n"]) == (asked, 0)
            # another process pushes into it: a look finds it, the engine is woken and takes it
            theirs = request(None, 7)
            other = type(base)(
                server=redis_client, spider=base.spider, key=base.key, serializer=base.serializer
            )
            other.push(theirs)
            found = await f.next_request()
            assert found.url == theirs.url and wakes["n"] >= 1
            # this process's own push: popped at once, with no look first
            assert scheduler.next_request() is None  # a fetch finds the key empty again
            await until(lambda: queues._known_empty(None))
            free = request(None, 1)
            scheduler.enqueue_request(free)
            await until(lambda: not queues.thread.jobs)  # type: ignore[union-attr]
            assert queues.may_have(None)
            again = await f.next_request()
            assert again.url == free.url
            for r in list(f.slots.holding()):
                f.middleware.process_response(r, None)  # type: ignore[arg-type]

    asyncio.run(scenario())


def test_over_scrapy_redis_the_request_fetched_ahead_goes_back_and_refused_ones_are_dropped(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Over scrapy-redis's scheduler with an engine, its calls run in the queue thread: a request
    its dupefilter refuses gets Scrapy's request_dropped signal (enqueue_request answered True), and
    the request fetched ahead of the engine, never taken, is back in its place in Redis when the
    spider closes (SCHEDULER_PERSIST): the queue is as it was."""
    settings = {
        "REDISLOCK_SCHEDULER_INNER": "scrapy_redis.scheduler.Scheduler",
        "DUPEFILTER_CLASS": "scrapy_redis.dupefilter.RFPDupeFilter",
        "REDIS_URL": redis_url,
        "SCHEDULER_PERSIST": True,
    }
    key = "unit:requests:detail"
    before: list[bytes] = []

    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, **settings) as f:
            scheduler = f.scheduler
            assert scheduler is not None and scheduler.shared is not None
            shared = scheduler.shared
            assert shared.thread is not None
            dropped: list[Request] = []

            def on_dropped(request: Request, spider: Any) -> None:
                dropped.append(request)

            f.crawler.signals.connect(on_dropped, signal=signals.request_dropped)
            twice = Request("http://127.0.0.1:9/detail/twice", meta={"redislock_stage": "detail"})
            assert scheduler.enqueue_request(twice)
            assert scheduler.enqueue_request(twice.copy())  # seen by scrapy-redis's dupefilter
            for n in range(3):
                scheduler.enqueue_request(request("detail", n))
            await until(lambda: not shared.thread.jobs)
            assert dropped and dropped[0].url == twice.url and len(dropped) == 1
            assert redis_client.zcard(key) == 4
            before.extend(redis_client.zrange(key, 0, -1))
            assert scheduler.next_request() is None  # no slot yet: the stage's wait starts
            # its slot kept, and the fetch that call started (of the spider's own key, empty) over:
            # one fetch at a time, and no engine here to ask again when it ends
            await until(lambda: f.slots.kept.count("detail") == 1 and not shared.thread.jobs)
            assert scheduler.next_request() is None  # fetched in the queue thread
            await until(lambda: shared.ahead is not None)
            assert redis_client.zcard(key) == 3

    asyncio.run(scenario())
    assert redis_client.zrange(key, 0, -1) == before
    redis_client.delete(key, "unit:requests", "unit:dupefilter")


def through(proxy: LatencyProxy, redis_url: str, params: dict[str, Any]) -> dict[str, Any]:
    """StageScheduler over scrapy-redis's scheduler and dupefilter, whose client (``params``: its
    REDIS_PARAMS) reaches Redis through ``proxy``."""
    port = urlsplit(redis_url).port
    return {
        "REDISLOCK_SCHEDULER_INNER": "scrapy_redis.scheduler.Scheduler",
        "DUPEFILTER_CLASS": "scrapy_redis.dupefilter.RFPDupeFilter",
        "REDIS_URL": redis_url.replace(f":{port}", f":{proxy.port}", 1),
        "REDIS_PARAMS": params,
        "SCHEDULER_PERSIST": False,
    }


@pytest.mark.faults
def test_a_request_held_while_its_dupefilter_reply_was_lost_is_queued_not_dropped(
    redis_url: str, redis_client: redis.Redis, redis_proxy: Callable[[], LatencyProxy]
) -> None:
    """Over scrapy-redis's scheduler, its client behind a network that carries commands but loses
    the replies (``blackhole("down")``): Redis records the request's fingerprint, the dupefilter's
    SADD times out, and the request is held in memory. Once Redis answers it is scheduled again and
    the dupefilter reads it as seen (its own first try): it is queued all the same, counted, and
    comes out. It was dropped without a word: no stat, no request_dropped, a clean finish."""
    proxy = redis_proxy()
    # one try: redis-py's own retries would each wait for a reply that never comes; a timeout no
    # busy machine's reply reaches once the network is back
    settings = through(proxy, redis_url, {"socket_timeout": 2.0, "retry": Retry(NoBackoff(), 0)})

    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, **settings) as f:
            scheduler = f.scheduler
            assert scheduler is not None and scheduler.shared is not None
            shared, stats = scheduler.shared, f.crawler.stats
            assert shared.thread is not None
            dupefilter = scheduler.inner.df
            dupefilter.server.ping()  # its connection made before the replies are lost
            proxy.blackhole("down")
            lost_reply = Request("http://127.0.0.1:9/detail/7", meta={"redislock_stage": "detail"})
            assert scheduler.enqueue_request(lost_reply)
            fingerprint = dupefilter.request_fingerprint(lost_reply)
            await until(lambda: redis_client.sismember("unit:dupefilter", fingerprint))  # ran
            await until(lambda: stats.get_value("redislock/queue_held") == 1, timeout=10)
            proxy.heal()
            taken = await f.next_request()
            assert taken.url == lost_reply.url
            assert stats.get_value("redislock/queue_held_seen") == 1
            assert not shared.in_memory and redis_client.zcard("unit:requests:detail") == 0

    asyncio.run(scenario())


@pytest.mark.faults
def test_redis_pys_own_retry_of_a_lost_dupefilter_reply_drops_nothing(
    redis_url: str, redis_client: redis.Redis, redis_proxy: Callable[[], LatencyProxy]
) -> None:
    """scrapy-redis's dupefilter with redis-py's own retry (scrapy-redis's REDIS_PARAMS retry on a
    timeout; here after a 3 s back-off): the SADD runs, its reply is lost, the try times out, and
    the network is back before the retry. The retry read the fingerprint the first try recorded as
    seen, and the request was dropped as a duplicate without a word. StageScheduler gives the
    dupefilter's client one try: the lost reply is an error, the request is held, and it comes
    out once Redis answers."""
    proxy = redis_proxy()
    # scrapy-redis's retry_on_timeout, as redis-py 6 on spells it
    params = {
        "socket_timeout": 2.0,
        "retry_on_error": [redis.exceptions.TimeoutError],
        "retry": Retry(ConstantBackoff(3.0), 1),
    }
    settings = through(proxy, redis_url, params)

    def sadd_connections() -> set[str]:
        """Connections whose last command was a SADD (a dupefilter's)."""
        return {c["id"] for c in redis_client.client_list() if c.get("cmd") == "sadd"}

    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, **settings) as f:
            scheduler = f.scheduler
            assert scheduler is not None and scheduler.shared is not None
            stats, dupefilter = f.crawler.stats, scheduler.inner.df
            dropped: list[Request] = []

            def on_dropped(request: Request) -> None:  # held here: receivers are weak references
                dropped.append(request)

            f.crawler.signals.connect(on_dropped, signal=signals.request_dropped)
            dupefilter.server.ping()  # its connection made before the replies are lost
            others = sadd_connections()  # earlier tests' dupefilters on this Redis
            proxy.blackhole("down")
            lost_reply = Request("http://127.0.0.1:9/detail/8", meta={"redislock_stage": "detail"})
            assert scheduler.enqueue_request(lost_reply)
            fingerprint = dupefilter.request_fingerprint(lost_reply)
            # ran (after any queue call the blackhole caught: 2 s, 3 s, then 2 s more)
            await until(lambda: redis_client.sismember("unit:dupefilter", fingerprint), 30)
            waiting = sadd_connections() - others  # its connection, waiting 2 s for the reply
            await until(lambda: not sadd_connections() & waiting)  # the try timed out, closed
            proxy.heal()  # before redis-py's retry, 3 s later
            await until(lambda: stats.get_value("redislock/queue_held") == 1 or dropped, 10)
            assert not dropped
            taken = await f.next_request()
            assert taken.url == lost_reply.url
            assert stats.get_value("redislock/queue_held_seen") == 1

    asyncio.run(scenario())


def test_the_dupefilter_client_gets_its_own_retries_back_for_scrapy_redis_close() -> None:
    """A client as scrapy-redis makes it (from_url, its default REDIS_PARAMS' retry_on_timeout; no
    Retry of its own: each connection makes one retry on a timeout): one try while the crawl runs,
    its one retry back for the close, whose DELETE of the dupefilter may be sent again. No I/O."""
    client = redis.Redis.from_url("redis://127.0.0.1:9/0", socket_timeout=2, retry_on_timeout=True)

    def retries(of: redis.Redis = client) -> int:
        """What a connection made now tries again (made, never connected; redis-py 5's Retry has
        no get_retries())."""
        return int(of.connection_pool.make_connection().retry._retries)

    try:
        assert retries() == 1
        every_try = _one_try(SimpleNamespace(server=client))
        assert retries() == 0
        every_try()
        assert retries() == 1
        plain = redis.Redis.from_url("redis://127.0.0.1:9/0")  # told to retry on nothing
        _one_try(SimpleNamespace(server=plain))()
        assert retries(plain) == 0
        plain.close()
    finally:
        client.close()


@pytest.mark.parametrize("stages", [{"detail": None}, {"comments": 1}], ids=["uncapped", "gone"])
def test_a_jobdir_sub_queue_of_a_stage_no_longer_capped_lets_its_requests_go(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, stages: dict[str, int | None]
) -> None:
    """A crawl paused with requests of the capped stage ``detail`` in its JOBDIR, resumed with
    ``detail`` uncapped (or no longer configured): the sub-queue kept for it lets its requests go
    to the middleware (which lets them through, or fails them naming the stage). They waited for a
    slot that never comes, and the crawl never finished."""
    jobdir = str(tmp_path / "job")

    async def paused() -> None:
        async with front(redis_url, {"detail": 1}, JOBDIR=jobdir) as f:
            assert f.scheduler is not None
            for n in range(3):
                f.scheduler.enqueue_request(request("detail", n))

    async def resumed() -> None:
        async with front(redis_url, stages, JOBDIR=jobdir) as f:
            scheduler = f.scheduler
            assert scheduler is not None and len(scheduler) == 3
            taken = [await f.next_request() for _ in range(3)]
            assert sorted(r.url for r in taken) == sorted(
                request("detail", n).url for n in range(3)
            )
            assert not scheduler.has_pending_requests()

    asyncio.run(paused())
    asyncio.run(resumed())


def test_over_scrapy_redis_a_request_fetched_ahead_keeps_a_wait_open_for_its_stage(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Over scrapy-redis, a request fetched ahead whose stage has no slot in hand waits for one
    here, and no other request is fetched meanwhile. Its stage's queue in Redis may have been found
    empty on the way (the request came from the spider's own key, pushed there by a process where
    the stage is not capped): the stage's line still keeps a wait in Redis open for it. It once
    counted only the stage's queue, opened none, and the process fetched nothing until the next
    renewal round gave the request back."""
    settings = {
        "REDISLOCK_SCHEDULER_INNER": "scrapy_redis.scheduler.Scheduler",
        "REDIS_URL": redis_url,
        "SCHEDULER_PERSIST": False,
    }

    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, **settings) as f:
            scheduler = f.scheduler
            assert scheduler is not None and scheduler.shared is not None
            shared = scheduler.shared

            def found_empty() -> bool:
                assert scheduler.next_request() is None  # its slot comes, a fetch finds it empty
                return shared._fetch is None and shared._known_empty("detail")

            await until(found_empty)
            # the slot kept for it goes back: the stage's queue is empty
            await until(
                lambda: not f.slots.kept.count("detail") and not held(redis_client, "detail")
            )
            blocker = await f.locks.acquire("detail", None)  # another process's, say
            shared.ahead = (
                "detail",
                Request("http://127.0.0.1:9/detail/ahead", meta={"redislock_stage": "detail"}),
                False,
            )
            assert scheduler.next_request() is None  # its stage has no slot: it waits
            assert f.slots.lines.asking("detail") == 1
            await f.locks.release(blocker)
            taken = await f.next_request()
            assert taken.url.endswith("/detail/ahead")
            await f.send(taken)
            f.middleware.process_response(taken, None)  # type: ignore[arg-type]

    asyncio.run(scenario())
