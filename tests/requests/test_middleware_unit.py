"""StageLockMiddleware in-process (scrapy.utils.test.get_crawler, as Scrapy's own middleware tests;
a real Redis): what it waits for, what it releases on each outcome, what it refuses. The real crawls
are in test_middleware.py."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from scrapy import Request, Spider
from scrapy.exceptions import IgnoreRequest
from scrapy.http import Response
from scrapy.utils.test import get_crawler

from scrapy_redislock import StageLockMiddleware
from scrapy_redislock.crawl.stagelocks import LeaseRanOut
from scrapy_redislock.errors import AcquireTimeout, ThrottlingDisabled
from scrapy_redislock.lock.status import stage_status
from testing.crawlproc import leftover
from testing.inprocess import front, held, request
from testing.waiting import until

pytestmark = pytest.mark.integration


def test_uncapped_and_stageless_requests_pass_without_a_coroutine(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario() -> None:
        async with front(redis_url, {"detail": 1, "comments": None}, scheduler=False) as f:
            assert f.middleware.process_request(request("comments")) is None
            assert f.middleware.process_request(request(None)) is None
            with pytest.raises(IgnoreRequest, match="'nope' is not configured"):
                f.middleware.process_request(request("nope"))
            assert f.crawler.stats.get_value("redislock/unknown_stage") == 1
            assert leftover(redis_client) == 0

    asyncio.run(scenario())


def test_the_requests_waiting_here_are_what_the_renewals_report(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The front counts its requests waiting for a stage at each round and passes the count down
    to the registry (no count of the front's kept in the registry): Redis shows 1 waiting while
    the second request waits here, 0 at the round after it got its slot."""

    def waiters() -> int:
        status = stage_status(redis_client, "redislock", "detail")
        assert status is not None
        return status.waiters

    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, scheduler=False) as f:
            first, second = request("detail", 1), request("detail", 2)
            await f.send(first)
            waiting = f.send(second)
            await until(lambda: f.slots.lines.waiting("detail") == 1)
            await f.slots.tick()
            assert f.locks.waiting("detail") == 1
            assert waiters() == 1
            f.middleware.process_response(first, Response(first.url, request=first))
            await asyncio.wait_for(waiting, 10)
            await f.slots.tick()
            assert f.locks.waiting("detail") == 0
            assert waiters() == 0
            f.middleware.process_response(second, Response(second.url, request=second))
            await until(lambda: leftover(redis_client) == 0)

    asyncio.run(scenario())


@pytest.mark.parametrize("outcome", ["response", "exception", "left_downloader"])
def test_a_request_waits_here_holds_its_slot_and_every_outcome_releases_it(
    redis_url: str, redis_client: redis.Redis, outcome: str
) -> None:
    """Without the scheduler: the second request of a stage capped at 1 waits in Redis until the
    first is done."""

    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, scheduler=False) as f:
            mw = f.middleware
            first, second = request("detail", 1), request("detail", 2)
            await f.send(first)  # through the downloader, as the engine sends them
            assert len(held(redis_client, "detail")) == 1
            waiting = f.send(second)
            await until(lambda: f.slots.lines.waiting("detail") == 1)
            if outcome == "response":
                mw.process_response(first, Response(first.url, request=first))
            elif outcome == "exception":
                mw.process_exception(first, IgnoreRequest("dropped"))
            else:
                mw.request_left(first, f.crawler.spider)
                # after it: nothing more
                mw.process_response(first, Response(first.url, request=first))
            await asyncio.wait_for(waiting, 10)
            assert f.slots.lines.waiting("detail") == 0
            mw.process_response(second, Response(second.url, request=second))
            await until(lambda: leftover(redis_client) == 0)
            assert f.crawler.stats.get_value("redislock/detail/acquired") == 2

    asyncio.run(scenario())


def test_a_slot_handed_with_a_request_is_released_though_the_request_never_reached_it(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """An earlier middleware answered it (a cache hit): only process_response sees it, and frees its
    slot."""

    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, scheduler=False) as f:
            answered = request("detail", 1)
            f.slots.hand(answered, await f.locks.acquire("detail", None))
            f.middleware.process_response(answered, Response(answered.url, request=answered))
            await until(lambda: leftover(redis_client) == 0)

    asyncio.run(scenario())


def test_an_adaptive_stage_learns_each_answers_latency_and_how_long_its_slot_was_held(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The hold runs from the moment the slot became the request's (granted by Redis, or passed on
    by the request before it in this process) to the moment it went back (request_left_downloader):
    the adaptive limit reads the share of it the site had the request, lower when requests wait
    in this process with their slots."""

    async def scenario() -> None:
        stages = {"detail": {"limit": 1, "adaptive": True}}
        async with front(redis_url, stages, scheduler=False) as f:  # type: ignore[arg-type]
            mw, now = f.middleware, [0.0]
            first, second = request("detail", 1), request("detail", 2)
            await f.send(first)  # through the downloader, as the engine sends them
            granted = f.slots.permit_of(first)
            adaptation = f.locks.adaptation
            assert granted is not None and adaptation is not None
            seen: list[tuple[str, float | None, bool, float | None]] = []
            # what the middleware tells the adaptive limit (its reports are not this test's)
            adaptation.response = lambda *args: seen.append(args)  # type: ignore[method-assign]
            now[0] = granted.acquired_at + 0.3
            mw.outcomes.clock = lambda: now[0]
            waiting = f.send(second)
            await until(lambda: f.slots.lines.waiting("detail") == 1)
            first.meta["download_latency"] = 0.2
            now[0] = granted.acquired_at + 0.8
            mw.request_left(first, f.crawler.spider)  # its slot passes on to the second
            now[0] = granted.acquired_at + 1.0  # the answer's own handling is not the slot's
            mw.process_response(first, Response(first.url, request=first))
            assert seen == [("detail", 0.2, False, pytest.approx(0.8))]  # from the grant
            await asyncio.wait_for(waiting, 10)
            assert f.slots.permit_of(second) is granted
            second.meta["download_latency"] = 0.1
            now[0] = granted.acquired_at + 1.1
            mw.request_left(second, f.crawler.spider)
            mw.process_response(second, Response(second.url, request=second))
            assert seen[1] == ("detail", 0.1, False, pytest.approx(0.3))  # from the first's release
            await until(lambda: leftover(redis_client) == 0)

    asyncio.run(scenario())


def test_an_acquire_timeout_from_the_scheduler_fails_the_request_unretried(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, scheduler=False) as f:
            late = request("detail", 1)
            f.slots.hand(late, AcquireTimeout("stage 'detail': no slot within 1 s"))
            with pytest.raises(AcquireTimeout):
                f.middleware.process_request(late)
            assert late.meta["dont_retry"] is True
        async with front(
            redis_url, {"detail": 1}, scheduler=False, RETRY_EXCEPTIONS=[AcquireTimeout]
        ) as f:
            late = request("detail", 2)
            f.slots.hand(late, AcquireTimeout("no slot"))
            with pytest.raises(AcquireTimeout):
                f.middleware.process_request(late)
            assert "dont_retry" not in late.meta

    asyncio.run(scenario())


def test_switched_off_it_refuses_staged_requests_instead_of_sending_them_unthrottled() -> None:
    crawler = get_crawler(Spider, {"REDISLOCK_ENABLED": False, "REDISLOCK_STAGES": {"detail": 1}})
    mw = StageLockMiddleware.from_crawler(crawler)
    assert mw.process_request(request(None)) is None
    with pytest.raises(ThrottlingDisabled, match="'detail'"):
        mw.process_request(request("detail"))
    assert crawler.stats.get_value("redislock/throttling_off") == 1


def test_a_request_waiting_here_when_the_spider_closes_is_dropped_and_every_slot_freed(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, scheduler=False) as f:
            first, second = request("detail", 1), request("detail", 2)
            await f.middleware.process_request(first)
            waiting = asyncio.ensure_future(f.middleware.process_request(second))
            await until(lambda: f.slots.lines.waiting("detail") == 1)
            await f.middleware.spider_closed(f.crawler.spider, "finished")
            with pytest.raises(IgnoreRequest, match="closing"):
                await asyncio.wait_for(waiting, 10)
            assert leftover(redis_client) == 0

    asyncio.run(scenario())


def test_a_request_of_a_capped_stage_with_only_its_key_slot_gives_it_back_while_it_waits(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The one order (stage, then key): a request whose stage StageScheduler did not see as capped
    (a middleware before this one set it on the way) may come with its key's slot and none of its
    stage's. It waits for its stage's without holding its key's, which another request of the key
    takes meanwhile; then it takes both, in that order."""

    async def scenario() -> None:
        settings = {"REDISLOCK_STAGE_KEY": "domain", "REDISLOCK_KEY_LIMIT": 1}
        async with front(redis_url, {"detail": 1}, scheduler=False, **settings) as f:
            throttle = f.middleware.throttle
            assert throttle is not None
            blocker = await f.locks.acquire("detail", None)  # the stage's only slot, held
            key_slot = await throttle.locks.take("127.0.0.1")
            assert key_slot is not None
            late = request("detail", 1)
            f.slots.hand(late, [(throttle.lines, key_slot)])
            waiting = f.send(late)
            await until(lambda: f.slots.lines.waiting("detail") == 1)
            assert f.slots.held(late) == []  # its key's slot went back
            other = request(None, 2)
            await asyncio.wait_for(f.send(other), 10)  # the key's one slot, free again
            assert [p.name for p in throttle.held_scopes(other)] == ["key:127.0.0.1"]
            f.middleware.request_left(other, f.crawler.spider)
            f.active.discard(other)
            await f.locks.release(blocker)
            await asyncio.wait_for(waiting, 10)
            assert [p.name for _, p in f.slots.held(late)] == ["detail", "key:127.0.0.1"]
            f.middleware.request_left(late, f.crawler.spider)
            f.active.discard(late)
            await until(lambda: leftover(redis_client) == 0)

    asyncio.run(scenario())


def test_a_cached_429_pauses_nothing(redis_url: str, redis_client: redis.Redis) -> None:
    """HttpCacheMiddleware answers a request from its cache before ours sees it, but every
    process_response runs: a cached 429 with Retry-After never reached the site, so it pauses no
    process (it paused the whole cluster at each replay). A 429 from the site does."""

    async def scenario() -> None:
        async with front(
            redis_url,
            {"detail": 2},
            REDISLOCK_STAGE_KEY="domain",
            REDISLOCK_KEY_LIMIT=2,
            REDISLOCK_RETRY_AFTER=True,
        ) as f:
            stats = f.crawler.stats
            cached = request("detail", 1)
            answer = Response(
                cached.url, status=429, headers={"Retry-After": "30"}, flags=["cached"]
            )
            f.middleware.process_response(cached, answer)
            assert stats.get_value("redislock/retry_after/pauses") is None
            sent = request("detail", 2)
            await f.send(sent)
            f.middleware.process_response(
                sent, Response(sent.url, status=429, headers={"Retry-After": "30"}, request=sent)
            )
            assert stats.get_value("redislock/retry_after/pauses") == 1

    asyncio.run(scenario())


def test_a_request_whose_slot_a_renewal_found_lost_does_not_start(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A request went through the middleware with its stage's slot and waits in Scrapy's downloader
    (its slot's queue, DOWNLOAD_DELAY); meanwhile a renewal finds the slot lost (reaped: another
    process may hold it now). As its download starts it is not sent: LeaseRanOut, retried as a
    download timeout. Its lease alone was read, which may not have run out yet."""

    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}) as f:
            waiting = request("detail", 1)
            f.crawler.engine.downloader.active.add(waiting)  # type: ignore[union-attr]
            await f.send(waiting)
            [(_, permit)] = f.slots.held(waiting)
            assert permit.usable(time.monotonic())
            permit.lost = True  # what a renewal that finds it reaped says
            with pytest.raises(LeaseRanOut):
                f.middleware._at_download_start(waiting)
            f.middleware.process_exception(waiting, LeaseRanOut("lost"), Spider("unit"))

    asyncio.run(scenario())


def test_a_crawl_delay_past_the_longest_delay_is_kept_at_the_longest(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """robots.txt says ``Crawl-delay: 1e300``: the site's delay is the longest one a setting may
    name (86400 s), said at WARNING; past about 1e14 s Redis refused the delay's script, whose
    retries held every request of the site for ever."""

    class Robots:
        def crawl_delay(self, agent: str) -> float:
            return 1e300

    async def scenario() -> None:
        async with front(
            redis_url,
            {"detail": 1},
            scheduler=False,
            REDISLOCK_CRAWL_DELAY=True,
            ROBOTSTXT_OBEY=True,
        ) as f:
            throttle = f.middleware.throttle
            assert throttle is not None
            throttle.robots_parsed(Robots(), request("detail"))
            assert throttle.crawl_delays == {"127.0.0.1": 86400.0}
            # the site's first start goes at once: Redis takes a gap of 86400 s
            await asyncio.wait_for(f.send(request("detail", 1)), 10.0)
        for key in redis_client.scan_iter("redislock:{key:127.0.0.1}:*"):  # a day's gap: not left
            redis_client.delete(key)

    asyncio.run(scenario())
    assert "asks for a Crawl-delay of 1e+300 s; the cluster keeps 86400 s" in caplog.text


def test_a_start_a_later_wait_holds_back_keeps_its_gap_after_it_goes_out(redis_url: str) -> None:
    """Stage ``detail`` keeps 1 s between starts, host 127.0.0.2 0.6 s. R1 (host 2, whose start
    was just taken) confirms its stage's start, then waits 0.6 s for its host's. R2 (host 3) asks
    for the stage meanwhile: it may go no sooner than 1 s after R1 goes out, not 1 s after R1's
    confirmation (0.4 s after R1 at the site, before R1's start was held back)."""

    async def scenario() -> None:
        async with front(
            redis_url,
            {"detail": None},
            scheduler=False,
            REDISLOCK_STAGE_KEY="domain",
            REDISLOCK_DELAYS={"detail": 1.0, "127.0.0.2": 0.6},
        ) as f:
            throttle = f.middleware.throttle
            assert throttle is not None
            await throttle.delays.wait_start("key:127.0.0.2", 0.6)  # host 2's start: just now
            first = Request("http://127.0.0.2:9/1", meta={"redislock_stage": "detail"})
            second = Request("http://127.0.0.3:9/2", meta={"redislock_stage": "detail"})
            out: dict[str, float] = {}

            async def go(name: str, request: Request) -> None:
                await f.send(request)
                out[name] = time.monotonic()

            going = asyncio.ensure_future(go("first", first))
            await until(lambda: len(throttle.starts.get(first, ())) == 1)  # its stage's start
            await asyncio.gather(going, go("second", second))
            # 1 s less R1's wake-up lag from its sleep (0.4 s before the fix)
            assert out["second"] - out["first"] >= 0.75, out
            assert f.crawler.stats.get_value("redislock/delay/held_back_starts") == 1

    asyncio.run(scenario())
