"""A graceful close loses no request StageScheduler holds but never sent (issue 39): a request
that waits for its stage's slot waits in the inner scheduler's queue (since issue 43; before, up to
REDISLOCK_WAITERS_PER_STAGE of them waited in the middleware and went back to the queue at close),
and one that waits for its key's slot in the middleware goes back to the queue before it closes, so
scrapy-redis's SCHEDULER_PERSIST and Scrapy's JOBDIR keep them for the next run. Real crawls
(``scrapy runspider``) against the local site, a real Redis, closed by CLOSESPIDER_TIMEOUT."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from scrapy_redislock import CountingLock
from testing.crawlproc import Crawl, leftover
from testing.site import CrawlSite

pytestmark = [pytest.mark.integration, pytest.mark.crawl]
PAGES = 12


def settings(redis_url: str, **more: Any) -> dict[str, Any]:
    """Cap 1, closed by CLOSESPIDER_TIMEOUT while requests wait; over scrapy-redis with
    SCHEDULER_PERSIST unless ``more`` says otherwise."""
    return {
        "REDISLOCK_URL": redis_url,
        "REDISLOCK_STAGES": {"detail": 1},
        "REDISLOCK_SCHEDULER_INNER": "scrapy_redis.scheduler.Scheduler",
        "DUPEFILTER_CLASS": "scrapy_redis.dupefilter.RFPDupeFilter",
        "REDIS_URL": redis_url,
        "SCHEDULER_PERSIST": True,
        "CONCURRENT_REQUESTS": 8,
        "CLOSESPIDER_TIMEOUT": 2,
        # a stage that frees no slot for REDISLOCK_TTL (3) + DOWNLOAD_TIMEOUT counts as stalled
        "DOWNLOAD_TIMEOUT": 5,
        **more,
    }


def answered(site: CrawlSite) -> int:
    """Pages the site answered."""
    with site.lock:
        return sum(1 for record in site.served if record.stage == "detail")


def queued(client: redis.Redis) -> int:
    """Requests left in scrapy-redis's queue of the spider (``plan:requests``, and the part of it
    StageScheduler keeps for the capped stage, ``plan:requests:detail``)."""
    return sum(int(client.zcard(key)) for key in ("plan:requests", "plan:requests:detail"))


@contextmanager
def slot_held_elsewhere(redis_url: str) -> Iterator[None]:
    """Another process holds the stage's only slot (renewed) for the whole crawl."""
    rival = CountingLock(redis.Redis.from_url(redis_url), "detail", limit=1, auto_renew=True)
    permit = rival.acquire(10)
    try:
        yield
    finally:
        rival.release(permit)
        rival.close()


def test_requests_waiting_for_a_slot_at_close_stay_in_the_persistent_redis_queue(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """The acceptance scenario: pages of 0.8 s, cap 1: one page downloads while the others wait
    for the slot in the queue when CLOSESPIDER_TIMEOUT closes the spider (before issue 39: two
    waited in the middleware, took the slot and were fetched during the close). Pages answered
    plus requests left in the queue: every request made, none lost; none had left the scheduler
    to wait."""
    crawl = Crawl(site.url, f"detail:{PAGES}:sleep=0.8", settings(redis_url), tmp_path).run()
    assert crawl.code == 0, crawl.tail()
    stats = crawl.stats
    assert stats["finish_reason"] == "closespider_timeout"
    assert stats["scheduler/enqueued/redis"] == PAGES  # every request made reached the scheduler
    assert answered(site) + queued(redis_client) == PAGES, crawl.tail()
    assert "redislock/detail/given_back_at_close" not in stats, crawl.tail()
    assert leftover(redis_client) == 0


def test_requests_waiting_for_a_slot_held_elsewhere_stay_in_the_persistent_redis_queue(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """Another process holds the stage's only slot: nothing is fetched, every request waits in the
    queue when the spider closes (before issue 39: two waited in the middleware and were dropped
    once the stage had stalled, REDISLOCK_TTL + DOWNLOAD_TIMEOUT, lost); every request made is in
    the queue afterwards."""
    with slot_held_elsewhere(redis_url):
        crawl = Crawl(site.url, f"detail:{PAGES}", settings(redis_url), tmp_path).run()
    assert crawl.code == 0, crawl.tail()
    stats = crawl.stats
    assert stats["scheduler/enqueued/redis"] == PAGES
    assert answered(site) == 0
    assert queued(redis_client) == PAGES, crawl.tail()
    assert "redislock/detail/given_back_at_close" not in stats  # none left the scheduler
    assert "redislock/detail/dropped_at_close" not in stats
    assert leftover(redis_client) == 0


def test_with_jobdir_the_next_run_fetches_the_requests_that_waited_at_close(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """Over Scrapy's scheduler with JOBDIR: the first run is closed while every request waits (the
    slot held elsewhere); the second run, with the slot free and no start requests of its own,
    fetches from the JOBDIR every page once."""
    jobdir = str(tmp_path / "job")
    first = settings(redis_url, JOBDIR=jobdir, REDISLOCK_SCHEDULER_INNER=None)
    first.update(DUPEFILTER_CLASS=None, REDIS_URL=None, SCHEDULER_PERSIST=None)
    with slot_held_elsewhere(redis_url):
        crawl = Crawl(site.url, f"detail:{PAGES}", first, tmp_path).run()
    assert crawl.code == 0, crawl.tail()
    assert answered(site) == 0
    resumed = Crawl(site.url, "", {**first, "CLOSESPIDER_TIMEOUT": None}, tmp_path).run()
    assert resumed.code == 0, resumed.tail()
    assert dict(site.hits) == {f"/detail/{n}": 1 for n in range(PAGES)}, resumed.tail()
    assert "redislock/detail/given_back_at_close" not in crawl.stats, crawl.tail()
    assert leftover(redis_client) == 0


def test_requests_waiting_for_a_key_slot_at_close_stay_in_the_persistent_redis_queue(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """Over scrapy-redis a request waits for its key's slot in the middleware (its queue is not
    split by key): one host capped at 1, pages of 0.8 s; those waiting when the spider closes go
    back to the queue too (before: each took the key's slot in turn during the close)."""
    keyed = settings(
        redis_url,
        REDISLOCK_STAGES={"detail": None},
        REDISLOCK_STAGE_KEY="domain",
        REDISLOCK_KEY_LIMIT=1,
    )
    crawl = Crawl(site.url, f"detail:{PAGES}:sleep=0.8", keyed, tmp_path).run()
    assert crawl.code == 0, crawl.tail()
    stats = crawl.stats
    given_back = stats.get("redislock/keys/given_back_at_close", 0)
    assert given_back >= 1, crawl.tail()
    # each request given back is counted as queued again, as its next pop counts it as dequeued:
    # enqueued less dequeued is what the queue holds
    assert stats["scheduler/enqueued/redis"] == PAGES + given_back
    left = stats["scheduler/enqueued/redis"] - stats.get("scheduler/dequeued/redis", 0)
    assert left == queued(redis_client)
    assert answered(site) + queued(redis_client) == PAGES, crawl.tail()
    assert leftover(redis_client) == 0


def test_requests_waiting_for_their_start_at_close_go_back_to_the_queue_at_once(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """One host keeps 30 s between starts (a long Crawl-delay, say): when CLOSESPIDER_TIMEOUT
    closes the spider 2 s in, the requests sleeping on the host's delay in the middleware go back
    to scrapy-redis's queue, and the close does not wait out their delays (before, it waited for
    each in turn: 30 s a request)."""
    delayed = settings(
        redis_url,
        REDISLOCK_STAGES={"detail": None},
        REDISLOCK_STAGE_KEY="domain",
        REDISLOCK_DELAY=30,
        CONCURRENT_REQUESTS=4,
    )
    crawl = Crawl(site.url, f"detail:{PAGES}", delayed, tmp_path).run()
    assert crawl.code == 0, crawl.tail()
    stats = crawl.stats
    assert answered(site) == 1  # the host's first start; every other waits 30 s
    assert answered(site) + queued(redis_client) == PAGES, crawl.tail()
    assert stats.get("redislock/keys/given_back_at_close", 0) >= 1, crawl.tail()
    assert (
        "given back to the scheduler while waiting for its start of key '127.0.0.1'" in crawl.output
    )
    assert stats["elapsed_time_seconds"] < 20, crawl.tail()
    assert leftover(redis_client) == 0
