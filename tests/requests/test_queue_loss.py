"""StageScheduler over scrapy-redis's shared queue when Redis loses it (restarted empty mid-crawl):
the crawl says so once at ERROR, counts it, finishes as redislock_queue_lost with exit status 1, and
what was scheduled while Redis was down is kept in memory and queued once it is back (no "Task
exception was never retrieved")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
from scrapy import Request
from scrapy_redis import picklecompat

from scrapy_redislock.crawl.epoch import SharedQueueKeys
from testing.crawlproc import Crawl
from testing.redis_server import RedisServer
from testing.site import CrawlSite

pytestmark = [pytest.mark.integration, pytest.mark.crawl, pytest.mark.faults]
LOST = "Redis lost the shared queue of spider 'plan'"


def shared(url: str, **extra: Any) -> dict[str, Any]:
    return {
        "REDISLOCK_URL": url,
        "REDIS_URL": url,
        "REDISLOCK_STAGES": {"detail": 3, "comments": 3},
        "REDISLOCK_SCHEDULER_INNER": "scrapy_redis.scheduler.Scheduler",
        "DUPEFILTER_CLASS": "scrapy_redis.dupefilter.RFPDupeFilter",
        "CONCURRENT_REQUESTS": 8,
        **extra,
    }


def errors(crawl: Crawl, text: str) -> list[str]:
    return [line for line in crawl.lines if " ERROR: " in line and text in line]


def test_redis_restarted_empty_mid_crawl_is_no_clean_finish(
    site: CrawlSite, tmp_path: Path
) -> None:
    """Redis killed mid-crawl (callbacks schedule requests meanwhile, through scrapy-redis's
    dupefilter) and restarted empty: the queued details are gone. One ERROR says so, the requests
    scheduled during the outage are queued once Redis is back (and fetched), and the crawl finishes
    as redislock_queue_lost, exit status 1, with no unretrieved task exception."""
    site.delay = 0.3
    with RedisServer() as server:
        crawl = Crawl(
            site.url, "detail:300", shared(server.url), tmp_path, args={"follow": "comments"}
        ).start()
        try:
            assert crawl.wait_for_output("Stage slots in Redis at", timeout=60), crawl.tail()
            assert site.wait_for(lambda: site.count("detail") >= 20, timeout=60), crawl.tail()
            client = redis.Redis.from_url(server.url)
            assert client.get(SharedQueueKeys.of("redislock", "plan:requests").epoch) is not None
            client.close()
            assert site.wait_for(lambda: site.in_flight["detail"] > 0, timeout=30)
            server.kill()
            # what was in flight answers, and its callback schedules a comments request: kept in memory
            assert crawl.wait_for_output("are kept in memory", timeout=30), crawl.tail()
            server.start()
        finally:
            crawl.wait(timeout=120)  # killed if it does not end: no crawl left behind
    stats = crawl.stats
    assert stats["finish_reason"] == "redislock_queue_lost", crawl.tail()
    assert crawl.code == 1, crawl.tail()
    assert stats["redislock/queue_lost"] == 1
    assert len(errors(crawl, LOST)) == 1, crawl.tail()
    assert "Task exception was never retrieved" not in crawl.output, crawl.tail()
    assert "Traceback" not in crawl.output, crawl.tail()
    assert site.count("detail") < 300  # lost with the queue
    # scheduled while Redis did not answer: queued once it was back, and fetched
    assert stats.get("redislock/queue_held", 0) >= 1, crawl.tail()
    assert not stats.get("redislock/queue_unqueued"), crawl.tail()
    assert site.count("comments") >= stats["redislock/queue_held"]


def test_a_crawl_with_no_loss_finishes_cleanly(site: CrawlSite, tmp_path: Path) -> None:
    """The epoch is read at start and at every tick, and a crawl that lost nothing finishes as
    before."""
    with RedisServer() as server:
        crawl = Crawl(
            site.url, "detail:30", shared(server.url), tmp_path, args={"follow": "comments"}
        ).run()
    assert crawl.stats["finish_reason"] == "finished", crawl.tail()
    assert crawl.code == 0
    assert "redislock/queue_lost" not in crawl.stats
    assert site.count("detail") == 30 and site.count("comments") == 30


def test_a_request_scrapy_redis_cannot_queue_is_lost_loudly(
    site: CrawlSite, tmp_path: Path
) -> None:
    """A request scrapy-redis's serializer refuses (meta it cannot pickle) is not queued: the
    crawl says so at ERROR naming the request, counts it, goes on with the others and finishes as
    redislock_queue_lost with exit status 1, never as a clean finish."""
    with RedisServer() as server:
        crawl = Crawl(
            site.url,
            "detail:10",
            shared(server.url),
            tmp_path,
            args={"follow": "comments", "unqueueable": "3,7"},
        ).run()
    stats = crawl.stats
    assert stats["finish_reason"] == "redislock_queue_lost", crawl.tail()
    assert crawl.code == 1, crawl.tail()
    assert stats["redislock/queue_unqueueable"] == 2, crawl.tail()
    lines = errors(crawl, "scrapy-redis could not queue <GET ")
    assert sorted(line.split("<GET ")[1].split(">")[0].rsplit("/", 1)[1] for line in lines) == [
        "3",
        "7",
    ], crawl.tail()
    assert "redislock/queue_lost" not in stats
    assert site.count("detail") == 10 and site.count("comments") == 8


def test_a_queued_request_that_cannot_be_read_back_is_lost_loudly(
    site: CrawlSite, tmp_path: Path
) -> None:
    """A request in the shared queue that scrapy-redis cannot read back (queued by another version
    of the spider, whose callback this one no longer has): popped, it is out of Redis and lost. The
    crawl says so at ERROR with its first bytes, counts it, goes on with the others and finishes as
    redislock_queue_lost with exit status 1 (it was a traceback and a clean finish)."""
    with RedisServer() as server:
        old = Request(f"{site.url}/detail/old").to_dict()
        old["callback"] = "parse_gone"
        redis.Redis.from_url(server.url).zadd("plan:requests", {picklecompat.dumps(old): 0})
        crawl = Crawl(site.url, "detail:10", shared(server.url), tmp_path).run()
    stats = crawl.stats
    assert stats["finish_reason"] == "redislock_queue_lost", crawl.tail()
    assert crawl.code == 1, crawl.tail()
    assert stats["redislock/queue_unreadable"] == 1, crawl.tail()
    (line,) = errors(crawl, "A request popped from plan:requests could not be read back")
    assert "parse_gone" in line
    assert site.count("detail") == 10
