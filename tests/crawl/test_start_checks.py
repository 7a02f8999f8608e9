"""What a crawl checks at start, in real crawls (`scrapy runspider` processes) against a local site
and a real redis-server (issue 26):

- stage names known before any request (``@stage`` callbacks of the spider class,
  REDISLOCK_CALLBACK_STAGES, REDISLOCK_DEFAULT_STAGE) are checked against the front's stages
  (REDISLOCK_STAGES for the request front, REDISLOCK_WORKER_STAGES for the worker front): a
  ConfigError naming the stage and the callback, with the closest configured stage (before: an error
  per request, and the worker front finished with exit status 0);
- a configuration error ends the crawl with its one-line message and exit status 1, without
  asyncio's ``Task exception was never retrieved`` traceback;
- StageScheduler over scrapy-redis's scheduler works with scrapy-redis's documented settings
  (DUPEFILTER_CLASS left at Scrapy's default: scrapy-redis's dupefilter is used; before,
  ``AttributeError ... from_settings``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from testing.crawlproc import ROOT, Crawl, leftover
from testing.site import CrawlSite, links_page

pytestmark = [pytest.mark.integration, pytest.mark.crawl]
HERE = Path(__file__).resolve().parent
WORKER_SPIDER = ROOT / "testing" / "spiders" / "workerspider.py"
COMMENTS_WORKER = HERE / "startspiders.py"
RULES = ROOT / "testing" / "spiders" / "rulespider.py"
# the mixin sets its own
WORKER = {"SCHEDULER": None, "DOWNLOADER_MIDDLEWARES": None, "REDISLOCK_IDLE_CLOSE": 1}


def request_front(redis_url: str, **extra: Any) -> dict[str, Any]:
    return {"REDISLOCK_URL": redis_url, "CONCURRENT_REQUESTS": 8, **extra}


def worker_front(redis_url: str, **extra: Any) -> dict[str, Any]:
    return {**WORKER, "REDIS_URL": redis_url, "REDISLOCK_TTL": 2, "CONCURRENT_REQUESTS": 2, **extra}


def assert_one_line_config_error(crawl: Crawl, *expected: str) -> str:
    """Exit status 1, no traceback, and the ConfigError as one log line containing every
    ``expected`` text."""
    assert crawl.code == 1, crawl.tail()
    output = crawl.output
    assert "Traceback" not in output and "never retrieved" not in output, crawl.tail()
    lines = [line for line in output.splitlines() if "ConfigError" in line]
    assert len(lines) == 1, crawl.tail()
    for text in expected:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def run_all(crawls: list[tuple[Crawl, tuple[str, ...]]]) -> None:
    for crawl, _ in crawls:
        crawl.start()
    for crawl, expected in crawls:
        crawl.wait(timeout=90)
        assert_one_line_config_error(crawl, *expected)


def test_stage_names_known_at_start_are_checked_on_both_fronts(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """Each case stops the crawl at start naming the stage, where it comes from and the closest
    configured stage; nothing is fetched. Before: the request front failed the requests one by one
    (the @stage callback and the default stage here are not even used by the plan's requests: the
    crawls ran and exited 0), the worker front dropped them with an ERROR each and finished with
    exit status 0."""
    cases: list[tuple[Crawl, tuple[str, ...]]] = [
        (  # the test spider's parse_detail is @stage("detail")
            Crawl(
                site.url,
                "list:2",
                request_front(redis_url, REDISLOCK_STAGES={"list": 1, "details": 3}),
                tmp_path,
            ),
            (
                "callback PlanSpider.parse_detail (@stage) names stage 'detail'",
                "not in REDISLOCK_STAGES (did you mean 'details'?)",
            ),
        ),
        (
            Crawl(
                site.url,
                "list:2",
                request_front(
                    redis_url,
                    SCHEDULER=None,  # the middleware alone checks the same
                    REDISLOCK_STAGES={"list": 1, "detail": None},
                    REDISLOCK_CALLBACK_STAGES={"parse_list": "lists"},
                ),
                tmp_path,
            ),
            (
                "REDISLOCK_CALLBACK_STAGES['parse_list'] names stage 'lists'",
                "(did you mean 'list'?)",
            ),
        ),
        (  # a worker stage is not a request stage: each front is checked against its own stages
            Crawl(
                site.url,
                "list:2",
                request_front(
                    redis_url,
                    REDISLOCK_STAGES={"list": 1, "detail": None},
                    REDISLOCK_WORKER_STAGES={"comments": 2},
                    REDISLOCK_DEFAULT_STAGE="comments",
                ),
                tmp_path,
            ),
            ("REDISLOCK_DEFAULT_STAGE names stage 'comments', which is not in REDISLOCK_STAGES",),
        ),
        (
            Crawl(
                site.url,
                "list:2,comments:3",
                worker_front(redis_url, REDISLOCK_WORKER_STAGES={"list": 1, "detail": None}),
                tmp_path,
                spider=COMMENTS_WORKER,
            ),
            (
                "callback CommentsWorkerSpider.parse_comments (@stage) names stage 'comments'",
                "not in REDISLOCK_WORKER_STAGES (did you mean",
            ),
        ),
        (
            Crawl(
                site.url,
                "list:2",
                worker_front(
                    redis_url,
                    REDISLOCK_WORKER_STAGES={"list": 1, "detail": 2},
                    REDISLOCK_CALLBACK_STAGES={"parse": "detial"},
                ),
                tmp_path,
                spider=WORKER_SPIDER,
            ),
            ("REDISLOCK_CALLBACK_STAGES['parse'] names stage 'detial'", "(did you mean 'detail'?)"),
        ),
    ]
    run_all(cases)
    assert not site.hits
    assert leftover(redis_client) == 0


def test_configuration_errors_end_the_crawl_in_one_line_with_exit_status_1(
    redis_url: str, site: CrawlSite, tmp_path: Path
) -> None:
    """A bad value, a missing stage, StageScheduler without the middleware: on both fronts, whether
    the error comes while Scrapy builds the downloader (the middleware) or while the engine opens
    the spider (the schedulers, after which Scrapy's own clean-up raised ``RuntimeError: Engine slot
    not assigned``), the log has the ConfigError's message as one line and no traceback (before: ~30
    lines of ``Task exception was never retrieved``)."""
    bad_cap = "REDISLOCK_STAGES['detail'] must be an integer from 0 to 1000 or None (unlimited), got 'three'"
    cases: list[tuple[Crawl, tuple[str, ...]]] = [
        (
            Crawl(
                site.url,
                "detail:2",
                request_front(redis_url, REDISLOCK_STAGES={"detail": "three"}),
                tmp_path,
            ),
            (bad_cap,),
        ),
        (
            Crawl(
                site.url,
                "detail:2",
                request_front(
                    redis_url, REDISLOCK_STAGES={"detail": 3}, DOWNLOADER_MIDDLEWARES=None
                ),
                tmp_path,
            ),
            ("StageScheduler' needs the middleware too",),
        ),
        (
            Crawl(
                site.url,
                "a:2",
                worker_front(redis_url, REDISLOCK_WORKER_STAGES={"a": -1}),
                tmp_path,
                spider=WORKER_SPIDER,
            ),
            ("REDISLOCK_WORKER_STAGES['a'] must be an integer from 0 to 1000 or None",),
        ),
        (
            Crawl(site.url, "a:2", worker_front(redis_url), tmp_path, spider=WORKER_SPIDER),
            ("StagedSpider needs worker_stages",),
        ),
    ]
    run_all(cases)
    assert not site.hits


def test_stagescheduler_over_scrapy_redis_with_its_documented_settings(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """REDISLOCK_SCHEDULER_INNER = scrapy-redis's scheduler, DUPEFILTER_CLASS left at Scrapy's
    default: scrapy-redis's dupefilter is used (said at INFO), so two processes sharing the queue
    fetch each detail page once (a filter per process would fetch each twice). Set explicitly to
    Scrapy's filter, which scrapy-redis cannot build: a one-line ConfigError naming DUPEFILTER_CLASS
    and the value to use. Before: ``AttributeError: type object 'RFPDupeFilter' has no attribute
    'from_settings'`` and ``RuntimeError: Engine slot not assigned``, exit status 1."""
    site.routes["/list/0"] = links_page([f"/detail/{n}" for n in range(20)] * 2)
    extra = {
        "REDISLOCK_STAGES": {"list": 1, "detail": 3},
        "REDISLOCK_SCHEDULER_INNER": "scrapy_redis.scheduler.Scheduler",
        "REDIS_URL": redis_url,
        "SCHEDULER_PERSIST": True,  # the shared dupefilter outlives the first process to close
    }
    crawls = [
        Crawl(site.url, "", request_front(redis_url, **extra), tmp_path, spider=RULES)
        for _ in range(2)
    ]
    for crawl in crawls:
        crawl.start()
    for crawl in crawls:
        crawl.wait(timeout=90)
        assert crawl.code == 0 and crawl.stats["finish_reason"] == "finished", crawl.tail()
        assert (
            "it uses scrapy-redis's dupefilter (scrapy_redis.dupefilter.RFPDupeFilter)"
            in crawl.output
        )
        assert "Traceback" not in crawl.output, crawl.tail()
    assert [site.hits[f"/detail/{n}"] for n in range(20)] == [1] * 20
    assert redis_client.scard("rules:dupefilter") == 20
    assert sum(crawl.stats.get("redislock/detail/acquired", 0) for crawl in crawls) == 20
    assert leftover(redis_client) == 0

    refused = Crawl(
        site.url,
        "",
        request_front(redis_url, DUPEFILTER_CLASS="scrapy.dupefilters.RFPDupeFilter", **extra),
        tmp_path,
        spider=RULES,
    ).run(timeout=90)
    assert_one_line_config_error(
        refused,
        "DUPEFILTER_CLASS = 'scrapy.dupefilters.RFPDupeFilter'",
        "'scrapy_redis.dupefilter.RFPDupeFilter'",
    )
