"""Caps per key beside a stage cap (REDISLOCK_STAGE_KEY + REDISLOCK_KEY_LIMIT with
REDISLOCK_STAGES), in a real crawl (`scrapy runspider`) against a local site and a real redis-server
(issue 26, item 10b).

A request takes its stage slot first, then waits in the middleware for its key slot, holding the
stage slot (the order that cannot deadlock). StageScheduler handed stage slots oldest first, so a
run of requests of one key at the head of the queue took every stage slot and waited for that key
one at a time, while the other keys got nothing (measured before: 44 pages of one key, 0 of the
other in 5 s, stage cap 4, key cap 1). It now hands a stage slot to the oldest parked request whose
key has room in this process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from testing.crawlproc import Crawl, leftover
from testing.site import CrawlSite

pytestmark = [pytest.mark.integration, pytest.mark.crawl]


def section_key(request: Any, spider: Any) -> str | None:
    """REDISLOCK_STAGE_KEY for the test: the first path segment (``/a/7`` -> ``a``), which the site
    counts apart."""
    return urlsplit(request.url).path.strip("/").split("/")[0] or None


def test_a_busy_key_at_the_head_of_the_queue_does_not_starve_the_others(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """60 requests of key ``a`` queued before 60 of key ``b``, all of stage ``detail`` (cap 4), each
    key capped at 1: both keys are fetched side by side from the start (before: ``b`` only once
    ``a`` was done, with 3 of the 4 stage slots held by requests waiting for ``a``). The caps
    hold."""
    site.delay = 0.05
    settings = {
        "REDISLOCK_URL": redis_url,
        "CONCURRENT_REQUESTS": 16,
        "REDISLOCK_STAGES": {"detail": 4},
        "REDISLOCK_STAGE_KEY": f"{__name__}.section_key",
        "REDISLOCK_KEY_LIMIT": 1,
    }
    crawl = Crawl(site.url, "detail@a:60,detail@b:60", settings, tmp_path).run(timeout=120)
    assert crawl.code == 0 and crawl.stats["finish_reason"] == "finished", crawl.tail()
    assert site.count("a") == 60 and site.count("b") == 60
    assert site.max_in_flight["a"] == 1 and site.max_in_flight["b"] == 1  # the key caps
    starts = {key: min(site.arrivals[key]) for key in ("a", "b")}
    ends = {key: max(site.arrivals[key]) for key in ("a", "b")}
    first, second = sorted(starts, key=starts.__getitem__)
    print(f"{second} started {starts[second] - starts[first]:.2f} s after {first}; {first} took "
          f"{ends[first] - starts[first]:.2f} s")  # fmt: skip
    # Side by side: the second key starts within a few pages of the first, long before the first is
    # done (one key alone takes 60 x 50 ms = 3 s at least).
    assert starts[second] - starts[first] < 1.0
    assert starts[second] < ends[first] - 1.5
    assert crawl.stats["redislock/detail/acquired"] == 120
    assert leftover(redis_client) == 0
