"""StartWaits: a delayed key's requests wait for their start one at a time per process, the others
queued in StageScheduler, not in the downloader. In-process (a real Redis, no crawl) and a real
crawl (``scrapy runspider``) against the local site on two host names."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from scrapy import Request
from scrapy.exceptions import IgnoreRequest

from scrapy_redislock.crawl.early import robots_unknown
from scrapy_redislock.requests.startwaits import MOST_QUEUED_NAMES, StartWaits
from testing.crawlproc import Crawl, leftover
from testing.inprocess import Front, front, request
from testing.site import CrawlSite
from testing.waiting import until

pytestmark = pytest.mark.integration


async def the_second_goes_after_the_first(
    f: Front, first: Request, second: Request, *others: Request, gap: float
) -> None:
    """The first request's start is confirmed; then the second leaves the scheduler and starts
    ``gap`` or more after it; all of them are answered."""
    await f.send(first)
    assert await f.next_request() is second
    await f.send(second)
    starts = [r.meta["redislock_start_at"] for r in (first, second)]
    assert starts[1] - starts[0] >= gap - 0.001
    for r in (first, second, *others):
        f.middleware.process_response(r, None)  # type: ignore[arg-type]


def test_past_the_most_names_with_a_sub_queue_a_busy_names_request_leaves() -> None:
    """Pure: each busy name gets a sub-queue of its own up to MOST_QUEUED_NAMES; past them a
    request of another busy name leaves (to sleep in the middleware); a name whose sub-queue ran
    out makes room."""
    woken: list[None] = []
    waits = StartWaits(lambda r: (r.meta["name"],), lambda: woken.append(None))
    out = [Request(f"http://a/{n}", meta={"name": f"n{n}"}) for n in range(MOST_QUEUED_NAMES + 1)]
    for r in out:
        waits.leaving(r)  # every name has a start under way
    queued = [waits.blocked_name(Request("http://b", meta=r.meta)) for r in out]
    assert queued[:-1] == [r.meta["name"] for r in out[:-1]] and queued[-1] is None
    assert waits.blocked_name(Request("http://c", meta={"name": "n0"})) == "n0"  # has its own
    waits.emptied("n0")
    assert waits.blocked_name(Request("http://d", meta=out[-1].meta)) == out[-1].meta["name"]
    waits.ended(out[0], "n0")
    assert not waits.busy("n0") and woken == [None]
    assert waits.blocked_name(Request("http://e", meta={"name": "n0"})) is None


def test_a_delayed_keys_next_request_stays_queued_until_the_one_before_has_its_start(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Two requests of a host with a delay and one of another host: the first leaves; the second of
    the host stays in the scheduler (the other host's goes past it) until the first's start is
    confirmed, then leaves and books its own."""

    async def scenario() -> None:
        async with front(
            redis_url,
            {"detail": None},
            REDISLOCK_STAGE_KEY="domain",
            REDISLOCK_DELAYS={"127.0.0.1": 0.3},
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None
            first, second = request(None, 1), request(None, 2)  # host 127.0.0.1
            other = request(None, 3).replace(url="http://127.0.0.2:9/free/3")
            for r in (first, second, other):
                scheduler.enqueue_request(r)
            going = {scheduler.next_request(), scheduler.next_request()}
            assert going == {first, other} or going == {second, other}, going
            assert scheduler.next_request() is None  # the host's next waits queued
            assert scheduler.has_pending_requests() and len(scheduler) == 1
            [out] = going - {other}
            await f.send(out)  # its start confirmed at once (the host's first)
            left = scheduler.next_request()
            assert left is not None and left is not out and left in (first, second)
            await f.send(left)  # books the next start, a delay later
            starts = [r.meta["redislock_start_at"] for r in (out, left)]
            assert starts[1] - starts[0] >= 0.3 - 0.001
            for r in (out, left, other):
                f.middleware.process_response(r, None)  # type: ignore[arg-type]
        assert leftover(redis_client) == 0

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "list_policy",
    [pytest.param({"delay": 0.3}, id="delay"), pytest.param({"rate": "1/0.3s"}, id="rate-window")],
)
def test_an_uncapped_stages_own_pace_keeps_its_next_request_queued(
    redis_url: str, redis_client: redis.Redis, list_policy: dict[str, object]
) -> None:
    """A stage of no cap with a delay of its own (or a full rate window of one start): its first
    request leaves, its second stays in the scheduler (another stage's goes past it) until the
    first's start is confirmed, then leaves and books its own a delay later (before, both left and
    the second slept in the middleware, holding one of CONCURRENT_REQUESTS)."""

    async def scenario() -> None:
        async with front(
            redis_url,
            {"list": {"limit": None, **list_policy}, "detail": None},  # type: ignore[dict-item]
            SCHEDULER_PRIORITY_QUEUE="scrapy.pqueues.ScrapyPriorityQueue",
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None
            first, second = request("list", 1), request("list", 2)
            if "rate" in list_policy:
                scheduler.enqueue_request(first)
                assert scheduler.next_request() is first
                await f.send(first)  # took the window's one place: the window is full
                f.middleware.process_response(first, None)  # type: ignore[arg-type]
                first, second = second, request("list", 3)
            other = request("detail", 4)
            for r in (first, second, other):
                scheduler.enqueue_request(r)
            assert scheduler.next_request() is first
            assert scheduler.next_request() is other  # the other stage's goes past
            assert scheduler.next_request() is None  # the stage's next waits queued
            assert scheduler.has_pending_requests() and len(scheduler) == 1
            await the_second_goes_after_the_first(f, first, second, other, gap=0.3)
        assert leftover(redis_client) == 0

    asyncio.run(scenario())


def test_an_uncapped_stages_own_delay_holds_its_requests_of_capped_keys_too(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """With capped keys, a request leaves the inner scheduler for its key's take before it leaves
    the scheduler: the delayed stage is marked then, so its next request (of another key, with
    room) stays queued while another stage's goes past (before, all of them went to their keys'
    takes at once and slept in the middleware, up to CONCURRENT_REQUESTS of them)."""

    async def scenario() -> None:
        async with front(
            redis_url,
            {"list": {"limit": None, "delay": 0.3}, "detail": None},  # type: ignore[dict-item]
            REDISLOCK_STAGE_KEY="domain",
            REDISLOCK_KEY_LIMIT=1,
            SCHEDULER_PRIORITY_QUEUE="scrapy.pqueues.ScrapyPriorityQueue",
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None
            first = request("list", 1)
            second = request("list", 2).replace(url="http://127.0.0.2:9/list/2")
            other = request("detail", 3).replace(url="http://127.0.0.3:9/detail/3")
            for r in (first, second, other):
                scheduler.enqueue_request(r)
            # each with its key's slot, in the order their takes came back: the other stage's
            # goes past the stage's next, which waits queued
            assert {await f.next_request(), await f.next_request()} == {first, other}
            keyline = scheduler.keyline
            assert keyline is not None
            await until(lambda: not keyline.looking)  # no take under way here
            assert scheduler.next_request() is None
            await the_second_goes_after_the_first(f, first, second, other, gap=0.3)
        assert leftover(redis_client) == 0

    asyncio.run(scenario())


def test_a_request_waiting_for_its_sites_robots_txt_does_not_hold_its_delayed_stage(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A delayed stage's request whose site's robots.txt is not read yet would wait for it first,
    up to a download timeout: it does not hold its stage's other requests back (they go on to their
    own sites); once the site's robots.txt is read, the stage's requests leave one at a time."""

    async def scenario() -> None:
        async with front(
            redis_url,
            {"list": {"limit": None, "delay": 30}, "detail": None},  # type: ignore[dict-item]
            ROBOTSTXT_OBEY=True,
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None
            first = request("list", 1)
            second = request("list", 2).replace(url="http://127.0.0.2:9/list/2")
            for r in (first, second):
                scheduler.enqueue_request(r)
            assert scheduler.next_request() is first  # waits for 127.0.0.1's robots.txt
            assert scheduler.next_request() is second
            robots = next(
                mw
                for mw in f.crawler.engine.downloader.middleware.middlewares  # type: ignore[union-attr]
                if hasattr(mw, "_parsers")
            )
            robots._parsers["127.0.0.1:9"] = SimpleNamespace(allowed=lambda url, agent: True)
            third, fourth = request("list", 3), request("list", 4)
            for r in (third, fourth):
                scheduler.enqueue_request(r)
            assert scheduler.next_request() is third
            assert scheduler.next_request() is None  # behind the third's start
            for r in (first, second, third):
                f.middleware.process_response(r, None)  # type: ignore[arg-type]
            assert scheduler.next_request() is fourth
            f.middleware.process_response(fourth, None)  # type: ignore[arg-type]
        assert leftover(redis_client) == 0

    asyncio.run(scenario())


def test_a_capped_stages_queue_is_asked_again_when_its_full_windows_last_wait_ends(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A capped stage's rate window of one start: two requests left before it was found full, the
    second waits in the middleware for a place (the stage counts as busy meanwhile); when that wait
    ends the engine is asked again for the stage's queued requests (before, nothing asked: they
    waited for a download to end or the engine's heartbeat)."""

    async def scenario() -> None:
        async with front(
            redis_url,
            {"list": {"limit": 3, "rate": "1/0.3s"}},  # type: ignore[dict-item]
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None
            start_waits = f.middleware.throttle.start_waits  # type: ignore[union-attr]
            assert start_waits is not None
            woken: list[bool] = []
            start_waits.wake = lambda: woken.append(True)
            first, second = request("list", 1), request("list", 2)
            for r in (first, second):
                scheduler.enqueue_request(r)
            assert await f.next_request() is first
            assert await f.next_request() is second
            await f.send(first)  # took the window's one place
            waiting = f.send(second)  # waits a window for its place
            await until(lambda: start_waits.busy("\x00stage:list"))
            woken.clear()
            await waiting
            assert woken  # the stage's queue is asked again
            for r in (first, second):
                f.middleware.process_response(r, None)  # type: ignore[arg-type]
        assert leftover(redis_client) == 0

    asyncio.run(scenario())


def test_a_full_rate_windows_next_request_stays_queued_until_the_one_before_has_its_start(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A host's rate window of 1 start a second: its first request finds room and takes the
    window's last place, so the window is full; from then on one request at a time leaves and
    waits for its place, the next staying queued (another host's going past) until that one's
    start is logged (before, each left and waited in the downloader, taking one of
    CONCURRENT_REQUESTS)."""

    async def scenario() -> None:
        async with front(
            redis_url,
            {"detail": None},
            REDISLOCK_STAGE_KEY="domain",
            REDISLOCK_SCOPES={"127.0.0.1": {"rate": "1/s"}},
            # in the order queued (DownloaderAwarePriorityQueue puts a host with none in flight first)
            SCHEDULER_PRIORITY_QUEUE="scrapy.pqueues.ScrapyPriorityQueue",
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None
            first, second, third, fourth = (request(None, n) for n in range(1, 5))
            other = request(None, 5).replace(url="http://127.0.0.2:9/free/5")
            scheduler.enqueue_request(first)
            assert scheduler.next_request() is first
            await f.send(first)  # the window had room: logged at once, its one place taken
            for r in (second, third, fourth, other):
                scheduler.enqueue_request(r)
            assert scheduler.next_request() is second  # one leaves to wait for the window
            assert scheduler.next_request() is other  # the other host's goes past
            assert scheduler.next_request() is None  # the host's others stay queued
            await f.send(second)
            assert scheduler.next_request() is third  # one at a time
            assert scheduler.next_request() is None  # the fourth stays queued
            await f.send(third)  # its place logged: the fourth may leave
            assert scheduler.next_request() is fourth
            await f.send(fourth)
            starts = [r.meta["redislock_start_at"] for r in (first, second, third, fourth)]
            assert all(b - a >= 1.0 - 0.001 for a, b in itertools.pairwise(starts)), starts
            for r in (first, second, third, fourth, other):
                f.middleware.process_response(r, None)  # type: ignore[arg-type]
        assert leftover(redis_client) == 0

    asyncio.run(scenario())


def test_a_request_answered_before_our_middleware_lets_its_delayed_keys_next_one_go(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A request an earlier middleware answers (HttpCacheMiddleware's cached response) or drops
    (robots.txt's IgnoreRequest) never books its start: its answer, or its failure, through our
    middleware lets the host's next request leave at once (else it waited for the engine's
    heartbeat, 5 s a request of a cached crawl)."""

    async def scenario() -> None:
        async with front(
            redis_url,
            {"detail": None},
            REDISLOCK_STAGE_KEY="domain",
            REDISLOCK_DELAYS={"127.0.0.1": 30},
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None
            first, second, third = request(None, 1), request(None, 2), request(None, 3)
            for r in (first, second, third):
                scheduler.enqueue_request(r)
            cached = scheduler.next_request()
            assert cached is not None and scheduler.next_request() is None
            f.middleware.process_response(cached, None)  # type: ignore[arg-type]
            dropped = scheduler.next_request()
            assert dropped is not None and dropped is not cached
            assert scheduler.next_request() is None
            f.middleware.process_exception(dropped, IgnoreRequest())
            assert scheduler.next_request() not in (None, cached, dropped)
        assert leftover(redis_client) == 0

    asyncio.run(scenario())


def test_a_request_queued_again_before_its_start_does_not_hold_its_own_key(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A middleware before ours returns the request itself (the engine queues it again): queued,
    it no longer waits for its start, so its key is free and it leaves again (it kept its own key
    busy for ever before, and the crawl never finished)."""

    async def scenario() -> None:
        async with front(
            redis_url,
            {"detail": None},
            REDISLOCK_STAGE_KEY="domain",
            REDISLOCK_DELAYS={"127.0.0.1": 30},
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None
            again = request(None, 1)
            scheduler.enqueue_request(again)
            assert scheduler.next_request() is again
            scheduler.enqueue_request(again)  # returned by a middleware before ours
            assert scheduler.next_request() is again
        assert leftover(redis_client) == 0

    asyncio.run(scenario())


def test_a_capped_stages_request_does_not_hold_back_the_uncapped_ones_of_its_key(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Requests of a capped stage are bounded by their stage's cap and are not counted here: with
    the stage's request of a delayed host on its way to its start, an uncapped request of that host
    still leaves (else a stage of 8 could keep the host busy without a break, and the pages that
    find the stage's requests wait behind them)."""

    async def scenario() -> None:
        async with front(
            redis_url,
            {"detail": 2, "listing": None},
            REDISLOCK_STAGE_KEY="domain",
            REDISLOCK_DELAYS={"127.0.0.1": 30},
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None
            detail = request("detail", 1)
            scheduler.enqueue_request(detail)
            assert await f.next_request() is detail  # with its stage's slot
            listing = request("listing", 2)
            scheduler.enqueue_request(listing)
            assert scheduler.next_request() is listing
            f.middleware.process_response(detail, None)  # type: ignore[arg-type]
        assert leftover(redis_client) == 0

    asyncio.run(scenario())


def test_a_capped_stages_own_delay_keeps_its_next_request_queued_with_room_in_its_cap(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A stage capped at 3 with 0.3 s between its starts: its first request leaves with a slot; its
    second stays queued although the cap has room (another stage's goes past it) until the first's
    start is confirmed (before, it left too and slept in the middleware with its slot and one of
    CONCURRENT_REQUESTS: up to the cap's worth of them at once)."""

    async def scenario() -> None:
        async with front(
            redis_url,
            {"list": {"limit": 3, "delay": 0.3}, "detail": 3},  # type: ignore[dict-item]
            SCHEDULER_PRIORITY_QUEUE="scrapy.pqueues.ScrapyPriorityQueue",
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None
            first, second, other = request("list", 1), request("list", 2), request("detail", 3)
            for r in (first, second, other):
                scheduler.enqueue_request(r)
            assert await f.next_request() is first  # with its stage's slot
            assert await f.next_request() is other  # the other stage's goes past
            await until(lambda: f.slots.kept.ready("list"))  # a slot is kept for the second
            assert scheduler.next_request() is None  # yet it waits queued
            await the_second_goes_after_the_first(f, first, second, other, gap=0.3)
        assert leftover(redis_client) == 0

    asyncio.run(scenario())


def crawl_delay_front(redis_url: str, stage_key: str) -> Any:
    """The request front with REDISLOCK_CRAWL_DELAY, robots.txt obeyed, keyed by ``stage_key``."""
    return front(
        redis_url,
        {"detail": None},
        REDISLOCK_STAGE_KEY=stage_key,
        REDISLOCK_CRAWL_DELAY=True,
        ROBOTSTXT_OBEY=True,
    )


def test_with_crawl_delay_a_site_whose_robots_txt_is_not_read_yet_sends_one_request_at_a_time(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """REDISLOCK_CRAWL_DELAY: until RobotsTxtMiddleware has read a site's robots.txt its Crawl-delay
    may come, so the site's requests leave one at a time (before, all of them left at once, waited
    for the robots.txt in the downloader, then each slept out the Crawl-delay there); another
    site's request goes past."""

    async def scenario() -> None:
        async with crawl_delay_front(redis_url, "domain") as f:
            scheduler = f.scheduler
            assert scheduler is not None
            first, second = request(None, 1), request(None, 2)
            other = request(None, 3).replace(url="http://127.0.0.2:9/free/3")
            for r in (first, second, other):
                scheduler.enqueue_request(r)
            assert scheduler.next_request() is first
            assert scheduler.next_request() is other  # the site's robots.txt is not read yet
            assert scheduler.next_request() is None
            f.middleware.process_response(first, None)  # type: ignore[arg-type]
            assert scheduler.next_request() is second
        assert leftover(redis_client) == 0

    asyncio.run(scenario())


def test_with_crawl_delay_a_key_many_sites_share_does_not_wait_for_their_robots_txt(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """REDISLOCK_CRAWL_DELAY with a key that is not the site (a download slot two sites share): the
    sites' robots.txt files not read yet hold nothing back (holding the shared key would fetch them
    one after another); a data: URL has no robots.txt to wait for."""

    async def scenario() -> None:
        async with crawl_delay_front(redis_url, "download_slot") as f:
            scheduler = f.scheduler
            assert scheduler is not None
            shared = {"download_slot": "proxy-1"}
            first = request(None, 1).replace(meta=shared)
            second = request(None, 2).replace(url="http://127.0.0.2:9/free/2", meta=shared)
            for r in (first, second):
                scheduler.enqueue_request(r)
            assert scheduler.next_request() is first
            assert scheduler.next_request() is second
            robots = SimpleNamespace(_parsers={})  # a RobotsTxtMiddleware that has read nothing
            assert robots_unknown(Request("http://127.0.0.3/"), (robots,))
            assert not robots_unknown(Request("data:,x"), (robots,))
            for r in (first, second):
                f.middleware.process_response(r, None)  # type: ignore[arg-type]
        assert leftover(redis_client) == 0

    asyncio.run(scenario())


@pytest.mark.crawl
@pytest.mark.parametrize(
    "pace",
    [
        pytest.param({"REDISLOCK_DELAYS": {"127.0.0.1": 2.0}}, id="delay"),
        pytest.param({"REDISLOCK_SCOPES": {"127.0.0.1": {"rate": "1/2s"}}}, id="rate-window"),
    ],
)
def test_a_site_with_a_long_delay_does_not_hold_the_downloader_from_the_others(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, pace: dict[str, object]
) -> None:
    """Host 1 keeps 2 s between starts (a delay, or a rate window of 1 start in 2 s), host 2 none;
    their pages interleaved, 2 of CONCURRENT_REQUESTS. Host 1's requests wait for their start one
    at a time, the others queued: every page of host 2 is answered before host 1's third start
    (before, host 1's requests slept in the downloader, two at a time, and host 2's pages went one
    every 2 s between them)."""
    settings = {
        "REDISLOCK_URL": redis_url,
        "SCHEDULER": "scrapy_redislock.StageScheduler",
        "REDISLOCK_STAGES": {"detail": None},
        "REDISLOCK_STAGE_KEY": "domain",
        "CONCURRENT_REQUESTS": 2,
        **pace,
    }
    with CrawlSite(delay=0.05, hosts=2) as site:
        crawl = Crawl(site.url, "detail:10", settings, tmp_path, args={"hosts": "2"}).run()
        assert crawl.code == 0, crawl.tail()
        with site.lock:
            host1 = sorted(site.host_arrivals["127.0.0.1"])
            host2 = sorted(site.host_arrivals["127.0.0.2"])
    assert len(host1) == len(host2) == 5, crawl.tail()
    assert host2[-1] < host1[2], (host1, host2)
    assert crawl.stats.get("finish_reason") == "finished"
    assert leftover(redis_client) == 0


@pytest.mark.parametrize(
    "list_policy",
    [
        pytest.param({"limit": None, "delay": 2.0}, id="delay"),
        pytest.param({"limit": None, "rate": "1/2s"}, id="rate-window"),
        pytest.param({"limit": 2, "delay": 2.0}, id="capped-delay"),
    ],
)
def test_a_stage_with_a_long_delay_does_not_hold_the_downloader_from_the_others(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, list_policy: dict[str, object]
) -> None:
    """Stage ``list`` (no cap, or capped at 2) keeps 2 s between starts (its own delay, or a rate
    window of 1 start in 2 s); each list page yields a page of stage ``detail``, which has none; 2
    of CONCURRENT_REQUESTS. The list pages wait for their start one at a time, the others queued:
    the first detail page is answered before the second list start (before, list pages slept in
    both of the downloader's places, and the detail pages waited behind them)."""
    settings = {
        "REDISLOCK_URL": redis_url,
        "SCHEDULER": "scrapy_redislock.StageScheduler",
        "REDISLOCK_STAGES": {"list": list_policy, "detail": None},
        "CONCURRENT_REQUESTS": 2,
    }
    with CrawlSite(delay=0.05) as site:
        crawl = Crawl(site.url, "list:5", settings, tmp_path, args={"follow": "detail"}).run()
        assert crawl.code == 0, crawl.tail()
        with site.lock:
            lists = sorted(site.arrivals["list"])
            details = sorted(site.arrivals["detail"])
    assert len(lists) == len(details) == 5, crawl.tail()
    assert details[0] < lists[1], (lists, details)
    assert crawl.stats.get("finish_reason") == "finished"
    assert leftover(redis_client) == 0
