"""A key at its cap waits in StageScheduler, not in the downloader (requests/keyline.py), in real
crawls: 2 `scrapy runspider` processes against a local site and a real redis-server.

Two slow keys (0.5 s a page, capped at 1 across the processes) are queued first, then a fast one.
With StageScheduler a request of no capped stage leaves the scheduler only with its key slot: the
slow keys' requests wait there, taking none of CONCURRENT_REQUESTS (3), and the fast key's pages
all go while the slow keys are still busy. With the middleware alone (no StageScheduler) the same
requests take their key slot in the downloader, where the waiting ones hold its places.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from testing.crawlproc import Crawl, finish_all, leftover
from testing.site import CrawlSite

pytestmark = [pytest.mark.integration, pytest.mark.crawl]
PROCESSES = 2
SLOW = 8  # pages per slow key and process: 16 x 0.5 s, one at a time, is 8 s at least


def section_key(request: Any, spider: Any) -> str | None:
    """REDISLOCK_STAGE_KEY for the test: the first path segment (``/a/7`` -> ``a``)."""
    return urlsplit(request.url).path.strip("/").split("/")[0] or None


def by_section(redis_url: str) -> dict[str, Any]:
    """StageScheduler, an uncapped stage and the section as the key: what these crawls share."""
    return {
        "REDISLOCK_URL": redis_url,
        "SCHEDULER": "scrapy_redislock.StageScheduler",
        "REDISLOCK_STAGES": {"detail": None},
        "REDISLOCK_STAGE_KEY": f"{__name__}.section_key",
    }


def crawl(site: CrawlSite, redis_url: str, tmp_path: Path, scheduler: str | None) -> list[Crawl]:
    settings = {
        "REDISLOCK_URL": redis_url,
        "SCHEDULER": scheduler,
        "CONCURRENT_REQUESTS": 3,
        "REDISLOCK_STAGES": {"detail": None},
        "REDISLOCK_STAGE_KEY": f"{__name__}.section_key",
        "REDISLOCK_KEY_LIMIT": 4,
        "REDISLOCK_KEY_LIMITS": {"a": 1, "b": 1},
    }
    plan = f"detail@a:{SLOW},detail@b:{SLOW},detail@f:40"
    crawls = [
        Crawl(site.url, plan, settings, tmp_path, args={"first": str(1000 * i)}).start()
        for i in range(PROCESSES)
    ]
    for one in crawls:
        one.wait(timeout=120)
        assert one.stats.get("finish_reason") == "finished", one.tail()
    assert site.count("a") == site.count("b") == PROCESSES * SLOW
    assert site.count("f") == PROCESSES * 40 and set(site.hits.values()) == {1}
    assert site.max_in_flight["a"] == 1 and site.max_in_flight["b"] == 1  # the caps held
    assert site.max_in_flight["f"] <= 4
    return crawls


@pytest.fixture
def slow_site() -> Any:
    with CrawlSite(delay=0.02, delays={"a": 0.5, "b": 0.5}) as site:
        yield site


def test_a_busy_key_waits_in_the_scheduler(
    slow_site: CrawlSite, redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    crawls = crawl(slow_site, redis_url, tmp_path, "scrapy_redislock.StageScheduler")
    for one in crawls:
        # every key slot was taken before its request left the scheduler
        assert one.stats.get("redislock/keys/taken_in_downloader", 0) == 0
        assert one.stats["redislock/keys/acquired"] == 2 * SLOW + 40
    # the fast key went past the slow ones: in each process, all its pages before half of that
    # process's slow pages (per process: on a starved machine one may start seconds after the
    # other; its pages are numbered from 1000 * i)
    with slow_site.lock:
        served = list(slow_site.served)
    for i in range(PROCESSES):
        mine = [r for r in served if int(r.path.rsplit("/", 1)[1]) // 1000 == i]
        slow = sorted(r.arrived for r in mine if r.stage in ("a", "b"))
        fast = [r.arrived for r in mine if r.stage == "f"]
        assert len(slow) == 2 * SLOW and len(fast) == 40
        assert max(fast) < slow[len(slow) // 2], (i, max(fast), slow)
    assert leftover(redis_client) == 0
    assert not list(redis_client.scan_iter("redislock:{key:*"))


def test_with_the_middleware_alone_keys_are_taken_in_the_downloader(
    slow_site: CrawlSite, redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The contrast: the same crawl without StageScheduler takes every key slot in the downloader
    (where a request waiting for a busy key holds one of CONCURRENT_REQUESTS)."""
    crawls = crawl(slow_site, redis_url, tmp_path, None)
    for one in crawls:
        assert one.stats["redislock/keys/taken_in_downloader"] == 2 * SLOW + 40
    assert leftover(redis_client) == 0


def render_scope(request: Any, spider: Any) -> list[str]:
    """REDISLOCK_SCOPES_OF for the test: the slow sections' pages go through a shared service."""
    return ["render"] if section_key(request, spider) in ("a", "b") else []


def test_a_busy_scope_waits_in_the_scheduler(
    slow_site: CrawlSite, redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A request's other scopes wait in StageScheduler too: the slow sections' pages each hold the
    scope ``render`` (capped at 1 across the processes) besides their key. None is taken in the
    downloader; the fast section's pages all go while the slow ones wait for the scope."""
    settings = {
        **by_section(redis_url),
        "CONCURRENT_REQUESTS": 3,
        "REDISLOCK_KEY_LIMIT": 4,
        "REDISLOCK_SCOPES": {"render": {"limit": 1}},
        "REDISLOCK_SCOPES_OF": f"{__name__}.render_scope",
    }
    plan = f"detail@a:{SLOW},detail@b:{SLOW},detail@f:40"
    crawls = finish_all(
        [
            Crawl(slow_site.url, plan, settings, tmp_path, args={"first": str(1000 * i)})
            for i in range(PROCESSES)
        ],
        timeout=120,
    )
    for one in crawls:
        assert one.stats.get("finish_reason") == "finished", one.tail()
        assert one.stats.get("redislock/keys/taken_in_downloader", 0) == 0
    site = slow_site
    assert site.count("a") == site.count("b") == PROCESSES * SLOW
    assert site.count("f") == PROCESSES * 40 and set(site.hits.values()) == {1}
    with site.lock:
        served = list(site.served)
    slow = sorted((r.arrived, r.answered) for r in served if r.stage in ("a", "b"))
    for (_, answered), (arrived, _) in itertools.pairwise(slow):
        assert arrived >= answered, slow  # one at a time: the scope's cap held across a and b
    for i in range(PROCESSES):
        mine = [r for r in served if int(r.path.rsplit("/", 1)[1]) // 1000 == i]
        slow_mine = sorted(r.arrived for r in mine if r.stage in ("a", "b"))
        fast = [r.arrived for r in mine if r.stage == "f"]
        assert max(fast) < slow_mine[len(slow_mine) // 2], (i, max(fast), slow_mine)
    assert leftover(redis_client) == 0
    assert site.wait_for(lambda: not list(redis_client.scan_iter("redislock:{key:*")), timeout=10)


def test_a_key_wait_that_runs_out_fails_its_request_and_never_goes_over_the_cap(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A key capped at 1 whose pages take 1.5 s, 2 processes, REDISLOCK_WAIT_TIMEOUT 0.3 s: a
    StageScheduler's wait for the key (the other process holds it) runs out and fails the key's next
    request with AcquireTimeout, as a wait in the middleware would; that request never goes without
    its slot (it once did: the middleware took the handed error for a slot), so the site never sees
    two at once."""
    settings = {
        **by_section(redis_url),
        "CONCURRENT_REQUESTS": 4,
        "REDISLOCK_KEY_LIMITS": {"a": 1},
        "REDISLOCK_WAIT_TIMEOUT": 0.3,
    }
    with CrawlSite(delay=0.02, delays={"a": 1.5}) as site:
        crawls = [
            Crawl(site.url, "detail@a:3", settings, tmp_path, args={"first": str(1000 * i)})
            for i in range(PROCESSES)
        ]
        for one in finish_all(crawls, timeout=120):
            assert one.stats.get("finish_reason") == "finished", one.tail()
        assert site.max_in_flight["a"] == 1, site.max_in_flight  # the cap held
    timeouts = sum(
        one.stats.get("downloader/exception_type_count/scrapy_redislock.errors.AcquireTimeout", 0)
        for one in crawls
    )
    assert timeouts >= 1, [one.stats for one in crawls]
    assert site.count("a") + timeouts == PROCESSES * 3, (
        site.count("a"),
        timeouts,
    )  # went or failed
    assert leftover(redis_client) == 0


def shard_key(request: Any, spider: Any) -> str | None:
    """REDISLOCK_STAGE_KEY for the test: ``meta["shard"]`` once a middleware set it, else the first
    path segment."""
    return request.meta.get("shard") or section_key(request, spider)


class OneShard:
    """A downloader middleware before StageLockMiddleware that changes what the key function reads
    (as a proxy middleware changes ``meta["proxy"]`` of a retried request): every request is of
    key ``x`` from here on."""

    def process_request(self, request: Any, spider: Any = None) -> None:
        request.meta["shard"] = "x"


def test_a_key_slot_handed_for_another_key_is_not_taken_for_the_requests_own(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """StageScheduler takes the slot of the key a request has in the scheduler (a, b, c: each capped
    at 1); a middleware before StageLockMiddleware then gives every request key x (capped at 1).
    The handed slot is of another key: it goes back, and the request takes a slot of x (it once
    went with the other key's slot: 3 in flight at x)."""
    settings = {
        "REDISLOCK_URL": redis_url,
        "SCHEDULER": "scrapy_redislock.StageScheduler",
        "DOWNLOADER_MIDDLEWARES": {
            f"{__name__}.OneShard": 500,
            "scrapy_redislock.StageLockMiddleware": 950,
        },
        "CONCURRENT_REQUESTS": 6,
        "REDISLOCK_STAGES": {"detail": None},
        "REDISLOCK_STAGE_KEY": f"{__name__}.shard_key",
        "REDISLOCK_KEY_LIMIT": 1,
    }
    with CrawlSite(delay=0.02, delays={"a": 0.3, "b": 0.3, "c": 0.3}) as site:
        one = Crawl(site.url, "detail@a:3,detail@b:3,detail@c:3", settings, tmp_path).start()
        one.wait(timeout=120)
        assert one.stats.get("finish_reason") == "finished", one.tail()
        assert site.count("a") == site.count("b") == site.count("c") == 3
        # every request is of key x at the download: one at a time
        assert site.max_host_in_flight["127.0.0.1"] == 1, site.max_host_in_flight
    assert leftover(redis_client) == 0
    assert not list(redis_client.scan_iter("redislock:{key:*"))


def test_a_busy_key_of_a_capped_stage_waits_in_the_scheduler_with_its_stage_slot(
    slow_site: CrawlSite, redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """With a capped stage (detail, 4 across the processes) a request leaves the scheduler only with
    a slot of its stage (passed on in its process, or got by the stage's waits there) and takes its
    key there too, and a busy key's request waits for it there, its stage's slot in hand, holding
    none of CONCURRENT_REQUESTS (3): the caps hold, every page once, no key slot is taken in the
    downloader, and the fast key's pages all go before half of the slow ones."""
    settings = {
        **by_section(redis_url),
        "CONCURRENT_REQUESTS": 3,
        "REDISLOCK_STAGES": {"detail": 4},
        "REDISLOCK_KEY_LIMIT": 4,
        "REDISLOCK_KEY_LIMITS": {"a": 1, "b": 1},
    }
    plan = f"detail@a:{SLOW},detail@b:{SLOW},detail@f:40"
    crawls = finish_all(
        [
            Crawl(slow_site.url, plan, settings, tmp_path, args={"first": str(1000 * i)})
            for i in range(PROCESSES)
        ],
        timeout=120,
    )
    site = slow_site
    for one in crawls:
        assert one.stats.get("finish_reason") == "finished", one.tail()
    # Every key slot was taken in the scheduler: every request left it with its stage's slot (before
    # issue 43's change, those that got their stage's slot in Redis's line waited for it in the
    # middleware and took their key there: 0 to 18 of 56 per process in the scheduler)
    for one in crawls:
        assert one.stats.get("redislock/keys/taken_in_downloader", 0) == 0, one.stats
        assert one.stats["redislock/keys/acquired"] == 2 * SLOW + 40, one.stats
    assert site.count("a") == site.count("b") == PROCESSES * SLOW
    assert site.count("f") == PROCESSES * 40 and set(site.hits.values()) == {1}
    assert site.max_in_flight["a"] == 1 and site.max_in_flight["b"] == 1  # the keys' caps
    with site.lock:
        served = list(site.served)
    events = sorted(
        [(r.arrived, 1) for r in served] + [(r.answered, -1) for r in served],
        key=lambda event: (event[0], event[1]),
    )
    assert max(itertools.accumulate(change for _, change in events)) <= 4  # the stage's cap
    for i in range(PROCESSES):
        mine = [r for r in served if int(r.path.rsplit("/", 1)[1]) // 1000 == i]
        slow = sorted(r.arrived for r in mine if r.stage in ("a", "b"))
        fast = [r.arrived for r in mine if r.stage == "f"]
        print(f"process {i}: last fast page at {max(fast) - slow[0]:.2f} s, slow pages at "
              f"{[round(t - slow[0], 2) for t in slow]}")  # fmt: skip
        assert max(fast) < slow[len(slow) // 2], (i, max(fast), slow)
    assert leftover(redis_client) == 0
    assert site.wait_for(lambda: not list(redis_client.scan_iter("redislock:{key:*")), timeout=10)
