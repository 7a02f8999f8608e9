"""``ADDONS = {"scrapy_redislock.Addon": ...}``: the request front in one line. In-process with
``get_crawler`` (no I/O), as Scrapy's own add-on tests; then two real processes sharing a
scrapy-redis queue through the add-on alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
import scrapy
from scrapy import Spider
from scrapy.utils.test import get_crawler
from scrapy_redis.queue import PriorityQueue

from scrapy_redislock import Addon, ConfigError
from testing.crawlproc import Crawl, leftover
from testing.site import CrawlSite
from testing.spiders.crawlspider import PlanSpider

ADDONS = {"ADDONS": {"scrapy_redislock.Addon": 100}}


def settings_of(**extra: Any) -> Any:
    return get_crawler(Spider, {**ADDONS, **extra}).settings


def test_it_enables_the_middleware_and_wraps_scrapys_scheduler() -> None:
    settings = settings_of()
    assert settings["SCHEDULER"] == "scrapy_redislock.StageScheduler"
    assert settings["REDISLOCK_SCHEDULER_INNER"] == "scrapy.core.scheduler.Scheduler"
    assert settings.getdict("DOWNLOADER_MIDDLEWARES")["scrapy_redislock.StageLockMiddleware"] == 950


def test_it_wraps_the_projects_scheduler_scrapy_redis_s_included() -> None:
    settings = settings_of(SCHEDULER="scrapy_redis.scheduler.Scheduler")
    assert settings["SCHEDULER"] == "scrapy_redislock.StageScheduler"
    assert settings["REDISLOCK_SCHEDULER_INNER"] == "scrapy_redis.scheduler.Scheduler"


def test_a_front_set_up_by_hand_is_left_as_it_is() -> None:
    settings = settings_of(
        SCHEDULER="scrapy_redislock.StageScheduler",
        REDISLOCK_SCHEDULER_INNER="scrapy_redis.scheduler.Scheduler",
        DOWNLOADER_MIDDLEWARES={"scrapy_redislock.StageLockMiddleware": 800},
    )
    assert settings["REDISLOCK_SCHEDULER_INNER"] == "scrapy_redis.scheduler.Scheduler"
    assert settings.getdict("DOWNLOADER_MIDDLEWARES") == {
        "scrapy_redislock.StageLockMiddleware": 800
    }


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"SCHEDULER": "scrapy_redislock.StageWorkerScheduler"}, "is the worker front's"),
        (
            {
                "SCHEDULER": "scrapy_redis.scheduler.Scheduler",
                "REDISLOCK_SCHEDULER_INNER": "scrapy.core.scheduler.Scheduler",
            },
            "REDISLOCK_SCHEDULER_INNER = 'scrapy.core.scheduler.Scheduler' names another",
        ),
    ],
)
def test_what_it_cannot_wrap_it_refuses(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        settings_of(**extra)


def test_it_is_a_public_name() -> None:
    assert Addon.__module__ == "scrapy_redislock.requests.addon"


@pytest.mark.integration
@pytest.mark.crawl
def test_two_processes_share_a_scrapy_redis_queue_with_the_add_on_alone(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """The quickstart's shared setup: SCHEDULER is scrapy-redis's, ADDONS has ours; the cap holds
    at the site and every page is fetched once across the two processes."""
    site.delay = 0.05
    spider = PlanSpider(base=site.url)
    queue = PriorityQueue(redis_client, spider, "%(spider)s:requests")
    for n in range(40):  # what a scrapy-redis producer pushes
        queue.push(
            scrapy.Request(
                f"{site.url}/detail/{n}", meta={"redislock_stage": "detail"}, callback=spider.parse
            )
        )
    settings = {
        **ADDONS,
        "DOWNLOADER_MIDDLEWARES": None,  # the harness's own front: the add-on's instead
        "SCHEDULER": "scrapy_redis.scheduler.Scheduler",
        "DUPEFILTER_CLASS": "scrapy_redis.dupefilter.RFPDupeFilter",
        "SCHEDULER_PERSIST": False,
        "REDIS_URL": redis_url,
        "REDISLOCK_URL": redis_url,
        "REDISLOCK_STAGES": {"detail": 2},
        "CONCURRENT_REQUESTS": 8,
    }
    crawls = [Crawl(site.url, "", settings, tmp_path).start() for _ in range(2)]
    for crawl in crawls:
        crawl.wait(timeout=120)
        assert crawl.code == 0 and crawl.stats["finish_reason"] == "finished", crawl.tail()
        assert "scrapy_redislock.requests.addon.Addon" in crawl.output
    assert site.hits and all(n == 1 for n in site.hits.values()), site.hits
    assert len(site.hits) == 40  # from the shared queue in Redis, each page once
    assert site.max_in_flight["detail"] <= 2
    assert leftover(redis_client) == 0
