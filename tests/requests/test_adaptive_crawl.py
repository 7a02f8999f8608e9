"""The adaptive limit of a key in real crawls (REDISLOCK_ADAPTIVE): 3 `scrapy runspider` processes
against a site that serves 4 requests at once (testing/capacity.py: the rest wait, 503 past 8, or
past 6 for a site with a short queue) and a real redis-server. One controller for the three: its
limit starts at 1, grows by up to half a window while the site has room (slow start), probes, and
settles where the site holds its capacity, K or K + 1 in flight, whatever the cap (16) allows;
every window is committed once, by whichever process reported when it was due. Counts and orders,
at the site and in Redis, not speed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from testing.capacity import CapacitySite, Host
from testing.crawlproc import Crawl, finish_all, leftover

pytestmark = [pytest.mark.integration, pytest.mark.crawl]
PROCESSES = 3
K = 4
PAGES = 200  # per process: the start, a probe and about ten windows settled


# the site's host as the request's key (REDISLOCK_ADAPTIVE "keys"), or every request under one
# scope whose REDISLOCK_SCOPES entry is adaptive (a rendering service, say), with no key
BY_KEY = {
    "REDISLOCK_STAGE_KEY": "domain",
    "REDISLOCK_KEY_LIMIT": 16,
    "REDISLOCK_ADAPTIVE": ["keys"],
}
BY_SCOPE = {"REDISLOCK_SCOPES": {"render": {"limit": 16, "adaptive": True}}}


def crawl_the_site(
    site: CapacitySite, redis_url: str, tmp_path: Path, pages: int = PAGES, scoped: bool = False
) -> Host:
    """Three processes crawl ``pages`` pages each of the site's first host under one adaptive key
    or scope limit (windows of 0.5 s, a cap of 16); what the host saw."""
    settings: dict[str, Any] = {
        "REDISLOCK_URL": redis_url,
        "REDISLOCK_STAGES": {"detail": None},
        **(BY_SCOPE if scoped else BY_KEY),
        "REDISLOCK_ADAPTIVE_WINDOW": 0.5,
        "CONCURRENT_REQUESTS": 16,
    }
    args = {"scopes": "render"} if scoped else {}
    finish_all(
        [
            Crawl(
                site.url_of(1),
                f"detail:{pages}",
                settings,
                tmp_path,
                args={"first": str(1000 * i), **args},
            )
            for i in range(PROCESSES)
        ],
        timeout=180,
    )
    return site.hosts["127.0.0.1"]


def limits_by_window(client: redis.Redis, name: str = "127.0.0.1") -> list[int]:
    log = client.lrange(f"redislock:{{key:{name}}}:adapt_log", 0, -1)
    return [json.loads(entry)[1] for entry in reversed(log)]


@pytest.mark.parametrize("scoped", [False, True], ids=["key", "scope"])
def test_three_processes_find_the_sites_capacity(
    scoped: bool, redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Settled means the site holds K to K + 1 in flight, counted at the site. Not the limit: a
    slot is held from its grant to the answer's handling, longer than the site has the request,
    and the more so on a busy CPU; with two CPU burners beside it the limit held K + 2 = 6 while
    the site had 5.0 in flight (K + 1, as on a quiet machine at a limit of 5), which the test's
    old check of the limit (median of the last windows in K - 1 to K + 1) took for a failure."""
    with CapacitySite(capacity=K, base=0.1) as site:
        host = crawl_the_site(site, redis_url, tmp_path, scoped=scoped)
    limits = limits_by_window(redis_client, "render" if scoped else "127.0.0.1")
    with site.condition:
        # from the 60th to the 95th percent of the requests: every process still had some to send
        # (a process that started late on a busy machine ends late, alone: the last arrivals are
        # no measure of the limit)
        count = len(host.arrivals)
        settled = host.mean_in_flight(
            host.arrivals[count * 6 // 10], host.arrivals[count * 95 // 100]
        )
    print(f"limits by window: {limits}; answers {dict(host.answers)}; settled {settled:.2f}")
    assert len(limits) >= 10  # windows committed, each once (the log has one record per commit)
    assert limits[0] <= 2 and max(limits) >= K  # from the minimum up to the capacity
    # the site full, about one request waiting, as docs/adaptive.md says it converges; K - 2 as
    # bench/adaptive.py's band: on a starved CPU the processes may not keep K out (3.7 and 4.7
    # with two CPU burners beside it)
    assert K - 2 <= settled <= K + 1.5, (settled, limits)
    assert host.most_served <= K  # the site's own capacity (it queues the rest)
    assert leftover(redis_client) == 0


def test_the_start_stays_below_what_a_site_with_a_short_queue_refuses(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A site that serves 8 at once and answers 503 with 1.5 K = 12 in flight (bench/adaptive.py
    --refuse 1.5): fewer than 1% of all its answers are refusals, over the whole run, the start
    included, counted at the site. The doubling slow start went 1, 2, 4, 8, 16: past 12, and each
    refusal, answered at once, freed its slot for the next request until the next window cut the
    limit (5.8% of the answers here, 70 of 1,200; 22% for K = 4, refusing past 6). Growing by half
    from the limit went 1, 2, 3, 5, 7, 9, 14 once at a load average of 11 (a queue read at 7, none
    read at 9 = K + 1: 5.25% refused); the start now grows from what the site surely served. At
    load averages of 13 to 17 it still went 5, 7, 9, 13 (1.5%) and 7, 10, 14 (2%): the crawling
    processes held slots whose requests were not at the site (8.3 there at 9 slots, a queue of
    0.3 that read as none), and sent them all when they caught up; the start's step now counts
    only the share of the slots' time the site had the requests."""
    capacity = 8
    with CapacitySite(capacity=capacity, base=0.1, refuse=1.5) as site:
        host = crawl_the_site(site, redis_url, tmp_path, pages=2 * PAGES)
    limits = limits_by_window(redis_client)
    print(f"limits by window: {limits}; answers {dict(host.answers)}")
    assert host.answers[200] == PROCESSES * 2 * PAGES - host.answers[503]  # no retries
    assert host.refused_share < 0.01, (dict(host.answers), limits)
    assert max(limits) >= capacity  # it did find the capacity
    assert leftover(redis_client) == 0
