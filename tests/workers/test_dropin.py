"""The worker front as a drop-in for scrapy-redis (issue 27, item 6): scrapy-redis's
SCHEDULER_QUEUE_CLASS orders the stage queues (its PriorityQueue by default, FifoQueue, LifoQueue;
anything else is refused), a RedisSpider's ``max_idle_time`` closes an idle worker as it closes a
RedisSpider, and a duplicate is dropped as Scrapy's and scrapy-redis's schedulers drop one
(``enqueue_request`` returns False, ``request_dropped`` is sent).

Real ``scrapy runspider`` / ``scrapy crawl`` workers against a real Redis and the local site; the
spider middlewares and the extension below are loaded by those workers by their import path
(``tests.workers.test_dropin.*``).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
import scrapy
from scrapy import signals
from scrapy.utils.test import get_crawler

from scrapy_redislock.crawl import requestformat
from scrapy_redislock.errors import ConfigError
from scrapy_redislock.workers.outbox import KNOWN_FINGERPRINTS
from scrapy_redislock.workers.policy import idle_close_for
from scrapy_redislock.workers.queue import QueueKeys, StageQueues
from scrapy_redislock.workers.scheduler import StageWorkerScheduler
from testing.crawlproc import ROOT, settings_args, staged_worker
from testing.lockstate import queued
from testing.site import CrawlSite, ShopSite
from testing.spiders.workerspider import StagedSpider
from testing.waiting import wait_until
from tests.workers.test_mixin import ENV, EXAMPLE, finish, held_slots, stat
from tests.workers.test_redis_faults import finish_reason

SPIDER = "staged"
KEYS = QueueKeys.of("redislock", SPIDER)
PRIORITY_OF = {0: 0, 1: 5, 2: -5}  # a start request's priority by its number modulo 3 (Prioritize)


# -- loaded by the workers: a spider middleware giving start requests priorities, one yielding each
# twice, and an extension counting request_dropped
# -----------------------------------------------------------------------------


class Prioritize:
    """Spider middleware: the start request ``<base>/<stage>/<n>`` gets priority PRIORITY_OF[n %
    3]."""

    async def process_start(self, start: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for item in start:
            if isinstance(item, scrapy.Request):
                item = item.replace(priority=PRIORITY_OF[int(item.url.rsplit("/", 1)[1]) % 3])
            yield item


class Twice:
    """Spider middleware: every start request is yielded twice (the second one is a duplicate)."""

    async def process_start(self, start: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for item in start:
            yield item
            if isinstance(item, scrapy.Request):
                yield item.copy()


class DroppedCount:
    """Extension: counts ``request_dropped`` signals in the stats (``dropin/request_dropped``),
    and with the setting TEST_DROPPED_FILE one line each in that file (the test watches it)."""

    def __init__(self, crawler: Any) -> None:
        self.stats = crawler.stats
        self.file = crawler.settings.get("TEST_DROPPED_FILE")
        crawler.signals.connect(self.dropped, signal=signals.request_dropped)

    @classmethod
    def from_crawler(cls, crawler: Any) -> DroppedCount:
        return cls(crawler)

    def dropped(self, request: scrapy.Request, spider: scrapy.Spider) -> None:
        self.stats.inc_value("dropin/request_dropped")
        if self.file:
            with open(self.file, "a") as file:
                file.write(f"{request.url}\n")


# -- helpers ---------------------------------------------------------------------------------------


def ended(worker: subprocess.Popen[str]) -> Callable[[], str | None]:
    """For wait_until: that the worker ended, with its last output."""
    return lambda: (
        None if worker.poll() is None else f"the worker ended:\n{worker.communicate()[0][-3000:]}"
    )


def set_limit(admin_url: str, limit: int) -> None:
    command = [
        sys.executable,
        "-m",
        "scrapy_redislock",
        "set-limit",
        "workers:a",
        str(limit),
        "--url",
        admin_url,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def fetch_order(site: CrawlSite) -> list[int]:
    with site.lock:
        return [int(record.path.rsplit("/", 1)[1]) for record in site.served]


def seed_requests(redis_url: str, entries: list[tuple[str, int]], order: str = "priority") -> None:
    """Queue (url, priority) requests of stage a as a worker in ``order`` would."""

    async def push() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        queues = StageQueues(client, SPIDER, ["a"], worker="seeder", order=order)
        spider = scrapy.Spider(name=SPIDER)
        for url, priority in entries:
            request = scrapy.Request(url, priority=priority, meta={"redislock_stage": "a"})
            await queues.push(
                "a", "", requestformat.dumps(request.to_dict(spider=spider)), priority
            )
        await client.aclose()

    asyncio.run(push())


# -- SCHEDULER_QUEUE_CLASS: the order of the stage queues ------------------------------------------

COUNT = 12
# unset: PriorityQueue
ORDERED = {
    None: [n for p in (5, 0, -5) for n in range(COUNT) if PRIORITY_OF[n % 3] == p],
    "scrapy_redis.queue.PriorityQueue": [
        n for p in (5, 0, -5) for n in range(COUNT) if PRIORITY_OF[n % 3] == p
    ],
    "scrapy_redis.queue.FifoQueue": list(range(COUNT)),
    "scrapy_redis.queue.LifoQueue": list(reversed(range(COUNT))),
}


@pytest.mark.integration
@pytest.mark.crawl
@pytest.mark.parametrize("queue_class", list(ORDERED))
def test_a_worker_fetches_in_the_order_of_scheduler_queue_class(
    redis_url: str, admin_url: str, redis_client: redis.Redis, queue_class: str | None
) -> None:
    """One worker queues its start requests with priorities 0, 5, -5 (by their number) while stage a
    is paused, then fetches them one at a time once the stage is raised: higher priority first and
    equal priorities in the order they were queued (scrapy-redis's PriorityQueue, the default), or
    first in first out / last in first out (FifoQueue, LifoQueue), whatever the priorities."""
    with CrawlSite(delay=0.01) as site:
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 0},
            "SCHEDULER_QUEUE_CLASS": queue_class,
            "SPIDER_MIDDLEWARES": {"tests.workers.test_dropin.Prioritize": 10},
            "CONCURRENT_REQUESTS": 1,
        }
        worker = staged_worker(redis_url, site.url, f"a:{COUNT}", settings)
        try:
            wait_until(
                lambda: queued(redis_client, KEYS, "a") == COUNT,
                60,
                "every start request queued",
                ended=ended(worker),
            )
            assert not site.hits
            set_limit(admin_url, 1)
            output = finish(worker)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        assert fetch_order(site) == ORDERED[queue_class], output[-3000:]
        order = {None: "priority"}.get(queue_class) or queue_class.rsplit(".", 1)[1].removesuffix(
            "Queue"
        ).lower()
        assert f"in {order} order (SCHEDULER_QUEUE_CLASS)" in output
        # finished: the last worker out cleared, sorted sets too
        assert redis_client.keys("redislock:{staged}:*") == []
        assert held_slots(redis_client) == 0


@pytest.mark.integration
@pytest.mark.crawl
def test_another_scheduler_queue_class_stops_the_worker_at_start_naming_the_setting(
    redis_url: str,
) -> None:
    with CrawlSite(delay=0) as site:
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 1},
            "SCHEDULER_QUEUE_CLASS": "scrapy.squeues.FifoMemoryQueue",
        }
        output, _ = staged_worker(redis_url, site.url, "a:3", settings).communicate(timeout=60)
        assert not site.hits
    assert (
        "ConfigError: SCHEDULER_QUEUE_CLASS = 'scrapy.squeues.FifoMemoryQueue' cannot order"
        in output
    )
    assert "scrapy_redis.queue.PriorityQueue" in output and "Traceback" not in output


def test_the_scheduler_refuses_another_scheduler_queue_class() -> None:
    crawler = get_crawler(
        StagedSpider,
        {"REDISLOCK_WORKER_STAGES": {"a": 1}, "SCHEDULER_QUEUE_CLASS": "scrapy_redis.queue.Base"},
    )
    with pytest.raises(ConfigError, match=r"SCHEDULER_QUEUE_CLASS = 'scrapy_redis\.queue\.Base'"):
        StageWorkerScheduler.from_crawler(crawler)


# -- migration: a queue of the previous FIFO layout, and workers in another order ------------------


@pytest.mark.integration
@pytest.mark.crawl
@pytest.mark.parametrize("left_by", ["previous version", "priority workers"])
def test_what_another_layout_queued_is_fetched_exactly_once(
    redis_url: str, redis_client: redis.Redis, left_by: str
) -> None:
    """A queue left by the previous version (one FIFO list per stage whatever the priorities, and
    the in-flight record of a worker that died) is read by a worker in priority order as the
    priority-0 part: every page once. What workers in priority order left in the sorted set is read
    by a worker in FIFO order once its list is empty, with a warning naming the setting: every page
    once. Either way nothing is left in Redis."""
    with CrawlSite(delay=0.01) as site:
        urls = [f"{site.url}/a/{n}" for n in range(10)]
        if left_by == "previous version":
            requests = [
                scrapy.Request(u, priority=7 * (n % 2), meta={"redislock_stage": "a"})
                for n, u in enumerate(urls)
            ]
            entries = [requestformat.dumps(r.to_dict()) for r in requests]
            # the previous queue_push: LPUSH, whatever the priority
            redis_client.lpush(KEYS.queue("a"), *entries[:9])
            # its in-flight value format
            redis_client.hset(KEYS.inflight("h:1:gone"), "1", b"a\n" + entries[9])
            redis_client.set(KEYS.in_flight, 1)
            redis_client.zadd(KEYS.alive, {"h:1:gone": 0})
            redis_client.zadd(KEYS.due, {"h:1:gone": 0})
            settings: dict[str, Any] = {}
        else:
            seed_requests(redis_url, [(u, 1 + n % 3) for n, u in enumerate(urls)])
            assert redis_client.zcard(KEYS.scored("a")) == 10 and not redis_client.exists(
                KEYS.queue("a")
            )
            settings = {"SCHEDULER_QUEUE_CLASS": "scrapy_redis.queue.FifoQueue"}
        output = finish(
            staged_worker(
                redis_url, site.url, "", {"REDISLOCK_WORKER_STAGES": {"a": 1}, **settings}
            )
        )
        assert set(site.hits) == {f"/a/{n}" for n in range(10)} and set(site.hits.values()) == {
            1
        }, output[-3000:]
    assert stat(output, "redislock/workers/dead_letters") == 0
    if left_by == "priority workers":
        said = "requests of stage 'a' from redislock:{staged}:pqueue:a"
        warned = [line for line in output.splitlines() if said in line]
        assert len(warned) == 1 and " WARNING: " in warned[0], warned  # once per stage
        assert "give every worker of a spider the same SCHEDULER_QUEUE_CLASS" in output
    else:
        # the dead worker's request, back in the list
        assert stat(output, "redislock/workers/requeued") == 1
    assert redis_client.keys("redislock:{staged}:*") == []


# -- max_idle_time, as a RedisSpider honours it ----------------------------------------------------


# nothing set: idle for ever, as a RedisSpider
@pytest.mark.parametrize(
    ("redislock", "max_idle_time", "fallback", "expected"),
    [
        (None, None, None, (None, "MAX_IDLE_TIME_BEFORE_CLOSE")),
        (None, None, 3.0, (3.0, "MAX_IDLE_TIME_BEFORE_CLOSE")),
        (None, "2", 3.0, (2.0, "max_idle_time")),  # -a max_idle_time=2 (a string) beats the setting
        (None, 7, None, (7.0, "max_idle_time")),  # the spider's attribute
        (None, 0, 3.0, (None, "max_idle_time")),  # 0: never, as in scrapy-redis
        (None, "1.5", None, (1.5, "max_idle_time")),
        (4.0, 2, 3.0, (4.0, "REDISLOCK_IDLE_CLOSE")),  # ours, when set, wins
        (4.0, 0, None, (4.0, "REDISLOCK_IDLE_CLOSE")),
    ],
)
def test_idle_close_precedence(
    redislock: float | None,
    max_idle_time: Any,
    fallback: float | None,
    expected: tuple[float | None, str],
) -> None:
    assert idle_close_for(redislock, max_idle_time, fallback) == expected


@pytest.mark.parametrize("bad", ["soon", -1, "-2", True, float("inf"), "nan"])
def test_a_bad_max_idle_time_is_a_config_error_naming_it(bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"max_idle_time .* must be a number of seconds >= 0"):
        idle_close_for(None, bad, None)


def test_the_mixin_refuses_a_bad_max_idle_time_at_start() -> None:
    crawler = get_crawler(StagedSpider, {"REDISLOCK_WORKER_STAGES": {"a": 1}})
    with pytest.raises(ConfigError, match="max_idle_time"):
        crawler._create_spider(max_idle_time="soon")
    assert crawler._create_spider(max_idle_time="2").max_idle_time == "2"


@pytest.mark.integration
@pytest.mark.crawl
def test_a_redis_spider_closes_after_its_max_idle_time_argument(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """``scrapy crawl shop -a max_idle_time=1``, the example project's RedisSpider, with
    MAX_IDLE_TIME_BEFORE_CLOSE 120 and no REDISLOCK_IDLE_CLOSE: it crawls what its start URL leads
    to, then closes about a second after the cluster has no work left (the argument wins over the
    setting, as in scrapy-redis), finished."""
    with ShopSite(lists=1, details=2, comments=1, delay=0.01) as shop:
        redis_client.rpush("shop:start_urls", json.dumps({"url": shop.list_urls()[0]}))
        settings = {
            "REDIS_URL": redis_url,
            "REDISLOCK_IDLE_CLOSE": "None",
            "MAX_IDLE_TIME_BEFORE_CLOSE": 120,
        }
        command = [
            sys.executable,
            "-m",
            "scrapy",
            "crawl",
            "shop",
            "-a",
            "max_idle_time=1",
            *settings_args(settings),
        ]
        worker = subprocess.Popen(
            command,
            cwd=EXAMPLE,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        # MAX_IDLE_TIME_BEFORE_CLOSE would have kept it open 120 s
        output = finish(worker, timeout=60)
        assert set(shop.hits) == shop.expected_paths() and set(shop.hits.values()) == {1}
    assert "idle close: after 1 s with no work anywhere (max_idle_time)" in output
    assert finish_reason(output) == "finished"
    assert held_slots(redis_client) == 0


@pytest.mark.integration
@pytest.mark.crawl
@pytest.mark.parametrize(
    ("settings", "args", "said"),
    [
        (
            {"REDISLOCK_IDLE_CLOSE": None, "MAX_IDLE_TIME_BEFORE_CLOSE": 120},
            {"max_idle_time": "1"},
            "max_idle_time",
        ),
        ({"REDISLOCK_IDLE_CLOSE": 1}, {"max_idle_time": "120"}, "REDISLOCK_IDLE_CLOSE"),
        (
            {"REDISLOCK_IDLE_CLOSE": None, "MAX_IDLE_TIME_BEFORE_CLOSE": 1},
            {},
            "MAX_IDLE_TIME_BEFORE_CLOSE",
        ),
    ],
)
def test_a_plain_spider_worker_closes_as_the_winning_idle_setting_says(
    redis_url: str,
    redis_client: redis.Redis,
    settings: dict[str, Any],
    args: dict[str, str],
    said: str,
) -> None:
    with CrawlSite(delay=0.01) as site:
        worker = staged_worker(
            redis_url, site.url, "a:5", {"REDISLOCK_WORKER_STAGES": {"a": 1}, **settings}, args
        )
        # the losing value (120 s) would have kept it open past the timeout
        output = finish(worker, timeout=60)
        assert sorted(site.hits.values()) == [1] * 5
    assert f"idle close: after 1 s with no work anywhere ({said})" in output
    assert finish_reason(output) == "finished"


@pytest.mark.integration
@pytest.mark.crawl
def test_max_idle_time_0_idles_for_ever_as_in_scrapy_redis(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """``-a max_idle_time=0`` beats MAX_IDLE_TIME_BEFORE_CLOSE 1: the worker says at start that it
    never closes by itself, and is still open after heartbeats (each a look at the queues) well past
    a second of idleness; a Ctrl-C closes it."""
    with CrawlSite(delay=0.01) as site:
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 1},
            "REDISLOCK_IDLE_CLOSE": None,
            "MAX_IDLE_TIME_BEFORE_CLOSE": 1,
        }
        worker = staged_worker(redis_url, site.url, "a:3", settings, {"max_idle_time": "0"})
        assert worker.stdout is not None
        lines: list[str] = []
        reader = threading.Thread(
            target=lambda: lines.extend(iter(worker.stdout.readline, "")), daemon=True
        )
        reader.start()
        wait_until(
            lambda: len(site.hits) == 3 and site.last_served is not None,
            60,
            "the pages",
            ended=ended(worker),
        )
        assert site.last_served is not None
        idle_from_ms = (site.last_served + 3.0) * 1000  # wall clock, as Redis's on this machine

        def beat_after() -> bool:
            beats = redis_client.zrange(KEYS.alive, 0, -1, withscores=True)
            return bool(beats) and beats[0][1] > idle_from_ms

        wait_until(beat_after, 30, "a heartbeat 3 s after the last page", ended=ended(worker))
        assert worker.poll() is None
        worker.send_signal(signal.SIGINT)
        worker.wait(timeout=60)
        reader.join(timeout=10)
        worker.stdout.close()
        output = "".join(lines)
    assert worker.returncode == 0, output[-3000:]
    assert "idle close: never (max_idle_time)" in output
    assert finish_reason(output) == "shutdown"


# -- request_dropped: a duplicate is dropped as Scrapy's schedulers drop one -----------------------


@pytest.mark.integration
@pytest.mark.crawl
def test_duplicates_send_request_dropped_whether_this_worker_or_redis_knows_them(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Two workers yield the same 10 start requests, each of them twice: the second copy is a
    duplicate the worker knows (enqueue_request returns False, the engine sends request_dropped); of
    the first copies, the 10 queued by the other worker first are duplicates only Redis knows (the
    scheduler sends request_dropped when the push says so). 30 duplicates, 30 signals, each counted
    once as Scrapy counts them; every page fetched once. The site holds the first page until both
    workers have yielded every copy: on a starved machine the second worker could start only after
    the first had crawled everything and closed, which is another crawl."""
    with CrawlSite(delay=0.02) as site:
        files = [tmp_path / f"dropped-{n}" for n in range(2)]
        site.open.clear()
        workers = [
            staged_worker(
                redis_url,
                site.url,
                "a:10",
                {
                    "REDISLOCK_WORKER_STAGES": {"a": 1},
                    "SPIDER_MIDDLEWARES": {"tests.workers.test_dropin.Twice": 10},
                    "EXTENSIONS": {"tests.workers.test_dropin.DroppedCount": 0},
                    "REDISLOCK_IDLE_CLOSE": 1.5,
                    "TEST_DROPPED_FILE": str(file),
                },
            )
            for file in files
        ]

        def dropped() -> int:
            return sum(len(f.read_text().splitlines()) for f in files if f.exists())

        try:
            wait_until(lambda: dropped() == 30, 90, "every duplicate dropped")
        finally:
            site.open.set()
        outputs = [finish(w) for w in workers]
        assert sorted(site.hits.values()) == [1] * 10
    for output in outputs:
        dropped = stat(output, "dropin/request_dropped")
        assert (
            dropped
            == stat(output, "dupefilter/filtered")
            == stat(output, "redislock/workers/a/duplicates")
        )
        assert dropped >= 10, output[-3000:]  # its own second copies at least
    assert sum(stat(o, "dropin/request_dropped") for o in outputs) == 30
    assert sum(stat(o, "redislock/workers/a/enqueued") for o in outputs) == 10


def test_enqueue_request_returns_false_for_a_known_duplicate_and_signals_one_only_redis_knows(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """In-process, against a real Redis: the scheduler's own duplicate at once (False, logged as
    Scrapy's dupefilter logs the first), another worker's once the push comes back
    (``request_dropped`` sent by the scheduler); dont_filter requests are never filtered; the memory
    of fingerprints is bounded."""

    async def main() -> None:
        crawler = get_crawler(
            StagedSpider, {"REDIS_URL": redis_url, "REDISLOCK_WORKER_STAGES": {"a": None}}
        )
        crawler.spider = crawler._create_spider()
        crawler.engine = crawler._create_engine()  # not started: the scheduler only pokes it
        scheduler = StageWorkerScheduler.from_crawler(crawler)
        scheduler.spider = crawler.spider
        dropped: list[str] = []

        def on_dropped(request: scrapy.Request, spider: scrapy.Spider) -> None:
            dropped.append(request.url)

        # a weak reference: kept alive here
        crawler.signals.connect(on_dropped, signal=signals.request_dropped)
        other = StageQueues(scheduler.queues.client, SPIDER, ["a"], worker="other")
        try:

            def request(n: int, **kwargs: Any) -> scrapy.Request:
                return scrapy.Request(
                    f"http://shop.test/a/{n}", meta={"redislock_stage": "a"}, **kwargs
                )

            fingerprint = crawler.request_fingerprinter.fingerprint(request(1)).hex()
            assert await other.push("a", fingerprint, b"queued by another worker")
            with caplog.at_level("DEBUG", logger="scrapy_redislock.workers.scheduler"):
                assert scheduler.enqueue_request(request(0))
                assert not scheduler.enqueue_request(request(0))  # known here: refused at once
                assert scheduler.enqueue_request(request(0, dont_filter=True))
                assert scheduler.enqueue_request(request(1))  # only Redis knows it
                assert dropped == []
                await scheduler.outbox.sent()
            # the scheduler sent it; for /a/0 the engine would
            assert dropped == ["http://shop.test/a/1"]
            assert not scheduler.enqueue_request(request(1))  # known now
            assert crawler.stats.get_value("dupefilter/filtered") == 3
            assert crawler.stats.get_value("redislock/workers/a/duplicates") == 3
            assert crawler.stats.get_value("redislock/workers/a/enqueued") == 2
            logged = [
                r.getMessage()
                for r in caplog.records
                if "Filtered duplicate request" in r.getMessage()
            ]
            assert logged == [
                "Filtered duplicate request: <GET http://shop.test/a/0> - no more duplicates will "
                "be shown (see "
                "DUPEFILTER_DEBUG to show all duplicates)"
            ]
            # /a/0 twice (once unfiltered), the other worker's
            assert redis_client.llen(KEYS.queue("a")) == 3
            for n in range(KNOWN_FINGERPRINTS + 10):
                scheduler.outbox.know(n.to_bytes(8, "big"))
            assert (
                len(scheduler.outbox.known) == KNOWN_FINGERPRINTS
                and (0).to_bytes(8, "big") not in scheduler.outbox.known
            )
        finally:
            await scheduler.queues.client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("queue_class", "expected"),
    [
        (None, ["p9", "p1", "a", "c", "m1", "m9"]),
        ("scrapy_redis.queue.FifoQueue", ["a", "p1", "m1", "p9", "c", "m9"]),
        ("scrapy_redis.queue.LifoQueue", ["m9", "c", "p9", "m1", "p1", "a"]),
    ],
)
def test_the_scheduler_queues_each_request_with_its_priority(
    redis_url: str, redis_client: redis.Redis, queue_class: str | None, expected: list[str]
) -> None:
    """enqueue_request -> Redis -> the scheduler's own pop, in process: request.priority reaches the
    stage queue."""
    pushed = [("a", 0), ("p1", 1), ("m1", -1), ("p9", 9), ("c", 0), ("m9", -9)]

    async def main() -> None:
        settings = {
            "REDIS_URL": redis_url,
            "REDISLOCK_WORKER_STAGES": {"a": None},
            "CONCURRENT_REQUESTS": 3,
        }
        crawler = get_crawler(StagedSpider, {**settings, "SCHEDULER_QUEUE_CLASS": queue_class})
        crawler.spider = crawler._create_spider()
        crawler.engine = crawler._create_engine()
        scheduler = StageWorkerScheduler.from_crawler(crawler)
        scheduler.spider = crawler.spider
        try:
            for name, priority in pushed:
                request = scrapy.Request(
                    f"http://shop.test/a/{name}", priority=priority, meta={"redislock_stage": "a"}
                )
                assert scheduler.enqueue_request(request)
            await scheduler.outbox.sent()
            await scheduler.queues.beat("a")
            scheduler.state.current = "a"
            assert await scheduler.loop.fill() == 6
            got = [
                (request.url.rsplit("/", 1)[1], request.priority)
                for request, _ in scheduler.inflight.buffer
            ]
            assert got == [(name, dict(pushed)[name]) for name in expected]
        finally:
            await scheduler.queues.client.aclose()

    asyncio.run(main())


# -- what it costs Redis per request ---------------------------------------------------------------


def command_calls(client: redis.Redis) -> dict[str, int]:
    return {
        name.removeprefix("cmdstat_"): int(s["calls"])
        for name, s in client.info("commandstats").items()
    }


@pytest.mark.integration
def test_what_a_request_costs_redis_in_each_order(
    admin_url: str, redis_client: redis.Redis
) -> None:
    """INFO commandstats over 480 requests pushed in batches of 20 (a callback's output), popped 8
    at a time (half of CONCURRENT_REQUESTS 16) and acked 8 at a time, one stage: FIFO order (the
    previous version's commands, but for the sorted set's one ZRANGEBYSCORE at the pop that empties
    the list) against priority order with every request at priority 0 (the common case: one
    ZRANGEBYSCORE more per pop) and with priorities 1 to 3 (the sorted set: ZADD instead of LPUSH,
    one INCRBY per push call, ZRANGEBYSCORE and ZREM per pop)."""
    count, batch, take = 480, 20, 8

    async def run_once(order: str, priority: Callable[[int], int]) -> dict[str, int]:
        client = redis.asyncio.Redis.from_url(admin_url)
        queues = StageQueues(client, "cost", ["a"], worker="w", order=order)
        try:
            await queues.beat("a")
            before = command_calls(redis_client)
            for first in range(0, count, batch):
                entries = [
                    ("a", f"fp{n}", f"r{n}".encode(), priority(n))
                    for n in range(first, first + batch)
                ]
                await queues.push_many(entries)
            while popped := await queues.pop("a", take):
                await queues.ack([i for i, _ in popped])
            after = command_calls(redis_client)
            await queues.clear_if_alone()
        finally:
            await client.aclose()
        return {
            name: after[name] - before.get(name, 0)
            for name in after
            if after[name] != before.get(name, 0)
        }

    # loads the scripts (SCRIPT LOAD after a NOSCRIPT): not counted
    asyncio.run(run_once("fifo", lambda n: 0))
    costs = {
        "fifo": asyncio.run(run_once("fifo", lambda n: 0)),
        "priority, all 0": asyncio.run(run_once("priority", lambda n: 0)),
        "priority, 1 to 3": asyncio.run(run_once("priority", lambda n: 1 + n % 3)),
    }
    pops = count // take + 1  # the last one finds nothing
    for name, cost in costs.items():
        cost.pop("info", None)
        total = sum(cost.values())
        print(
            f"\n[figure] {name}: {total / count:.3f} commands per request "
            f"({dict(sorted(cost.items()))})"
        )
    fifo, zero, scored = costs.values()
    # Priority 0: one ZRANGEBYSCORE per pop (the priorities above 0), and one more (those below 0)
    # at the pop that finds the list short; FIFO only that last one. Nothing else differs.
    assert fifo["zrangebyscore"] == 1 and zero["zrangebyscore"] == pops + 1
    assert {k: v for k, v in zero.items() if k != "zrangebyscore"} == {
        k: v for k, v in fifo.items() if k != "zrangebyscore"
    }
    # Priorities 1 to 3: the sorted set instead of the list (ZADD, ZREM), one INCRBY per push call
    # for the order numbers, a ZCARD per push call (was the stage empty?), the same number of
    # scripts.
    assert (
        scored["zadd"] - zero["zadd"] == count and scored.get("lpush", 0) == zero["lpush"] - count
    )
    assert scored["incrby"] - zero["incrby"] == count // batch
    assert scored["zrem"] == count // take and scored["evalsha"] == zero["evalsha"]
