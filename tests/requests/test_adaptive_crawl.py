"""The adaptive limit of a key in real crawls (REDISLOCK_ADAPTIVE): 3 `scrapy runspider` processes
against a site that serves 4 requests at once (testing/capacity.py: the rest wait, 503 past 8) and a
real redis-server. One controller for the three: its limit starts at 1, doubles while the site has
room (slow start), probes, and settles at the site's capacity, K or K + 1 (K + 2 in some windows
on a starved CPU), whatever the cap (16) allows; every window is committed once, by whichever
process reported when it was due. Counts and orders, not speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from testing.capacity import CapacitySite
from testing.crawlproc import Crawl, leftover

pytestmark = [pytest.mark.integration, pytest.mark.crawl]
PROCESSES = 3
K = 4


def test_three_processes_find_the_sites_capacity(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    settings = {
        "REDISLOCK_URL": redis_url,
        "REDISLOCK_STAGES": {"detail": None},
        "REDISLOCK_STAGE_KEY": "domain",
        "REDISLOCK_KEY_LIMIT": 16,
        "REDISLOCK_ADAPTIVE": ["keys"],
        "REDISLOCK_ADAPTIVE_WINDOW": 0.5,
        "CONCURRENT_REQUESTS": 16,
    }
    with CapacitySite(capacity=K, base=0.1) as site:
        crawls = [
            Crawl(site.url_of(1), "detail:150", settings, tmp_path, args={"first": str(1000 * i)})
            for i in range(PROCESSES)
        ]
        for crawl in crawls:
            crawl.start()
        for crawl in crawls:
            crawl.wait(timeout=180)
            assert crawl.stats.get("finish_reason") == "finished", crawl.tail()
        host = site.hosts["127.0.0.1"]
    log = [
        json.loads(entry)
        for entry in reversed(redis_client.lrange("redislock:{key:127.0.0.1}:adapt_log", 0, -1))
    ]
    limits = [record[1] for record in log]
    print(f"limits by window: {limits}; answers {dict(host.answers)}")
    assert len(log) >= 10  # windows committed, each once (the log has one record per commit)
    assert limits[0] <= 2 and max(limits) >= K  # from the minimum up to the capacity
    # settled: the last windows at K or K + 1, bar a probe's two windows at half; on a starved CPU
    # the no-load estimate takes in the processes' own delays and hides a queue of one more
    # (docs/adaptive.md), so one in the middle, none past K + 2
    settled = sorted(limit for limit in limits[-6:] if limit > K // 2)
    assert settled and settled[len(settled) // 2] in {K - 1, K, K + 1}, limits
    assert settled[-1] <= K + 2, limits
    assert host.most_served <= K  # the site's own capacity (it queues the rest)
    assert leftover(redis_client) == 0
