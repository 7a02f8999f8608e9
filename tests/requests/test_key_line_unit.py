"""KeyLine in-process (scrapy.utils.test.get_crawler, a real Redis behind a proxy, no crawl): what
happens to a request held back for its key slot when the engine closes. The real crawls are in
test_key_line.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from scrapy import Request
from scrapy.downloadermiddlewares.httpcache import HttpCacheMiddleware
from scrapy.http import HtmlResponse

from scrapy_redislock.crawl.engine import downloader_middlewares
from scrapy_redislock.errors import AcquireTimeout
from scrapy_redislock.requests.keyline import KeyLine
from scrapy_redislock.requests.stagequeue import split_queues
from testing.crawlproc import leftover
from testing.inprocess import Front, front, held, request
from testing.netproxy import LatencyProxy
from testing.waiting import until

pytestmark = pytest.mark.integration


def test_with_only_keys_capped_the_renewal_rounds_run_the_schedulers_tick(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """No stage is capped, so the stages' registry has nothing to renew: the request front's renewal
    rounds still run StageScheduler's tick, which stands the key line down once the engine closes
    (the tick was a hook of the stages' registry, which never joined the loop then)."""

    async def scenario() -> None:
        async with one_key(redis_url, REDISLOCK_KEY_LIMIT=1) as (f, line):
            scheduler = f.scheduler
            assert scheduler is not None and not f.locks.locks  # no stage capped
            f.crawler.engine.start_time = time.time()  # type: ignore[union-attr]  # it stopped: closing
            await until(lambda: scheduler.closing and line.closed)
        assert leftover(redis_client) == 0

    asyncio.run(scenario())


def test_a_renewal_round_while_the_engine_starts_does_not_stand_the_scheduler_down(
    redis_url: str,
) -> None:
    """Scrapy's engine sets ``start_time``, then awaits the engine_started handlers (an extension's
    may take long), and sets ``running`` only after them. A renewal round in between once took the
    engine for a closing one and stood StageScheduler and its key line down for good: no slot was
    wanted or kept again, and the queued requests never left (the crawl hung)."""

    async def scenario() -> None:
        async with one_key(redis_url, {"detail": 1}, REDISLOCK_KEY_LIMIT=1) as (f, line):
            scheduler = f.scheduler
            engine = f.crawler.engine
            assert scheduler is not None and engine is not None and not engine.running
            assert engine._starting is False  # the attribute Scrapy's start sets: still its name
            # as ExecutionEngine.start_async has it while engine_started's handlers run
            engine.start_time, engine._starting = time.time(), True
            scheduler.tick()
            assert not scheduler.closing and not line.closed
            capped = request("detail", 0)
            scheduler.enqueue_request(capped)
            assert await f.next_request() is capped  # it has its stage's and key's slots
            await f.send(capped)
            f.middleware.process_response(capped, None)  # type: ignore[arg-type]

    asyncio.run(scenario())


def test_a_request_held_back_for_a_take_when_the_engine_closes_stays_queued(
    redis_proxy: Callable[[], LatencyProxy],
) -> None:
    """Redis does not answer the take of a request's key slot (out of reach) when the engine
    closes: the renewal tick's stand-down cancels the take, and the request goes back into its
    key's queue (JOBDIR keeps it), not lost (it once was: 1 request queued, 0 after)."""
    proxy = redis_proxy()

    async def scenario() -> None:
        async with front(
            proxy.url,
            {"detail": None},
            REDISLOCK_STAGE_KEY="domain",
            REDISLOCK_KEY_LIMIT=1,
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None and scheduler.keyline is not None
            line = scheduler.keyline
            held_back = request(None, 0)
            scheduler.enqueue_request(held_back)
            assert len(scheduler) == 1
            proxy.blackhole()  # the take goes nowhere and no answer comes
            assert scheduler.next_request() is None  # held back for one take in Redis
            assert list(line.looking) == [held_back]
            await until(lambda: bool(line.locks._taking))  # the take is under way
            f.crawler.engine.start_time = time.time()  # type: ignore[union-attr]  # it stopped: closing
            scheduler.tick()  # the engine closes: the line stands down
            await until(lambda: not line.tasks)
            # back in its key's queue (once: 0, the take's end forgot it), where close() leaves it
            assert scheduler.has_pending_requests() and len(scheduler) == 1, len(scheduler)
            assert not line.looking and not line.ready
            proxy.heal()

    asyncio.run(scenario())


def test_a_request_of_a_capped_stage_ready_when_the_scheduler_closes_goes_back_to_its_stages_queue(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A request of a capped stage got its key's slot in the scheduler and waits there for the
    engine's next ask when the scheduler closes: it goes back to its own sub-queue (its stage and
    key: JOBDIR keeps it there, and it waits for its stage again on resume), not to the sub-queue of
    requests of no capped stage (it once did: its route was forgotten when it got its slots)."""

    async def scenario() -> None:
        async with one_key(redis_url, {"detail": 1}, REDISLOCK_KEY_LIMIT=1) as (f, line):
            scheduler = f.scheduler
            assert scheduler is not None
            capped = request("detail", 0)
            scheduler.enqueue_request(capped)
            route = scheduler.admission.route(capped)  # type: ignore[union-attr]
            assert route == ("detail", "127.0.0.1")
            # the stage's slot comes (kept for it), then it is held back for its key's take
            await until(lambda: scheduler.next_request() is None and bool(line.looking))
            await until(lambda: bool(line.ready))  # its key's slot too: the engine's next
            assert list(line.ready) == [capped]
            line.close()
            queues = split_queues(scheduler.inner)
            assert sum(q.count_route(route) for q in queues) == 1
            assert sum(q.count_route((None, "127.0.0.1")) for q in queues) == 0
            await until(lambda: not held(redis_client, "detail"))  # its slots went back

    asyncio.run(scenario())


def test_a_timeout_kept_for_a_key_with_nothing_queued_fails_no_later_request(
    redis_url: str, tmp_path: Path
) -> None:
    """A wait for a key ran out (REDISLOCK_WAIT_TIMEOUT 0.3 s) and its AcquireTimeout is kept for the
    key's next request; the one queued request then leaves without it (a fresh cache hit needs no
    slot). The error goes at the next renewal tick, as an unused slot does: the key's next request,
    queued once the key is free, goes with a slot (it once got the stale error: failed, unretried,
    without a wait of its own)."""

    async def scenario() -> None:
        async with front(
            redis_url,
            {"detail": None},
            REDISLOCK_STAGE_KEY="domain",
            REDISLOCK_KEY_LIMIT=1,
            REDISLOCK_WAIT_TIMEOUT=0.3,
            HTTPCACHE_ENABLED=True,
            HTTPCACHE_DIR=str(tmp_path / "cache"),
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None and scheduler.keyline is not None
            line = scheduler.keyline
            key = "127.0.0.1"
            blocker = await line.locks.acquire(key, None)  # the key's only slot, held
            first = request(None, 0)
            scheduler.enqueue_request(first)
            assert scheduler.next_request() is None  # a take, refused: a wait starts
            await until(lambda: bool(line.kept.count(key)), timeout=10)  # ran out: its error kept
            assert isinstance(line.kept.outcomes(key)[0], AcquireTimeout)
            cache = next(
                mw
                for mw in downloader_middlewares(f.crawler)
                if isinstance(mw, HttpCacheMiddleware)
            )
            cache.storage.open_spider(f.crawler.spider)  # as the engine's spider_opened would
            cache.storage.store_response(
                f.crawler.spider, first, HtmlResponse(first.url, body=b"cached", request=first)
            )
            assert scheduler.next_request() is first  # a fresh cache hit: goes without a slot
            assert not line.slots.held(first)
            # the keys' lines' upkeep in a renewal round: nothing of the key queued, what is kept
            # for it goes
            line.throttle.lines.upkeep()
            await line.locks.release(blocker)
            second = request(None, 1)
            scheduler.enqueue_request(second)
            got = await f.next_request()
            assert got is second
            assert [p.name for p in line.throttle.held_scopes(second)] == [f"key:{key}"]

    asyncio.run(scenario())


def light_grants(client: redis.Redis) -> int:
    """Grants held on the light path of the keys' locks (lock/light.py: one zset member each)."""
    return sum(int(client.zcard(key)) for key in client.scan_iter("redislock:*:light"))


def test_a_request_back_in_the_scheduler_with_its_key_slot_does_not_leak_it(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A request left StageScheduler with its key slot, and a middleware before StageLockMiddleware
    sent it straight back (it returned the request itself: Scrapy schedules it again); it leaves
    again with a new slot. The slot it came back with goes back to Redis (it once was dropped
    unreleased and renewed until the spider closed: 1 of the key's 2 slots held by nobody)."""

    async def scenario() -> None:
        async with front(
            redis_url, {"detail": None}, REDISLOCK_STAGE_KEY="domain", REDISLOCK_KEY_LIMIT=2
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None and scheduler.keyline is not None
            line = scheduler.keyline
            again = request(None, 0)
            scheduler.enqueue_request(again)
            assert await f.next_request() is again  # with its key slot
            [first] = line.throttle.held_scopes(again)
            scheduler.enqueue_request(again)  # back, unseen by the middleware
            assert await f.next_request() is again  # with a new slot
            [second] = line.throttle.held_scopes(again)
            assert second is not first
            await f.send(again)
            f.middleware.process_response(again, None)  # type: ignore[arg-type]
            await until(lambda: not line.locks.releasing)  # the releases sent are done
            # at once, not at the end of a lease (a key's grants: its light path's zset members)
            assert first.released and second.released
            assert light_grants(redis_client) == 0
            assert leftover(redis_client) == 0

    asyncio.run(scenario())


def test_a_request_of_a_capped_stage_counts_in_its_keys_load(redis_url: str) -> None:
    """A request of a capped stage leaves the scheduler with its stage's slot and its key's, both
    got there. A request of no stage with the same key (limit 1 here) stays queued meanwhile, in its
    key's sub-queue, taking nothing, and goes once the first is done."""

    async def scenario() -> None:
        async with front(
            redis_url, {"detail": 1}, REDISLOCK_STAGE_KEY="domain", REDISLOCK_KEY_LIMIT=1
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None and scheduler.keyline is not None
            line = scheduler.keyline
            capped, free = request("detail", 0), request(None, 0)  # the same domain
            scheduler.enqueue_request(capped)
            assert await f.next_request() is capped
            assert f.slots.permit_of(capped) is not None
            await f.send(capped)
            scheduler.enqueue_request(free)
            assert scheduler.next_request() is None
            assert not line.looking and len(scheduler) == 1  # queued, no take started
            f.middleware.process_response(capped, None)  # type: ignore[arg-type]
            f.active.discard(capped)
            assert await f.next_request() is free
            await f.send(free)
            f.middleware.process_response(free, None)  # type: ignore[arg-type]

    asyncio.run(scenario())


def test_a_stage_slot_its_requests_cannot_use_for_their_key_is_not_chased(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Requests of one capped stage and one key (limit 1): the first leaves with both slots; the
    others cannot go while the first holds the key, so the stage's slots got for them go back to
    Redis and no new wait for the stage opens until the key is free again (a wait for queued
    requests is opened only when a request of them could go but for its stage's slot)."""

    async def scenario() -> None:
        async with front(
            redis_url,
            {"detail": 8},
            REDISLOCK_STAGE_KEY="domain",
            REDISLOCK_KEY_LIMIT=1,
            REDISLOCK_WAITERS_PER_STAGE=2,
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None
            first, second, *rest = (request("detail", n) for n in range(5))  # the same domain
            for r in (first, second, *rest):
                scheduler.enqueue_request(r)
            assert await f.next_request() is first
            await f.send(first)
            line = f.slots.lines.lines.get("detail")

            def settled() -> bool:
                assert scheduler.next_request() is None  # the engine asks again and again
                return (line is None or not line.asks) and not f.slots.kept.count("detail")

            await until(settled)
            await until(lambda: not f.locks.releasing)
            assert len(held(redis_client, "detail")) == 1  # the first request's only
            f.middleware.process_response(first, None)  # type: ignore[arg-type]
            f.active.discard(first)
            for r in (second, *rest):
                assert await f.next_request() is r  # the key is free: the stage asks again
                await f.send(r)
                f.middleware.process_response(r, None)  # type: ignore[arg-type]
                f.active.discard(r)

    asyncio.run(scenario())


def grants_of(client: redis.Redis, name: str) -> int:
    """Grants held on the light path of the lock of key or scope ``name``."""
    return sum(
        int(client.zcard(key)) for key in client.scan_iter(f"redislock:{{key:{name}}}*:light")
    )


@pytest.mark.parametrize("now", [["proxy:b"], []], ids=["another", "none"])
def test_a_scope_slot_handed_for_a_scope_the_request_no_longer_has_goes_back(
    redis_url: str, redis_client: redis.Redis, now: list[str]
) -> None:
    """StageScheduler takes the slot of the scope a request has in the scheduler (proxy:a); a
    middleware before StageLockMiddleware then moves it to proxy:b (as a proxy rotator does), or
    takes it away. The request goes with a slot of proxy:b only, or with none: the handed slot of
    proxy:a goes back to Redis at once (it once stayed held with the request, over a scope it no
    longer used, until its download ended, counted against proxy:a's cap and bounding the download
    by its lease: with another scope since a review of 2026-11-29, with none since 2026-11-30)."""

    async def scenario() -> None:
        async with front(
            redis_url, {"detail": None}, REDISLOCK_SCOPES={"proxy:*": {"limit": 1}}
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None and scheduler.keyline is not None
            throttle = scheduler.keyline.throttle
            moved = request(None, 0)
            moved.meta["redislock_scopes"] = ["proxy:a"]
            scheduler.enqueue_request(moved)
            assert await f.next_request() is moved
            assert [p.name for p in throttle.held_scopes(moved)] == ["key:proxy:a"]
            assert grants_of(redis_client, "proxy:a") == 1
            moved.meta["redislock_scopes"] = now  # a middleware before ours
            await f.send(moved)
            assert [p.name for p in throttle.held_scopes(moved)] == [f"key:{n}" for n in now]
            await until(lambda: not throttle.locks.releasing)
            assert grants_of(redis_client, "proxy:a") == 0
            assert grants_of(redis_client, "proxy:b") == len(now)
            scheduler.keyline.new_pass()
            load = scheduler.keyline.load()
            # this process counts it where it is
            assert (load["proxy:a"], load["proxy:b"]) == (0, len(now))
            f.middleware.process_response(moved, None)  # type: ignore[arg-type]
            await until(lambda: not throttle.locks.releasing)
        assert light_grants(redis_client) == 0
        assert leftover(redis_client) == 0

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def one_key(
    redis_url: str, stages: dict[str, int | None] | None = None, **settings: Any
) -> AsyncIterator[tuple[Front, KeyLine]]:
    """A front whose requests all have one key, 127.0.0.1 (``request(stage, n)``), with
    StageScheduler's key line; ``stages`` (default: ``detail``, not capped); a freed slot passes on
    for 30 s."""
    async with front(
        redis_url,
        stages or {"detail": None},
        REDISLOCK_STAGE_KEY="domain",
        REDISLOCK_LOCAL_REUSE=30,
        **settings,
    ) as f:
        assert f.scheduler is not None and f.scheduler.keyline is not None
        yield f, f.scheduler.keyline


def test_a_finished_requests_key_slot_is_kept_for_the_next_queued_request_of_its_key(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The local hand-off of a key's slot through StageScheduler, as a stage's: the key is at its
    limit (1) in this process, so its next request waits in the key's sub-queue; when the first is
    done its slot is kept for that request (no release, no new take: the same grant, counted as
    ``redislock/keys/reused``), which then leaves with it. Nothing is left in Redis after."""

    async def scenario() -> None:
        async with one_key(redis_url, REDISLOCK_KEY_LIMIT=1) as (f, line):
            scheduler = f.scheduler
            assert scheduler is not None
            first, second = request(None, 1), request(None, 2)  # the same domain
            scheduler.enqueue_request(first)
            assert await f.next_request() is first  # with its key slot, from a take
            [permit] = line.throttle.held_scopes(first)
            await f.send(first)
            scheduler.enqueue_request(second)
            assert scheduler.next_request() is None  # the key is at its limit here: queued
            assert line.queued("127.0.0.1") == 1
            f.middleware.process_response(first, None)  # type: ignore[arg-type]
            f.active.discard(first)
            assert line.kept.count("127.0.0.1") == 1 and not permit.released
            assert await f.next_request() is second
            assert line.throttle.held_scopes(second) == [permit]  # the same grant
            assert f.crawler.stats.get_value("redislock/keys/reused") == 1
            await f.send(second)
            f.middleware.process_response(second, None)  # type: ignore[arg-type]
            await until(lambda: not line.locks.releasing)
            assert permit.released and leftover(redis_client) == 0

    asyncio.run(scenario())


def test_a_light_key_slot_kept_for_a_queued_request_still_waits_out_a_pause(
    redis_url: str,
    redis_client: redis.Redis,  # a clean database: no key's stream left by an earlier test
) -> None:
    """A light key slot's take checked a Retry-After pause for its own request only: kept for the
    key's next queued request while a pause is on (set after the take), it does not let that
    request start before the pause ends (it once started at once)."""

    async def scenario() -> None:
        async with one_key(redis_url, REDISLOCK_KEY_LIMIT=1, REDISLOCK_RETRY_AFTER=True) as (
            f,
            line,
        ):
            scheduler = f.scheduler
            assert scheduler is not None
            adaptation = line.locks.adaptation
            assert adaptation is not None
            first, second = request(None, 1), request(None, 2)
            scheduler.enqueue_request(first)
            assert await f.next_request() is first
            [permit] = line.throttle.held_scopes(first)
            assert permit.light
            await f.send(first)
            scheduler.enqueue_request(second)
            assert scheduler.next_request() is None  # the key is at its limit here: queued
            paused_at = time.monotonic()  # before: the pause ends 1 s after it at the soonest
            adaptation.pause("key:127.0.0.1", 1.0)  # a site's Retry-After
            await until(lambda: not adaptation.pausing)
            f.middleware.process_response(first, None)  # type: ignore[arg-type]
            f.active.discard(first)
            assert await f.next_request() is second
            assert line.throttle.held_scopes(second) == [permit]  # kept for it
            await f.send(second)  # through the middleware: the pause is checked there
            assert time.monotonic() - paused_at >= 0.9
            assert f.crawler.stats.get_value("redislock/retry_after/waits") == 1
            f.middleware.process_response(second, None)  # type: ignore[arg-type]

    asyncio.run(scenario())


def test_a_key_wait_that_runs_out_after_its_queue_was_served_locally_leaves_no_error(
    redis_url: str,
    redis_client: redis.Redis,  # a clean database: no key's stream left by an earlier test
) -> None:
    """A key's wait in the scheduler started for a queued request, which then left with a slot a
    finished request of the process freed (kept for it). The wait, no longer needed, runs out of
    REDISLOCK_WAIT_TIMEOUT: its error is forgotten, not kept to fail the key's next request (it
    once was, until the next renewal tick)."""

    async def scenario() -> None:
        async with one_key(redis_url, REDISLOCK_KEY_LIMIT=2, REDISLOCK_WAIT_TIMEOUT=0.5) as (
            f,
            line,
        ):
            scheduler = f.scheduler
            assert scheduler is not None
            key = "127.0.0.1"
            blocker = await line.locks.acquire(key, None)  # one of the key's 2 slots, held
            first, second = request(None, 1), request(None, 2)
            scheduler.enqueue_request(first)
            assert await f.next_request() is first  # the other slot
            await f.send(first)
            scheduler.enqueue_request(second)
            assert scheduler.next_request() is None  # a take, refused: a wait starts
            await until(lambda: line.throttle.lines.asking(key) and line.queued(key) == 1)
            f.middleware.process_response(first, None)  # type: ignore[arg-type]
            f.active.discard(first)
            assert await f.next_request() is second  # with first's slot, kept for it
            # the wait runs out (an error it kept would stay until the next renewal tick)
            await until(
                lambda: not line.throttle.lines.asking(key) or line.kept.count(key) > 0, timeout=10
            )
            assert line.kept.count(key) == 0
            await until(lambda: not line.throttle.lines.asking(key))
            f.middleware.process_response(second, None)  # type: ignore[arg-type]
            await line.locks.release(blocker)

    asyncio.run(scenario())


def test_a_request_waiting_with_its_stage_slot_gets_a_key_slot_freed_here(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A request of a capped stage whose key another process holds waits in the scheduler, with its
    stage's slot, in this process's line for the key, the line requests waiting in the middleware
    use: a slot of the key freed by a finished request here passes straight to it (the same grant,
    no release, counted as ``redislock/keys/reused``), as it would to a request waiting in the
    middleware. Nothing is left in Redis after."""

    async def scenario() -> None:
        async with front(
            redis_url,
            {"detail": 2},
            REDISLOCK_STAGE_KEY="domain",
            REDISLOCK_KEY_LIMIT=2,
            REDISLOCK_LOCAL_REUSE=30,
            REDISLOCK_TTL=20,  # the local hand-off's bound, half of it, longer than a loaded test
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None and scheduler.keyline is not None
            line = scheduler.keyline
            key = "127.0.0.1"
            blocker = await line.locks.acquire(key, None)  # another process's, say
            first, second = request("detail", 1), request("detail", 2)  # the same domain
            scheduler.enqueue_request(first)
            assert await f.next_request() is first  # the key's other slot
            [permit] = line.throttle.held_scopes(first)
            await f.send(first)
            scheduler.enqueue_request(second)

            def waits_with_its_stage_slot() -> bool:
                assert scheduler.next_request() is None
                return second in line.waiting

            await until(waits_with_its_stage_slot)
            assert line.throttle.lines.waiting(key) == 1
            f.middleware.process_response(first, None)  # type: ignore[arg-type]
            f.active.discard(first)
            assert not permit.released
            assert await f.next_request() is second
            assert line.throttle.held_scopes(second) == [permit]  # the same grant
            assert f.crawler.stats.get_value("redislock/keys/reused") == 1
            await f.send(second)
            f.middleware.process_response(second, None)  # type: ignore[arg-type]
            await line.locks.release(blocker)
            await until(lambda: not line.locks.releasing)
            assert permit.released

    asyncio.run(scenario())


def test_a_request_waiting_in_the_middleware_does_not_queue_behind_the_schedulers_waits(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """CONCURRENT_REQUESTS 2: the scheduler's waits for the queued requests of two busy keys take
    both places this process gives waits in Redis at once (each blocks a connection). A request
    waiting in the middleware for a third key (a media download, which bypasses the scheduler)
    still waits in Redis at once, not behind them: it may hold slots those waits wait for."""

    async def scenario() -> None:
        async with front(
            redis_url,
            {"detail": None},
            REDISLOCK_STAGE_KEY="domain",
            REDISLOCK_KEY_LIMIT=1,
            CONCURRENT_REQUESTS=2,
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None and scheduler.keyline is not None
            line = scheduler.keyline
            hosts = ("a.test", "b.test", "c.test")
            blockers = [await line.locks.acquire(host, None) for host in hosts]  # others' slots
            queued = [Request(f"http://{host}:9/", dont_filter=True) for host in hosts[:2]]
            for r in queued:
                scheduler.enqueue_request(r)

            def both_wait() -> bool:
                assert scheduler.next_request() is None
                return all(line.queued(host) == 1 for host in hosts[:2]) and all(
                    line.throttle.lines.asking(host) for host in hosts[:2]
                )

            await until(both_wait)
            media = Request("http://c.test:9/image.png", dont_filter=True)
            sent = f.send(media)  # not from the scheduler: it waits in the middleware
            await until(lambda: line.throttle.lines.waiting("c.test") == 1)
            await line.locks.release(blockers[2])
            await asyncio.wait_for(sent, 10)
            assert [p.name for p in line.throttle.held_scopes(media)] == ["key:c.test"]
            f.middleware.process_response(media, None)  # type: ignore[arg-type]
            f.active.discard(media)
            for blocker in blockers[:2]:
                await line.locks.release(blocker)
            for _ in queued:
                r = await f.next_request()
                await f.send(r)
                f.middleware.process_response(r, None)  # type: ignore[arg-type]
                f.active.discard(r)

    asyncio.run(scenario())


def test_a_key_wait_with_its_stage_slot_that_runs_out_fails_its_request(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A request of a capped stage waits in the scheduler, with its stage's slot, for its key,
    which another process holds; the wait runs out of REDISLOCK_WAIT_TIMEOUT: the request goes
    with AcquireTimeout, which the middleware raises (as a wait there would have), and its stage's
    slot goes back. (AcquireTimeout is an OSError, as every TimeoutError: it was once taken for a
    Redis error, and the request went back to its queue to wait again, with no end.)"""

    async def scenario() -> None:
        async with front(
            redis_url,
            {"detail": 2},
            REDISLOCK_STAGE_KEY="domain",
            REDISLOCK_KEY_LIMIT=1,
            REDISLOCK_WAIT_TIMEOUT=0.5,
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None and scheduler.keyline is not None
            line = scheduler.keyline
            blocker = await line.locks.acquire("127.0.0.1", None)  # another process's, say
            waiting = request("detail", 1)
            scheduler.enqueue_request(waiting)

            def waits_with_its_stage_slot() -> bool:
                assert scheduler.next_request() is None
                return waiting in line.waiting

            await until(waits_with_its_stage_slot)
            assert await f.next_request() is waiting
            with pytest.raises(AcquireTimeout):
                await f.send(waiting)
            assert f.crawler.stats.get_value("redislock/keys/127.0.0.1/timeouts") == 1
            assert held(redis_client, "detail") == []
            await line.locks.release(blocker)

    asyncio.run(scenario())


def test_a_light_key_slot_passed_to_a_request_waiting_with_its_stage_slot_waits_out_a_pause(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A request of a capped stage waits in the scheduler, with its stage's slot, for its key (one
    of its 2 slots held by another process, the other by a request here); a site's Retry-After
    pauses the key; the request holding the key's light slot finishes and passes it on to the
    waiting one. That slot's take checked a pause for the finished request only: the waiting
    request does not start before the pause ends (it once started at once)."""

    async def scenario() -> None:
        async with one_key(
            redis_url, {"detail": 2}, REDISLOCK_KEY_LIMIT=2, REDISLOCK_RETRY_AFTER=True
        ) as (f, line):
            scheduler = f.scheduler
            assert scheduler is not None
            adaptation = line.locks.adaptation
            assert adaptation is not None
            blocker = await line.locks.acquire("127.0.0.1", None)  # another process's, say
            first, second = request("detail", 1), request("detail", 2)
            scheduler.enqueue_request(first)
            assert await f.next_request() is first
            [permit] = line.throttle.held_scopes(first)
            assert permit.light
            await f.send(first)
            scheduler.enqueue_request(second)

            def waits_with_its_stage_slot() -> bool:
                assert scheduler.next_request() is None
                return second in line.waiting

            await until(waits_with_its_stage_slot)
            paused_at = time.monotonic()  # before: the pause ends 3 s after it at the soonest
            adaptation.pause("key:127.0.0.1", 3.0)  # a site's Retry-After
            await until(lambda: not adaptation.pausing)
            f.middleware.process_response(first, None)  # type: ignore[arg-type]
            f.active.discard(first)
            assert await f.next_request() is second
            assert line.throttle.held_scopes(second) == [permit]  # passed on to it
            await f.send(second)  # through the middleware: the pause is checked there
            assert time.monotonic() - paused_at >= 2.9
            assert f.crawler.stats.get_value("redislock/retry_after/waits") == 1
            f.middleware.process_response(second, None)  # type: ignore[arg-type]
            await line.locks.release(blocker)

    asyncio.run(scenario())


def test_a_take_once_the_keys_registry_closed_makes_no_grant(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The middleware closes the keys' registry before the stages' one: a request that gets its
    stage's slot in between then takes its key. That take answers None and makes no lock: it once
    made a light grant on the still open client, which nothing renewed or freed (a slot lost to
    every process for a TTL)."""

    async def scenario() -> None:
        async with one_key(redis_url, REDISLOCK_KEY_LIMIT=1) as (_, line):
            await line.locks.close()
            assert await line.locks.take("127.0.0.1") is None
            assert "127.0.0.1" not in line.locks.locks
            assert light_grants(redis_client) == 0

    asyncio.run(scenario())


def test_a_request_waiting_with_its_stage_slot_goes_back_when_its_keys_line_meets_a_pause(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A request of a capped stage waits in the scheduler, with its stage's slot, for its key
    (another process holds it); a site's Retry-After pauses the key, and a wait of the key's line
    meets the pause (a light take at its start: the next test) and tells the key line: the request
    goes back to its queue and its stage's slot back to Redis, rather than holding it through the
    pause (up to 600 s). Once the pause is over and the key free, it goes."""

    async def scenario() -> None:
        async with one_key(
            redis_url, {"detail": 2}, REDISLOCK_KEY_LIMIT=1, REDISLOCK_RETRY_AFTER=True
        ) as (f, line):
            scheduler = f.scheduler
            assert scheduler is not None
            adaptation = line.locks.adaptation
            assert adaptation is not None
            key = "127.0.0.1"
            blocker = await line.locks.acquire(key, None)  # another process's, say
            waiting = request("detail", 1)
            scheduler.enqueue_request(waiting)

            def waits_with_its_stage_slot() -> bool:
                assert scheduler.next_request() is None
                return waiting in line.waiting

            await until(waits_with_its_stage_slot)
            assert len(held(redis_client, "detail")) == 1
            adaptation.pause(f"key:{key}", 3.0)  # a site's Retry-After
            await until(lambda: not adaptation.pausing)
            on_pause = line.throttle.lines.on_pause
            assert on_pause is not None
            on_pause(key, 5.0)  # what a wait of the line that meets it says

            def back_with_no_stage_slot() -> bool:
                assert scheduler.next_request() is None
                return not line.waiting and not line.looking and not held(redis_client, "detail")

            await until(back_with_no_stage_slot)
            assert key in line.paused
            await line.locks.release(blocker)
            assert await f.next_request() is waiting
            await f.send(waiting)
            f.middleware.process_response(waiting, None)  # type: ignore[arg-type]

    asyncio.run(scenario())


def test_a_wait_that_meets_a_pause_tells_the_owner_and_sleeps_it_out_outside_the_bound(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A wait of the keys' line under the bound (one wait at once here) meets a Retry-After's
    pause of its key: the owner is told (the key line, which keeps the key's queued requests
    queued), and the wait sleeps the pause out without its place in the bound, so that other keys'
    waits go on meanwhile (it once slept holding it). After the pause it gets its slot."""

    async def scenario() -> None:
        async with one_key(redis_url, REDISLOCK_KEY_LIMIT=1, REDISLOCK_RETRY_AFTER=True) as (
            _,
            line,
        ):
            lines = line.throttle.lines
            lines.bound = asyncio.Semaphore(1)
            adaptation = line.locks.adaptation
            assert adaptation is not None
            paused_at = time.monotonic()  # before: the pause ends 3 s after it at the soonest
            adaptation.pause("key:127.0.0.1", 3.0)  # a site's Retry-After
            await until(lambda: not adaptation.pausing)
            wait = asyncio.ensure_future(lines._get("127.0.0.1", True))
            await until(lambda: "127.0.0.1" in line.paused)  # told
            assert not wait.done() and not lines.bound.locked()
            permit = await wait
            assert time.monotonic() - paused_at >= 2.9
            await line.locks.release(permit)

    asyncio.run(scenario())


def test_with_no_key_lock_yet_the_renewal_rounds_are_still_a_third_of_the_ttl(
    redis_url: str,
) -> None:
    """With REDISLOCK_TTL under 3 s and no key's lock made yet, the keys' registry still asks for
    rounds a third of the TTL apart: a key's slot taken just after a round is renewed within its
    lease (the rounds were 1 s apart until a first key's lock existed)."""

    async def scenario() -> None:
        async with one_key(redis_url, REDISLOCK_KEY_LIMIT=1, REDISLOCK_TTL=1.5) as (f, line):
            assert not line.locks.locks
            assert line.locks.renew_interval == pytest.approx(0.5)
            assert f.slots.renew_interval == pytest.approx(0.5)

    asyncio.run(scenario())


def test_a_pause_past_the_waits_timeout_is_told_and_runs_the_timeout_out(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A wait of the keys' line meets a Retry-After's pause longer than what is left of its
    REDISLOCK_WAIT_TIMEOUT: the key line is told (its queued requests stay queued: no error is kept
    to fail them), and the wait ends with AcquireTimeout when its timeout runs out, not at once (a
    wait opened again at once met the pause again, as fast as Redis answered)."""

    async def scenario() -> None:
        async with one_key(
            redis_url, REDISLOCK_KEY_LIMIT=1, REDISLOCK_RETRY_AFTER=True, REDISLOCK_WAIT_TIMEOUT=0.5
        ) as (_, line):
            lines = line.throttle.lines
            adaptation = line.locks.adaptation
            assert adaptation is not None
            adaptation.pause("key:127.0.0.1", 30.0)  # a site's Retry-After
            await until(lambda: not adaptation.pausing)
            started = time.monotonic()
            with pytest.raises(AcquireTimeout):
                await lines._get("127.0.0.1", True)
            assert time.monotonic() - started >= 0.4
            assert "127.0.0.1" in line.paused  # told first

    asyncio.run(scenario())


def test_a_request_put_back_for_its_key_counts_as_queued_again(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A request whose key's take another process's slot refused goes back into its key's
    sub-queue, and leaves it again once the slot is free: Scrapy's ``scheduler/enqueued`` counts
    the second time it is queued as its ``scheduler/dequeued`` counts the second time it leaves,
    so that enqueued less dequeued is what is queued (the two were 1 and 2)."""

    async def scenario() -> None:
        async with one_key(redis_url, REDISLOCK_KEY_LIMIT=1) as (f, line):
            scheduler = f.scheduler
            assert scheduler is not None
            stats = f.crawler.stats
            blocker = await line.locks.acquire("127.0.0.1", None)  # another process's, say
            waiting = request(None, 1)
            scheduler.enqueue_request(waiting)

            def put_back() -> bool:
                assert scheduler.next_request() is None
                return line.queued("127.0.0.1") == 1

            await until(put_back)  # refused by the take, back in its key's sub-queue
            queued = stats.get_value("scheduler/enqueued") - stats.get_value("scheduler/dequeued")
            assert queued == len(scheduler) == 1
            await line.locks.release(blocker)
            assert await f.next_request() is waiting
            assert stats.get_value("scheduler/enqueued") == stats.get_value("scheduler/dequeued")
            assert stats.get_value("scheduler/enqueued/memory") == stats.get_value(
                "scheduler/dequeued/memory"
            )
            await f.send(waiting)
            f.middleware.process_response(waiting, None)  # type: ignore[arg-type]
            await until(lambda: not line.locks.releasing)
            assert leftover(redis_client) == 0

    asyncio.run(scenario())
