"""Caps per key (REDISLOCK_STAGE_KEY) and the cluster-wide delay, in real crawls: 3 `scrapy
runspider` processes against a local site answering on several host names (127.0.0.1 to 127.0.0.4)
and a real redis-server.

The site counts, per host, requests in flight (from request line read to just before the response is
written) and when each request arrived. For the delay, a test middleware after ours sends each
request's confirmed start (on Redis's clock) in a header, and the site notes its arrival on the same
machine's wall clock (the clock Redis's TIME reads): the tests check that the confirmed starts of
one host are at least the delay apart (exactly, on Redis's clock), that no request arrives before
its confirmed moment, less CLOCK_TOLERANCE (two reads of one clock by two processes), and, with the
processes' event loops stalled on purpose, that starts coming too soon after a late one were held
back. What the site sees between two arrivals is then at least the delay less the difference of the
two requests' ways from confirmation to the site (the reply's way back, the downloader, the
connection, the site's thread): that is measured by ``./run.sh bench keys`` (docs/key-caps.md), not
asserted here.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import redis

from testing.crawlproc import Crawl, finish_all, leftover
from testing.site import CrawlSite

pytestmark = [pytest.mark.integration, pytest.mark.crawl]
HOSTS = 4
PROCESSES = 3
# seconds: Redis's TIME and the site's time.time(), read by two processes of one machine
CLOCK_TOLERANCE = 0.002
BOTH = ("scrapy_redislock.StageScheduler", None)
# with the stage-aware scheduler, and the middleware alone
WITH_HEADER = {
    "scrapy_redislock.StageLockMiddleware": 950,
    "testing.spiders.crawlspider.BookedStartHeader": 960,  # after ours: the confirmed start, for the site
}


def settings(redis_url: str, **extra: Any) -> dict[str, Any]:
    # the test spider names a stage: unlimited unless a test caps it
    return {
        "REDISLOCK_URL": redis_url,
        "REDISLOCK_STAGE_KEY": "domain",
        "REDISLOCK_STAGES": {"detail": None},
        "CONCURRENT_REQUESTS": 16,
        "DOWNLOAD_DELAY": 0,
        **extra,
    }


def crawl_all(
    site: CrawlSite, plan: str, pages: int, extra: dict[str, Any], folder: Path
) -> list[Crawl]:
    """PROCESSES crawls, each of ``pages`` pages of its own (numbered apart), spread over the HOSTS
    host names."""
    crawls = finish_all(
        [
            Crawl(site.url, plan, extra, folder, args={"hosts": str(HOSTS), "first": str(1000 * i)})
            for i in range(PROCESSES)
        ]
    )
    # every page, once
    assert len(site.hits) == PROCESSES * pages and set(site.hits.values()) == {1}
    return crawls


def key_locks_left(client: redis.Redis) -> list[bytes]:
    return sorted(client.scan_iter("redislock:{key:*"))


@pytest.mark.parametrize("scheduler", BOTH, ids=["scheduler", "middleware-alone"])
def test_per_host_cap_and_stage_cap_hold_across_processes(
    scheduler: str | None, redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Each host at most 2 in flight across 3 processes while the stage holds at most 5; both caps
    are reached."""
    extra = settings(
        redis_url, SCHEDULER=scheduler, REDISLOCK_STAGES={"detail": 5}, REDISLOCK_KEY_LIMIT=2
    )
    with CrawlSite(delay=0.1, hosts=HOSTS) as site:
        crawls = crawl_all(site, "detail:40", 40, extra, tmp_path)
        assert len(site.max_host_in_flight) == HOSTS
        assert max(site.max_host_in_flight.values()) == 2, site.max_host_in_flight
        assert site.max_in_flight["detail"] <= 5
    for crawl in crawls:
        assert crawl.stats["redislock/keys/acquired"] == 40
    assert leftover(redis_client) == 0
    assert key_locks_left(redis_client) == []  # every key's lock was removed once idle


def test_per_key_limit_overrides(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    """REDISLOCK_KEY_LIMITS: one host capped at 1, another uncapped, the rest at
    REDISLOCK_KEY_LIMIT."""
    limits = {"127.0.0.2": 1, "127.0.0.3": None}
    extra = settings(redis_url, REDISLOCK_KEY_LIMIT=2, REDISLOCK_KEY_LIMITS=limits)
    with CrawlSite(delay=0.1, hosts=HOSTS) as site:
        crawl_all(site, "detail:40", 40, extra, tmp_path)
        assert site.max_host_in_flight["127.0.0.2"] == 1
        assert site.max_host_in_flight["127.0.0.3"] > 2  # uncapped: 3 processes x their concurrency
        assert (
            site.max_host_in_flight["127.0.0.1"] == 2 and site.max_host_in_flight["127.0.0.4"] == 2
        )
    assert key_locks_left(redis_client) == []


def test_delay_between_starts_of_a_host_across_processes(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """REDISLOCK_DELAY = 0.3 s: the starts of one host, confirmed by any process, are at least that far
    apart on Redis's clock, no request reaches the site before its confirmed start, and the delay is
    what paces the crawl."""
    delay = 0.3
    extra = settings(
        redis_url, SCHEDULER=None, REDISLOCK_DELAY=delay, DOWNLOADER_MIDDLEWARES=WITH_HEADER
    )
    with CrawlSite(delay=0.05, hosts=HOSTS) as site:
        crawls = crawl_all(site, "detail:12", 12, extra, tmp_path)
        gaps = [gap for host in site.host_arrivals for gap in site.gaps(host)]
        check_bookings(site, delay)
    assert len(gaps) == PROCESSES * 12 - HOSTS
    assert sorted(gaps)[len(gaps) // 2] < 1.5 * delay  # paced by the delay, not by something slower
    assert sum(crawl.stats["redislock/delay/waits"] for crawl in crawls) == PROCESSES * 12
    # Nothing left once idle: the gates expire when their moment has passed.
    assert site.wait_for(lambda: not list(redis_client.scan_iter("redislock:*")), timeout=5)


def test_a_late_start_holds_the_next_back(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Each process's event loop stalls 60 ms every 130 ms, so wake-ups for booked starts come late:
    every start is confirmed against the previous confirmed one, so confirmed starts of a host stay
    the delay apart on Redis's clock, none reaches the site before its confirmation, and starts that
    came too soon after a late one were held back."""
    delay = 0.15
    extra = settings(
        redis_url,
        SCHEDULER=None,
        REDISLOCK_DELAY=delay,
        DOWNLOADER_MIDDLEWARES=WITH_HEADER,
        EXTENSIONS={
            "testing.spiders.crawlspider.StatsFile": 0,
            "testing.spiders.crawlspider.LoopStall": 0,
        },
        TEST_LOOP_STALL="0.06,0.13",
    )
    with CrawlSite(delay=0.02, hosts=HOSTS) as site:
        crawls = crawl_all(site, "detail:10", 10, extra, tmp_path)
        check_bookings(site, delay)
    assert sum(crawl.stats.get("redislock/delay/held_back", 0) for crawl in crawls) > 0


def check_bookings(site: CrawlSite, delay: float, floor: float | None = None) -> None:
    """Per host: confirmed starts at least ``floor`` (default: the delay) apart, none arrived before
    its booking, so every gap the site saw is at least the delay less the lateness of the earlier
    request."""
    floor = delay if floor is None else floor
    assert len(site.booked_starts) == HOSTS
    for host, starts in site.booked_starts.items():
        assert len(starts) == len(site.host_arrivals[host])  # every request of the host was booked
        booked = sorted(start for _, start in starts)
        for earlier, later in itertools.pairwise(booked):
            assert later - earlier >= floor - 1e-6, (host, booked)
        late = [arrived - start for arrived, start in starts]
        assert min(late) >= -CLOCK_TOLERANCE, (host, min(late))
        by_booking = sorted(starts, key=lambda pair: pair[1])
        for (arrived, start), (next_arrived, _) in itertools.pairwise(by_booking):
            assert next_arrived - arrived >= floor - (arrived - start) - CLOCK_TOLERANCE


def test_key_cap_with_delay_and_randomized_delay(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Cap 1 and a randomized delay of 0.2 s per host: one at a time per host, bookings at least
    half the delay apart (as RANDOMIZE_DOWNLOAD_DELAY: 0.5 to 1.5 times), and not all equal."""
    extra = settings(
        redis_url,
        REDISLOCK_KEY_LIMIT=1,
        REDISLOCK_DELAY=0.2,
        REDISLOCK_RANDOMIZE_DELAY=True,
        DOWNLOADER_MIDDLEWARES=WITH_HEADER,
    )
    with CrawlSite(delay=0.02, hosts=HOSTS) as site:
        crawl_all(site, "detail:12", 12, extra, tmp_path)
        assert max(site.max_host_in_flight.values()) == 1
        check_bookings(site, 0.2, floor=0.1)
        booked = sorted(start for _, start in site.booked_starts["127.0.0.2"])
    apart = [later - earlier for earlier, later in itertools.pairwise(booked)]
    assert max(apart) - min(apart) > 0.05  # randomized
    assert key_locks_left(redis_client) == []


def test_stage_delay(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    """REDISLOCK_DELAYS names a stage: its starts are spaced across processes, whatever the host; no
    key set."""
    extra = {
        "REDISLOCK_URL": redis_url,
        "REDISLOCK_STAGES": {"detail": None},
        "REDISLOCK_DELAYS": {"detail": 0.15},
        "DOWNLOAD_DELAY": 0,
        "DOWNLOADER_MIDDLEWARES": WITH_HEADER,
    }
    with CrawlSite(delay=0.02, hosts=HOSTS) as site:
        crawl_all(site, "detail:6", 6, extra, tmp_path)
        starts = [pair for pairs in site.booked_starts.values() for pair in pairs]
    assert len(starts) == PROCESSES * 6
    booked = sorted(start for _, start in starts)
    assert min(later - earlier for earlier, later in itertools.pairwise(booked)) >= 0.15 - 1e-6
    assert min(arrived - start for arrived, start in starts) >= -CLOCK_TOLERANCE


def test_many_keys_leave_nothing_in_redis(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A key per page (300 keys, each used once, by 3 processes): each key stays on its light path
    (a zset member while its one page is fetched, lock/light.py), so a page costs one take and one
    release, at most 8 Redis commands with everything else the crawl sends (INFO commandstats);
    a key's lock object is dropped as its page ends, and nothing is left in Redis."""
    redis_client.config_resetstat()
    extra = settings(
        redis_url,
        REDISLOCK_STAGE_KEY="testing.spiders.crawlspider.path_key",
        REDISLOCK_KEY_LIMIT=1,
        CONCURRENT_REQUESTS=2,  # 100 pages of 50 ms two at a time: 2.5 s, several renewal ticks
    )
    with CrawlSite(delay=0.05, hosts=HOSTS) as site:
        crawls = crawl_all(site, "detail:100", 100, extra, tmp_path)
    stats = redis_client.info("commandstats")
    commands = sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")
    assert commands / 300 <= 8, stats
    assert int(stats["cmdstat_evalsha"]["calls"]) <= 2 * 300 + 30, stats  # take + release
    assert sum(crawl.stats["redislock/keys/acquired"] for crawl in crawls) == 300
    for crawl in crawls:
        # retired while crawling, not only at close
        assert crawl.stats["redislock/keys/retired_idle"] > 0
    assert key_locks_left(redis_client) == []
    assert list(redis_client.scan_iter("redislock:*")) == []


def test_a_key_function_that_raises_fails_that_request_only(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    extra = settings(
        redis_url,
        REDISLOCK_STAGES={"detail": 2},
        REDISLOCK_STAGE_KEY="testing.spiders.crawlspider.failing_key",
        REDISLOCK_KEY_LIMIT=1,
    )
    crawl = Crawl(site.url, "detail:6,detail@bad:2,detail@more:6", extra, tmp_path).run()
    assert crawl.stats["finish_reason"] == "finished", crawl.tail()
    assert crawl.stats["test/errback/KeyFunctionError"] == 2
    assert crawl.stats["redislock/key_errors"] == 2
    assert "no key for this one" in crawl.output
    assert site.count("detail") == 6 and site.count("more") == 6 and site.count("bad") == 0
    assert site.max_in_flight["detail"] + site.max_in_flight["more"] <= 2
    assert leftover(redis_client) == 0
