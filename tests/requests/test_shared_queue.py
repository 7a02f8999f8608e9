"""StageScheduler over scrapy-redis's scheduler, three real processes on one shared Redis queue: the
queue stays shared. What a process has not started stays in Redis (a process started late gets work
at once; all processes together hold out of Redis no more than the stage's cap plus one request in
transit each: a capped request waits for its slot in the queue, since issue 43), and a SIGKILL loses
only what the killed process had taken: its requests in flight, and the one it had fetched ahead or
was moving from the spider's key to its stage's."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import scrapy
from redis.backoff import NoBackoff
from redis.retry import Retry
from scrapy.utils.test import get_crawler
from scrapy_redis.queue import PriorityQueue
from scrapy_redis.scheduler import Scheduler

from scrapy_redislock.lock.permit import LockKeys
from scrapy_redislock.requests.stagequeue import SharedStageQueues
from testing.clock import FakeClock
from testing.crawlproc import Crawl, leftover
from testing.netproxy import LatencyProxy
from testing.site import CrawlSite
from testing.spiders.crawlspider import PlanSpider
from testing.spiders.dropinspider import held_samples

pytestmark = [pytest.mark.integration, pytest.mark.crawl]
SEEDED = 150
CAP = 3
IN_TRANSIT = 1  # fetched ahead of the engine, or moving from the spider's key to its stage's


def seed(client: redis.Redis, base: str) -> None:
    """Detail requests in the spider's queue (``plan:requests``), as a scrapy-redis producer pushes
    them."""
    spider = PlanSpider(base=base)
    queue = PriorityQueue(client, spider, "%(spider)s:requests")
    for n in range(SEEDED):
        request = scrapy.Request(
            f"{base}/detail/{n}",
            meta={"redislock_stage": "detail"},
            priority=-n,
            callback=spider.parse,
            dont_filter=True,
        )
        queue.push(request)


def persisted_over_scrapy_redis(url: str) -> dict[str, Any]:
    """Settings of a crawl over scrapy-redis's shared queue, kept at close, detail capped."""
    return {
        "REDISLOCK_URL": url,
        "REDIS_URL": url,
        "REDISLOCK_STAGES": {"detail": CAP, "comments": None},
        "REDISLOCK_SCHEDULER_INNER": "scrapy_redis.scheduler.Scheduler",
        "DUPEFILTER_CLASS": "scrapy_redis.dupefilter.RFPDupeFilter",
        "SCHEDULER_PERSIST": True,
    }


def queued(client: redis.Redis) -> int:
    """Requests in the shared queue and its stage's queue, in one MULTI/EXEC (one moving is counted
    once). The keys are named, not scanned: a stage's key that is empty is gone, and a scan could
    miss it the instant a request moves into it."""
    pipe = client.pipeline(transaction=True)
    for key in ("plan:requests", "plan:requests:detail"):
        pipe.zcard(key)
    return sum(int(n) for n in pipe.execute())


def pending(client: redis.Redis, slots: str) -> list[dict[str, Any]]:
    """The grants held on a lock's slots stream (its consumer group's pending entries)."""
    return (
        list(client.xpending_range(slots, "holders", "-", "+", 1000))
        if client.exists(slots)
        else []
    )


def answered(site: CrawlSite, worker: str | None = None) -> int:
    with site.lock:
        return sum(1 for r in site.served if worker is None or r.worker == worker)


def reached(site: CrawlSite, worker: str) -> int:
    with site.lock:
        return (
            sum(1 for r in site.served if r.worker == worker)
            + site.workers_in_flight["detail"][worker]
        )


def test_the_queue_stays_shared_and_a_kill_loses_only_what_the_process_held(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    site.delay = 0.1
    seed(redis_client, site.url)
    crawls: dict[str, Crawl] = {}
    probes: dict[str, Path] = {}

    def start(name: str) -> None:
        probes[name] = tmp_path / f"held-{name}.jsonl"
        settings: dict[str, Any] = {
            "REDISLOCK_URL": redis_url,
            "REDISLOCK_STAGES": {"detail": CAP},
            "REDISLOCK_TTL": 5,  # the killed process's slots come back within 5 s
            "REDISLOCK_SCHEDULER_INNER": "scrapy_redis.scheduler.Scheduler",
            "DUPEFILTER_CLASS": "scrapy_redis.dupefilter.RFPDupeFilter",
            "REDIS_URL": redis_url,
            "SCHEDULER_PERSIST": True,
            "CONCURRENT_REQUESTS": 8,
            "USER_AGENT": name,
            "EXTENSIONS": {
                "testing.spiders.crawlspider.StatsFile": 0,
                "testing.spiders.dropinspider.HeldProbe": 0,
            },
            "HELD_PROBE_FILE": str(probes[name]),
        }
        crawls[name] = Crawl(site.url, "", settings, tmp_path).start()

    def opened(name: str) -> bool:
        return held_samples(probes[name])[0] is not None

    held_outside: list[int] = []

    def watch(condition: Any, timeout: float = 60) -> bool:
        """Wait for ``condition``, sampling what all processes hold out of Redis (seeded - queued -
        answered)."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                return False
            before = answered(site)
            in_redis = queued(redis_client)
            # no answer while Redis was read: the figures of one instant
            if answered(site) == before:
                held_outside.append(SEEDED - in_redis - before)
            time.sleep(0.02)
        return True

    try:
        start("p1")
        start("p2")
        assert watch(lambda: opened("p1") and opened("p2") and answered(site) >= 10), (
            "p1, p2 did not start crawling"
        )
        # Slow pages while the late process starts, so that a loaded machine's slow start of p3
        # still finds work in Redis (the queue drains at 1.5 pages/s meanwhile).
        site.delay = 2.0
        start("p3")
        assert watch(lambda: opened("p3")), crawls["p3"].tail()
        while True:  # one instant's figures: no answer while Redis was read
            answered_then = answered(site)
            queued_when_p3_opened = queued(redis_client)
            if answered(site) == answered_then:
                break
        site.delay = 0.1
        assert watch(lambda: reached(site, "p3") > 0), "the late process got no work"
        # It got work from what was still in Redis: the processes had taken no more than their
        # requests in flight (and one in transit each) into their memory. p3 may
        # have taken its own by the time its probe says it opened: it counts as one of them.
        assert queued_when_p3_opened > 0
        held_outside_redis = SEEDED - queued_when_p3_opened - answered_then
        assert held_outside_redis <= CAP + 3 * IN_TRANSIT, (
            held_outside_redis,
            queued_when_p3_opened,
        )
        assert watch(lambda: reached(site, "p1") > 0)
        killed_at = time.monotonic()
        crawls["p1"].signal(signal.SIGKILL)
        assert watch(
            lambda: all(
                c.process is not None and c.process.poll() is not None for c in crawls.values()
            ),
            120,
        )
    finally:
        for crawl in crawls.values():
            if crawl.process is not None and crawl.process.poll() is None:
                crawl.signal(signal.SIGKILL)
                crawl.wait()  # reaped here, not left running for a later test to warn about
    for name in ("p2", "p3"):
        crawls[name].wait()
        assert crawls[name].code == 0 and crawls[name].stats["finish_reason"] == "finished", crawls[
            name
        ].tail()
    # the killed process's last pages, answered
    assert site.wait_for(lambda: not site.in_flight, timeout=30)

    # Out of Redis at any instant: the requests in flight (the cap, for all processes) and each
    # process's one request fetched ahead or on its way from the spider's queue to its stage's (a
    # pop, then a push).
    assert held_outside and max(held_outside) <= CAP + 3 * IN_TRANSIT, max(held_outside)
    with site.lock:
        in_flight_at_kill = sum(
            1 for r in site.served if r.worker == "p1" and r.answered >= killed_at
        )
    never_fetched = SEEDED - len(site.hits)
    # Lost: what p1 had taken: its requests with a slot, at the site (their responses are lost) or
    # not there yet, and the one it may have fetched ahead or been moving from the spider's key to
    # its stage's (popped, not yet pushed), never sent.
    assert in_flight_at_kill + never_fetched <= CAP + IN_TRANSIT, (in_flight_at_kill, never_fetched)
    assert all(n == 1 for n in site.hits.values())  # nothing fetched twice
    assert queued(redis_client) == 0
    assert site.max_in_flight["detail"] <= CAP
    # Held in Redis now: at most the killed process's slots (the next process to wait would reap
    # them once their lease ran out); the others freed theirs.
    assert leftover(redis_client) <= CAP
    keys = LockKeys.of("redislock", "detail")
    owners = {
        owner.decode(): json.loads(raw) for owner, raw in redis_client.hgetall(keys.owners).items()
    }
    holders = {
        entry["consumer"].decode().rsplit("#", 1)[0] for entry in pending(redis_client, keys.slots)
    }
    assert {owners[owner]["pid"] for owner in holders} <= {crawls["p1"].process.pid}, (
        holders,
        owners,
    )


def test_nothing_blocks_the_reactor_over_a_redis_a_few_ms_away(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """Over scrapy-redis's queue with Redis 1 ms away each way (a LatencyProxy), no command of
    scrapy-redis's blocking client leaves from the reactor thread (its queue, its dupefilter, the
    queue's epoch: all in the queue thread), and the crawl is the same: every page fetched once,
    callbacks' requests through the dupefilter; then closed mid-way (CLOSESPIDER_TIMEOUT,
    SCHEDULER_PERSIST), every request not fetched is still in the shared queue, the one fetched
    ahead of the engine included."""
    port = urlsplit(redis_url).port
    assert port is not None
    site.delay = 0.02
    with LatencyProxy(port, delay=0.001) as proxy:
        url = redis_url.replace(f":{port}", f":{proxy.port}", 1)
        extra: dict[str, Any] = {
            **persisted_over_scrapy_redis(url),
            "CONCURRENT_REQUESTS": 8,
            "EXTENSIONS": {
                "testing.spiders.crawlspider.StatsFile": 0,
                "testing.reactorlag.BlockingRedisOnReactor": 0,
            },
        }
        crawl = Crawl(site.url, "detail:40", extra, tmp_path, args={"follow": "comments"}).run()
        stats = crawl.stats
        assert crawl.code == 0 and stats["finish_reason"] == "finished", crawl.tail()
        assert stats["test/redis_blocking_on_reactor"] == 0, stats.get(
            "test/redis_blocking_on_reactor_sample"
        )
        assert site.count("detail") == 40 and site.count("comments") == 40
        assert all(n == 1 for n in site.hits.values())
        assert stats["scheduler/dequeued/redis"] == 80
        assert site.max_in_flight["detail"] <= CAP

        redis_client.delete("plan:dupefilter")
        site.hits.clear()
        site.delay = 0.2
        crawl = Crawl(site.url, "detail:100", {**extra, "CLOSESPIDER_TIMEOUT": 1.5}, tmp_path).run()
        stats = crawl.stats
        assert stats["finish_reason"] == "closespider_timeout", crawl.tail()
        assert stats["test/redis_blocking_on_reactor"] == 0, stats.get(
            "test/redis_blocking_on_reactor_sample"
        )
    fetched = sum(site.hits.values())
    assert 0 < fetched < 100
    assert queued(redis_client) == 100 - fetched


def test_what_an_earlier_crawl_queued_under_a_capped_stage_is_crawled_once_it_is_not_capped(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """A crawl with detail capped stops mid-way with SCHEDULER_PERSIST: its detail requests wait in
    the stage's own key in Redis. The next crawl, with no start requests of its own, has detail
    uncapped: it reads that key until it is empty, every page is fetched once over the two crawls,
    and nothing is left in Redis. It finished cleanly before with those requests unread, and they
    stayed in Redis."""
    site.delay = 0.2
    extra = persisted_over_scrapy_redis(redis_url)
    crawl = Crawl(site.url, "detail:40", {**extra, "CLOSESPIDER_TIMEOUT": 1.5}, tmp_path).run()
    assert crawl.stats["finish_reason"] == "closespider_timeout", crawl.tail()
    assert redis_client.zcard("plan:requests:detail") > 0
    site.delay = 0.01
    uncapped = {**extra, "REDISLOCK_STAGES": {"detail": None, "comments": None}}
    crawl = Crawl(site.url, "", uncapped, tmp_path).run()
    assert crawl.code == 0 and crawl.stats["finish_reason"] == "finished", crawl.tail()
    assert queued(redis_client) == 0
    assert site.count("detail") == 40 and all(n == 1 for n in site.hits.values()), site.hits
    assert "Stage 'detail' is not capped in this process" in crawl.output


class OpenStages:
    """Every sub-queue may go; a request's stage is its meta's ``redislock_stage``."""

    def route(self, request: scrapy.Request) -> tuple[str | None, None]:
        return (request.meta.get("redislock_stage"), None)

    def may_go(self, route: tuple[str | None, None]) -> bool:
        return True


@pytest.mark.faults
@pytest.mark.parametrize("then", ["asked-again", "closed"])
def test_a_pop_whose_reply_was_lost_answers_the_same_request_when_asked_again(
    redis_url: str, redis_client: redis.Redis, redis_proxy: Callable[[], LatencyProxy], then: str
) -> None:
    """scrapy-redis's queue split by stage, its client behind a network that carries commands but
    loses the replies: the pop of the first request runs in Redis and its reply never comes (an
    outage: nothing popped). Once Redis answers, the pop asked again answers that same request (its
    record in Redis), and the second is still queued; the record goes when the queue closes. Closed
    before that pop is asked again, the queue still has the request, and it goes back to its place.
    scrapy-redis's own pop took the second then, and the first was gone without a word. Driven
    synchronously (no queue thread: the same pop as in it), so the lost reply is the pop's."""
    proxy = redis_proxy()
    port = urlsplit(redis_url).port
    crawler = get_crawler(
        PlanSpider,
        {
            "REDIS_URL": redis_url.replace(f":{port}", f":{proxy.port}", 1),
            "DUPEFILTER_CLASS": "scrapy_redis.dupefilter.RFPDupeFilter",
            # one try, and a timeout no busy machine's reply reaches once the network is back
            "REDIS_PARAMS": {"socket_timeout": 2.0, "retry": Retry(NoBackoff(), 0)},
        },
    )
    spider = PlanSpider(base="http://shop.test")
    spider._set_crawler(crawler)
    inner = Scheduler.from_crawler(crawler)
    inner.open(spider)
    clock = FakeClock()  # the sub-queues' pauses
    shared = SharedStageQueues(
        inner.queue,
        ["detail"],
        OpenStages(),
        prefix="redislock",
        asked_while_paused=lambda _: None,
        clock=clock,
    )
    assert shared.pop() is None  # both found empty: the spider's own key paused
    first, second = (
        scrapy.Request(
            f"http://shop.test/detail/{n}", meta={"redislock_stage": "detail"}, priority=p
        )
        for n, p in ((1, 10), (2, 0))
    )
    shared.push(first)  # detail's pause ends
    shared.push(second)
    key = "plan:requests:detail"
    assert redis_client.zcard(key) == 2
    proxy.blackhole("down")
    assert shared.pop() is None  # detail's pop ran, its reply lost: an outage
    assert redis_client.zcard(key) == 1
    clock.advance(60)  # past the outage's pause
    proxy.heal()
    assert shared.has_requests()  # the first is in the record only
    if then == "asked-again":
        taken = shared.pop()
        assert taken is not None and taken.url == first.url
        assert redis_client.zcard(key) == 1 and redis_client.keys("redislock:shared:*:popped:*")
        assert shared.close() == 0
    else:
        assert shared.close() == 0
        # back to its place, ahead of the second
        assert [
            shared.queues["detail"]._decode_request(d).url for d in redis_client.zrange(key, 0, -1)
        ] == [
            first.url,
            second.url,
        ]
    assert not redis_client.keys("redislock:shared:*:popped:*")
    redis_client.delete(key, "plan:requests")
