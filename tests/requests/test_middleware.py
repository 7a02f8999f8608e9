"""StageLockMiddleware in real crawls (`scrapy runspider` processes) against a local HTTP server and
a real redis-server: caps on its own, release on every outcome, close / SIGTERM / SIGKILL, Redis
outages, bad settings, reactors, scheduler bypass."""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import scrapy

from scrapy_redislock.lock import CountingLock
from scrapy_redislock.lock.core import release_consumer
from scrapy_redislock.lock.permit import LockKeys
from scrapy_redislock.lock.protocol import drive
from testing.crawlproc import Crawl, leftover
from testing.redis_server import RedisServer
from testing.site import CrawlSite

pytestmark = [pytest.mark.integration, pytest.mark.crawl]
STAGES = {"detail": 3, "comments": None}
# with the stage-aware scheduler, and the middleware alone
BOTH = ("scrapy_redislock.StageScheduler", None)


def settings(redis_url: str, **extra: Any) -> dict[str, Any]:
    return {
        "REDISLOCK_URL": redis_url,
        "REDISLOCK_STAGES": STAGES,
        "CONCURRENT_REQUESTS": 16,
        **extra,
    }


def test_middleware_alone_caps_but_a_full_stage_holds_up_the_others(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """Without StageScheduler the caps hold, and the price is head-of-line blocking (why the
    scheduler exists)."""
    crawl = Crawl(
        site.url, "detail:150,comments:50", settings(redis_url, SCHEDULER=None), tmp_path
    ).run()
    assert crawl.stats["finish_reason"] == "finished", crawl.tail()
    assert site.max_in_flight["detail"] == 3
    assert crawl.stats["redislock/detail/acquired"] == 150
    first_comment = min(site.arrivals["comments"]) - min(site.arrivals["detail"])
    # 150 - 16 details must finish (3 at a time, 50 ms each) before a comment gets a downloader
    # slot: > 2 s.
    assert first_comment > 2.0, first_comment
    assert crawl.stats["test/pending_at_engine_stop"] == 0
    assert leftover(redis_client) == 0


@pytest.mark.parametrize("scheduler", BOTH, ids=["scheduler", "middleware-alone"])
def test_slot_released_on_every_outcome(
    scheduler: str | None,
    redis_url: str,
    redis_client: redis.Redis,
    site: CrawlSite,
    tmp_path: Path,
) -> None:
    """Response, download timeout (retried: the copy gets its own slot), IgnoreRequest or a response
    from a later middleware, and requests an earlier middleware answers or drops (the scheduler's
    slot came with them)."""
    plan = ",".join(
        [
            "detail:6",
            "detail@slow:3:sleep=3",  # DOWNLOAD_TIMEOUT 1 s, retried once; the site counts them apart
            "detail:2:drop=late",
            "detail:2:answer=late",
            "detail:2:drop=early",
            "detail:2:answer=early",
            "detail:6",
        ]
    )
    extra = {
        "SCHEDULER": scheduler,
        "REDISLOCK_STAGES": {"detail": 2},
        "DOWNLOAD_TIMEOUT": 1,
        "RETRY_ENABLED": True,
        "RETRY_TIMES": 1,
        "DOWNLOADER_MIDDLEWARES": {
            "scrapy_redislock.StageLockMiddleware": 950,
            "testing.spiders.crawlspider.EarlyOutcomes": 100,
            "testing.spiders.crawlspider.LateOutcomes": 960,
        },
    }
    crawl = Crawl(site.url, plan, settings(redis_url, **extra), tmp_path).run()
    stats = crawl.stats
    assert stats["finish_reason"] == "finished", crawl.tail()
    # (The server goes on with a timed-out request after the client gave it up, so it counts those
    # apart.)
    assert site.max_in_flight["detail"] <= 2
    # Scrapy 2.19 raises DownloadTimeoutError; older ones Twisted's TimeoutError.
    timeouts = stats.get("test/errback/DownloadTimeoutError", 0) + stats.get(
        "test/errback/TimeoutError", 0
    )
    assert stats["retry/count"] == 3 and timeouts == 3
    assert stats["test/errback/IgnoreRequest"] == 4
    assert sum(n for path, n in site.hits.items() if path.startswith("/detail/")) == 12
    # each timed out twice
    assert sum(n for path, n in site.hits.items() if path.startswith("/slow/")) == 6
    # everything that got to the middleware: plain, slow and retried, late outcomes
    reached = 12 + 6 + 4
    # With the scheduler, those dropped or answered before our middleware took a slot only when they
    # left the scheduler with one in hand (a slot passed on by a finished request); the others went
    # in line without one.
    early = 0 if scheduler is None else 4
    assert reached <= stats["redislock/detail/acquired"] <= reached + early
    assert stats["test/pending_at_engine_stop"] == 0
    assert leftover(redis_client) == 0


def test_close_and_sigterm_do_not_hang(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """CLOSESPIDER_TIMEOUT and SIGTERM while requests wait (in the middleware or parked): the spider
    closes at once, every slot and waiter of the process is freed before the spider_closed handlers
    finish."""
    site.delay = 0.3
    timed = {
        scheduler: Crawl(
            site.url,
            "detail:200,comments:5",
            settings(
                redis_url,
                SCHEDULER=scheduler,
                REDISLOCK_STAGES={"detail": 1, "comments": None},
                CLOSESPIDER_TIMEOUT=2,
            ),
            tmp_path,
        ).start()
        for scheduler in BOTH
    }
    for crawl in timed.values():
        crawl.wait(timeout=60)
        assert crawl.stats["finish_reason"] == "closespider_timeout", crawl.tail()
        # from the engine's start to its stop (not the interpreter's start-up, which a busy machine
        # stretches): 2 s and the close, where waiting for the queued requests would take 60 s
        assert crawl.stats["elapsed_time_seconds"] < 12, crawl.stats["elapsed_time_seconds"]
    assert site.max_in_flight["detail"] == 1
    assert leftover(redis_client) == 0

    for scheduler in BOTH:
        crawl = Crawl(
            site.url, "detail:100,comments:5", settings(redis_url, SCHEDULER=scheduler), tmp_path
        ).start()
        assert site.wait_for(lambda: leftover(redis_client) == 3, timeout=30)
        time.sleep(0.5)
        stopped = time.monotonic()
        crawl.signal(signal.SIGTERM)
        crawl.wait(timeout=30)
        assert time.monotonic() - stopped < 12  # waiting for the queued requests would take 30 s
        assert crawl.stats["finish_reason"] == "shutdown", crawl.tail()
        assert crawl.stats["test/pending_at_engine_stop"] == 0
        assert leftover(redis_client) == 0


def test_killed_crawler_slots_return_after_the_ttl(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    site.delay = 0.2
    extra = {"REDISLOCK_TTL": 1.5}
    victim = Crawl(site.url, "detail:200", settings(redis_url, **extra), tmp_path).start()
    assert site.wait_for(lambda: leftover(redis_client) == 3, timeout=30)
    victim.signal(signal.SIGKILL)
    victim.wait()
    killed = time.monotonic()
    before = site.count("detail")
    survivor = Crawl(site.url, "detail:5", settings(redis_url, **extra), tmp_path).start()
    assert survivor.wait_for_output("Stage slots in Redis at")
    ready = time.monotonic()  # its start-up took this long (seconds on a busy machine)
    survivor.wait()
    assert survivor.stats["finish_reason"] == "finished", survivor.tail()
    first_after = site.arrivals["detail"][before]
    # The dead crawler's slots come back after the ttl + a renew interval; the survivor asks once it
    # is up.
    assert first_after - max(killed + 1.5 + 0.5, ready) < 3.0
    # all three come back: the survivor may finish its 5 pages on the slots it got before the dead
    # crawler's last lease ran out (a grant of its taken after the last renewal), and that grant is
    # reclaimed by the next take, not by the survivor's close (CI's rehearsal, loaded: 1 left). The
    # probe's ttl is the crawlers': a lock's lease is its owners' longest ttl, so a probe of 30 s would
    # hold that grant for 30 s (CI: not all three free after 10 s)
    probe = CountingLock(redis_client, "detail", 3, 1.5, maintain_loop=False)

    def all_three_free() -> bool:
        permits = [probe.try_acquire() for _ in range(3)]
        for permit in permits:
            if permit is not None:
                probe.release(permit)
        return None not in permits

    try:
        assert site.wait_for(all_three_free, timeout=10, step=0.05)
    finally:
        probe.close()
    assert leftover(redis_client) == 0


def test_lost_lease_is_logged_and_counted(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """An operator frees the crawl's grants while it downloads: its next renewal finds them lost."""
    site.delay = 1.5
    crawl = Crawl(site.url, "detail:6", settings(redis_url), tmp_path).start()
    # downloading with its 3 slots (a grant is the crawl's once confirmed: one freed before that
    # is not lost, its wait goes on)
    assert site.wait_for(lambda: site.in_flight["detail"] == 3, timeout=30)
    assert leftover(redis_client) == 3
    keys = LockKeys.of("redislock", "detail")
    owners = [o.decode() for o in redis_client.hkeys(keys.owners)]
    assert len(owners) == 1
    scripts = CountingLock(redis_client, "detail")  # only to run the script through redis-py
    freed = drive(release_consumer(keys, owners[0]), scripts.runner, "detail")
    assert freed == 3
    crawl.wait()
    assert crawl.stats["finish_reason"] == "finished", crawl.tail()
    assert crawl.stats["redislock/detail/lost"] == 3
    assert "was lost" in crawl.output
    assert leftover(redis_client) == 0


@pytest.mark.faults
def test_redis_outage_mid_crawl(site: CrawlSite, tmp_path: Path) -> None:
    """Redis killed for 2 s and restarted empty: requests wait (caps hold), warnings with back-off,
    the crawl resumes by itself, every page is fetched exactly once and nothing is left in Redis."""
    site.delay = 0.1
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        crawls = [
            Crawl(
                site.url,
                "detail:40,comments:20",
                settings(server.url, SCHEDULER=scheduler),
                tmp_path,
            ).start()
            for scheduler in BOTH
        ]
        # both connected before the fault (else one closes with redislock_redis_unavailable)
        for crawl in crawls:
            assert crawl.wait_for_output("Stage slots in Redis at", timeout=60), crawl.tail()
        assert site.wait_for(lambda: site.count("detail") >= 6, timeout=30)
        server.kill()
        # What was in flight finishes, and a slot held may still pass to a parked request of its
        # process within REDISLOCK_LOCAL_REUSE (0.25 s) of its grant; then nothing new starts until
        # Redis is back.
        time.sleep(1)
        settled = site.count("detail")
        time.sleep(1)
        assert site.count("detail") == settled
        server.start()
        for crawl in crawls:
            crawl.wait(timeout=90)
            assert crawl.stats["finish_reason"] == "finished", crawl.tail()
            assert "Redis error" in crawl.output or "failed" in crawl.output
        assert site.max_in_flight["detail"] <= 3
        assert len(site.hits) == 60 and all(n == 2 for n in site.hits.values())
        assert leftover(client) == 0
        client.close()


@pytest.mark.faults
def test_redis_paused_mid_crawl(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """Redis frozen (SIGSTOP) for 3 s: waiting requests wait, nothing crashes, the cap holds."""
    pid = int(redis_client.info("server")["process_id"])
    crawl = Crawl(site.url, "detail:60,comments:20", settings(redis_url), tmp_path).start()
    assert site.wait_for(lambda: site.count("detail") >= 6, timeout=30)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(3)
    finally:
        os.kill(pid, signal.SIGCONT)
    crawl.wait(timeout=90)
    assert crawl.stats["finish_reason"] == "finished", crawl.tail()
    assert site.max_in_flight["detail"] <= 3
    assert len(site.hits) == 80
    assert leftover(redis_client) == 0


def test_bad_configuration_stops_the_crawl(redis_url: str, site: CrawlSite, tmp_path: Path) -> None:
    cases = [
        (
            {"REDISLOCK_STAGES": {"detail": -1}},
            "REDISLOCK_STAGES['detail'] must be an integer from 0 to 1000",
        ),
        ({"REDISLOCK_STAGES": {"detail": "three"}}, "'three'"),
        ({"REDISLOCK_STAGES": ["detail"]}, "REDISLOCK_STAGES must be a dict"),
        ({"REDISLOCK_URL": "http://nope"}, "REDISLOCK_URL"),
        ({"TWISTED_REACTOR": "twisted.internet.selectreactor.SelectReactor"}, "TWISTED_REACTOR"),
        (
            {"TWISTED_REACTOR": "twisted.internet.selectreactor.SelectReactor", "SCHEDULER": None},
            "TWISTED_REACTOR",
        ),
        (
            {"REDISLOCK_STAGE_KEY": "domian"},
            "REDISLOCK_STAGE_KEY must be 'domain', 'download_slot'",
        ),
        ({"REDISLOCK_STAGE_KEY": "nowhere.key_of"}, "REDISLOCK_STAGE_KEY cannot be loaded"),
        (
            {"REDISLOCK_STAGE_KEY": "domain", "REDISLOCK_KEY_LIMIT": -1},
            "REDISLOCK_KEY_LIMIT must be an integer",
        ),
        (
            {"REDISLOCK_STAGE_KEY": "domain", "REDISLOCK_DELAY": -0.5},
            "REDISLOCK_DELAY must be a number of seconds",
        ),
        (
            {"REDISLOCK_DELAYS": {"detail": "soon"}},
            "REDISLOCK_DELAYS['detail'] must be a number of seconds",
        ),
    ]
    crawls = [
        (Crawl(site.url, "detail:3", settings(redis_url, **bad), tmp_path).start(), named)
        for bad, named in cases
    ]
    for crawl, named in crawls:
        crawl.wait(timeout=60)
        assert crawl.code != 0, crawl.tail()
        assert "ConfigError" in crawl.output and named in crawl.output, crawl.tail()
    assert not site.hits  # nothing was fetched unthrottled


def test_unreachable_redis_closes_the_spider(site: CrawlSite, tmp_path: Path) -> None:
    # 0: close at once
    crawls = [
        Crawl(
            site.url,
            "detail:3,comments:3",
            settings("redis://127.0.0.1:1/0", SCHEDULER=s, REDISLOCK_CONNECT_TIMEOUT=0),
            tmp_path,
        ).start()
        for s in BOTH
    ]
    for crawl in crawls:
        crawl.wait(timeout=60)
        assert crawl.stats["finish_reason"] == "redislock_redis_unavailable", crawl.tail()
        assert "Cannot reach Redis at redis://127.0.0.1:1/0 (REDISLOCK_URL)" in crawl.output
    assert not site.hits


def test_an_unknown_stage_drops_its_requests_says_so_once_and_is_no_clean_finish(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """A typo in a stage name: its requests are dropped, never sent uncapped; one ERROR names the
    stage and the nearest known one, no traceback; the crawl finishes as redislock_unknown_stage,
    exit status 1 (the other stages are crawled)."""
    crawl = Crawl(site.url, "detail:2,details:2", settings(redis_url), tmp_path).run()
    assert crawl.stats["finish_reason"] == "redislock_unknown_stage", crawl.tail()
    assert crawl.code == 1
    assert crawl.stats["redislock/unknown_stage"] == 2
    assert crawl.stats["test/errback/IgnoreRequest"] == 2
    said = "stage 'details' is not configured (did you mean 'detail'? REDISLOCK_STAGES has ['comments', 'detail']). It is dropped"  # noqa: E501
    assert crawl.output.count(said) == 1  # once, whatever the number of requests
    assert "Traceback" not in crawl.output, crawl.tail()
    assert not [path for path in site.hits if "details" in path]
    assert site.count("detail") == 2


def test_limits_are_written_at_start_and_a_change_is_logged(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    CountingLock(redis_client, "detail", limit=5).set_limit(5)
    CountingLock(redis_client, "comments", limit=7).set_limit(7)
    crawl = Crawl(site.url, "detail:6,comments:3", settings(redis_url), tmp_path).run()
    assert crawl.stats["finish_reason"] == "finished", crawl.tail()
    assert "Limit of stage 'detail' changed from 5 to 3 in Redis" in crawl.output
    assert "Stage 'comments' is unlimited in this process but capped at 7 in Redis" in crawl.output
    assert int(redis_client.hget(LockKeys.of("redislock", "detail").meta, "limit")) == 3
    assert site.max_in_flight["detail"] <= 3


def test_requests_bypassing_the_scheduler_are_counted(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """engine.download_async (media pipelines) passes the middleware: counted in its stage, in both
    modes.

    robots.txt is exempt even with a default stage (capped requests wait for it in
    RobotsTxtMiddleware).
    """
    robots = Crawl(
        site.url,
        "detail:4",
        settings(redis_url, ROBOTSTXT_OBEY=True, REDISLOCK_DEFAULT_STAGE="detail"),
        tmp_path,
    ).start()
    direct = [
        Crawl(
            site.url, "detail:4", settings(redis_url, SCHEDULER=s), tmp_path, args={"direct": "3"}
        ).start()
        for s in BOTH
    ]
    robots.wait()
    assert robots.stats["finish_reason"] == "finished", robots.tail()
    assert site.hits["/robots.txt"] == 1
    assert robots.stats["redislock/detail/acquired"] == 4
    for crawl in direct:
        crawl.wait()
        assert crawl.stats["finish_reason"] == "finished", crawl.tail()
        assert crawl.stats["redislock/detail/acquired"] == 4 + 3
    assert sum(n for path, n in site.hits.items() if path.startswith("/direct/")) == 6
    assert site.max_in_flight["detail"] <= 3
    assert leftover(redis_client) == 0


def _no_reactorless_handler() -> bool:
    """Scrapy 2.19 downloads without a Twisted reactor with aiohttp (a test dependency); Scrapy
    2.18, the floor, with httpx, which the project does not install."""
    return not any(
        importlib.util.find_spec(name)
        for name in ("scrapy.core.downloader.handlers._aiohttp", "httpx2", "httpx")
    )


@pytest.mark.skipif(
    _no_reactorless_handler(),
    reason=f"Scrapy {scrapy.__version__} downloads without a Twisted reactor with httpx, not "
    "installed (Scrapy 2.19 uses aiohttp)",
)
def test_without_a_twisted_reactor(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """TWISTED_REACTOR_ENABLED = False (asyncio only, Scrapy's aiohttp handler): works the same."""
    extra = {"TWISTED_REACTOR_ENABLED": False, "LOG_LEVEL": "DEBUG"}
    # comments of 0.3 s: more than 3 of them in flight at once even when the crawl is short of CPU
    # (at the site's default they once never overlapped by 4 in CI's rehearsal, loaded)
    plan = "detail:40,comments:40:sleep=0.3"
    crawl = Crawl(site.url, plan, settings(redis_url, **extra), tmp_path).run()
    assert crawl.stats["finish_reason"] == "finished", crawl.tail()
    assert "Not using a Twisted reactor" in crawl.output
    # comments: uncapped
    assert site.max_in_flight["detail"] == 3 and site.max_in_flight["comments"] > 3
    assert crawl.stats["redislock/detail/acquired"] == 40
    assert leftover(redis_client) == 0
