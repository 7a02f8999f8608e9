"""Throttling scopes in real crawls: a request under its stage, its domain and a proxy scope at once
(REDISLOCK_SCOPES, meta["redislock_scopes"]), 3 `scrapy runspider` processes against a local site
answering on 5 host names, a real redis-server.

The site counts requests in flight per stage and per host; a test middleware after ours sends each
request's confirmed starts (its delays' and rate windows', on Redis's clock) in a header, and the
site notes their arrival on the same machine's wall clock. The caps are checked as the site saw
them; the delay and the rate window exactly on Redis's clock, and against the site's arrivals with
the request's own lateness allowed for (see tests/requests/test_keys.py).
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import redis

from testing.crawlproc import Crawl, finish_all, leftover
from testing.site import CrawlSite

pytestmark = [pytest.mark.integration, pytest.mark.crawl]
HOSTS = 5
PROCESSES = 3
PAGES = 20  # per process
CLOCK_TOLERANCE = 0.002  # seconds: Redis's TIME and the site's time.time(), one machine's clock
WITH_HEADER = {
    "scrapy_redislock.StageLockMiddleware": 950,
    "testing.spiders.crawlspider.BookedStartHeader": 960,  # after ours: the confirmed starts
}


def run(site: CrawlSite, extra: dict[str, Any], folder: Path, **args: str) -> list[Crawl]:
    crawls = finish_all(
        [
            Crawl(
                site.url,
                f"detail:{PAGES}",
                extra,
                folder,
                args={"hosts": str(HOSTS), "first": str(1000 * i), **args},
            )
            for i in range(PROCESSES)
        ],
        timeout=180,
    )
    assert len(site.hits) == PROCESSES * PAGES and set(site.hits.values()) == {1}  # once each
    return crawls


def held_to_the_rate(starts: list[float], count: int, window: float, crawls: list[Crawl]) -> None:
    """At most ``count`` of the confirmed ``starts`` (Redis's clock) in any window ``(t - window,
    t]``, paced by the rate, and every page of each crawl through the window."""
    starts = sorted(starts)
    for i, start in enumerate(starts):
        assert i + 1 - bisect.bisect_right(starts, start - window) <= count, starts
    assert starts[-1] - starts[0] >= (len(starts) / count - 1) * window - 1e-6  # paced by the rate
    for crawl in crawls:
        assert crawl.stats["redislock/rate/starts"] == PAGES


def test_stage_domain_and_proxy_scopes_hold_together(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Stage detail cap 3, each domain cap 2 with 0.2 s between starts, a proxy scope of 10 starts
    per second, on every request, 3 processes, 5 domains: never over a cap, a domain's confirmed
    starts at least 0.2 s apart, never more than 10 proxy starts in any second (on Redis's clock),
    no request at the site before its confirmed starts, every page once, nothing left in Redis."""
    delay, rate = 0.2, (10, 1.0)
    extra = {
        "REDISLOCK_URL": redis_url,
        "SCHEDULER": "scrapy_redislock.StageScheduler",
        "REDISLOCK_STAGES": {"detail": 3},
        "REDISLOCK_STAGE_KEY": "domain",
        "REDISLOCK_KEY_LIMIT": 2,
        "REDISLOCK_DELAY": delay,
        "REDISLOCK_SCOPES": {"proxy:*": {"rate": "10/s"}},
        "CONCURRENT_REQUESTS": 16,
        "DOWNLOAD_DELAY": 0,
        "DOWNLOADER_MIDDLEWARES": WITH_HEADER,
    }
    with CrawlSite(delay=0.1, hosts=HOSTS) as site:
        crawls = run(site, extra, tmp_path, scopes="proxy:p1")
        assert site.max_in_flight["detail"] <= 3, site.max_in_flight
        assert len(site.max_host_in_flight) == HOSTS
        assert max(site.max_host_in_flight.values()) <= 2, site.max_host_in_flight
        arrivals = list(site.scope_starts)
    assert len(arrivals) == PROCESSES * PAGES  # every request carried its confirmed starts
    by_key: dict[str, list[tuple[float, float]]] = defaultdict(list)
    proxy: list[float] = []
    for arrived, starts in arrivals:
        assert len(starts) == 2 and "key:proxy:p1" in starts, starts  # its domain's and the proxy's
        for name, start in starts.items():
            assert arrived >= start - CLOCK_TOLERANCE, (name, arrived, start)  # never early
            if name == "key:proxy:p1":
                proxy.append(start)
            else:
                by_key[name].append((arrived, start))
    assert len(by_key) == HOSTS
    for name, pairs in by_key.items():
        pairs.sort(key=lambda pair: pair[1])
        for (arrived, start), (next_arrived, next_start) in itertools.pairwise(pairs):
            assert next_start - start >= delay - 1e-6, (name, pairs)  # exact on Redis's clock
            # at the site: the delay less the earlier request's lateness after its confirmation
            assert next_arrived - arrived >= delay - (arrived - start) - CLOCK_TOLERANCE
    held_to_the_rate(proxy, *rate, crawls)
    assert leftover(redis_client) == 0
    # the keys' and the proxy's locks, gates and rate logs all gone once idle (the stage's lock stays)
    assert site.wait_for(
        lambda: not list(redis_client.scan_iter("redislock:{key:*")), timeout=10
    ), list(redis_client.scan_iter("redislock:*"))


def test_a_stages_rate_window_holds_for_the_cluster(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A stage's policy in REDISLOCK_STAGES with a cap of 3 and a rate window of 10 starts per
    second, 3 processes, no key: never over the cap, never more than 10 of the stage's starts in
    any second on Redis's clock, none at the site before its confirmed start, every page once,
    the stage's rate log gone once idle."""
    count, window = 10, 1.0
    extra = {
        "REDISLOCK_URL": redis_url,
        "SCHEDULER": "scrapy_redislock.StageScheduler",
        "REDISLOCK_STAGES": {"detail": {"limit": 3, "rate": f"{count}/s"}},
        "CONCURRENT_REQUESTS": 16,
        "DOWNLOAD_DELAY": 0,
        "DOWNLOADER_MIDDLEWARES": WITH_HEADER,
    }
    with CrawlSite(delay=0.05, hosts=HOSTS) as site:
        crawls = run(site, extra, tmp_path)
        assert site.max_in_flight["detail"] <= 3, site.max_in_flight
        arrivals = list(site.scope_starts)
    assert len(arrivals) == PROCESSES * PAGES  # every request carried its confirmed start
    starts = []
    for arrived, booked in arrivals:
        assert set(booked) == {"detail"}, booked
        assert arrived >= booked["detail"] - CLOCK_TOLERANCE, (arrived, booked)  # never early
        starts.append(booked["detail"])
    held_to_the_rate(starts, count, window, crawls)
    assert leftover(redis_client) == 0
    assert site.wait_for(
        lambda: not list(redis_client.scan_iter("redislock:*:rate")), timeout=10
    ), list(redis_client.scan_iter("redislock:*"))


def test_a_scope_without_a_policy_fails_its_requests_by_name(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A scope that matches no entry of REDISLOCK_SCOPES fails each of its requests with
    KeyFunctionError naming it (a typo must not leave a proxy unthrottled); the crawl goes on."""
    extra = {
        "REDISLOCK_URL": redis_url,
        "REDISLOCK_STAGES": {"detail": None},
        "REDISLOCK_SCOPES": {"proxy:*": {"limit": 1}},
    }
    with CrawlSite(delay=0.01) as site:
        crawl = Crawl(site.url, "detail:3", extra, tmp_path, args={"scopes": "prxy:p1"}).start()
        crawl.wait(timeout=120)
        assert site.hits == {}
    assert crawl.stats["redislock/key_errors"] == 3
    assert (
        "scope 'prxy:p1' of" in crawl.output
        and "matches no entry of REDISLOCK_SCOPES" in crawl.output
    )


def test_robots_crawl_delay_holds_for_the_whole_cluster(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """REDISLOCK_CRAWL_DELAY with a robots.txt saying ``Crawl-delay: 1``, 3 processes, no
    REDISLOCK_STAGE_KEY (the domain is the key then): the site's page starts, confirmed by any
    process, at least 1 s apart on Redis's clock, and at the site at least 1 s less the earlier
    request's lateness after its confirmation."""
    pages = 3
    extra = {
        "REDISLOCK_URL": redis_url,
        "REDISLOCK_STAGES": {"detail": None},
        "REDISLOCK_CRAWL_DELAY": True,
        "ROBOTSTXT_OBEY": True,
        "CONCURRENT_REQUESTS": 16,
        "DOWNLOAD_DELAY": 0,
        "DOWNLOADER_MIDDLEWARES": WITH_HEADER,
    }
    with CrawlSite(delay=0.01) as site:
        site.routes["/robots.txt"] = ("text/plain", "User-agent: *\nCrawl-delay: 1\n")
        crawls = finish_all(
            [
                Crawl(site.url, f"detail:{pages}", extra, tmp_path, args={"first": str(1000 * i)})
                for i in range(PROCESSES)
            ]
        )
        for crawl in crawls:
            assert crawl.stats["redislock/crawl_delay/sites"] == 1
        pages_hit = {path: n for path, n in site.hits.items() if path != "/robots.txt"}
        assert len(pages_hit) == PROCESSES * pages and set(pages_hit.values()) == {1}
        pairs = sorted(
            ((arrived, starts["key:127.0.0.1"]) for arrived, starts in site.scope_starts),
            key=lambda pair: pair[1],
        )
    assert len(pairs) == PROCESSES * pages
    for (arrived, start), (next_arrived, next_start) in itertools.pairwise(pairs):
        assert next_start - start >= 1.0 - 1e-6, pairs
        assert next_arrived - arrived >= 1.0 - (arrived - start) - CLOCK_TOLERANCE, pairs
