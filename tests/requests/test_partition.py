"""Request front, one crawl process cut off from Redis (its REDISLOCK_URL goes through a
testing/netproxy.py LatencyProxy that blackholes it; Redis, the site and the other processes carry
on). Real crawls (``scrapy runspider``), counted at the site:

- the healthy processes get back the slots Redis hands to the silent process's waits within about
  a renewal interval, not a lease, and keep the stage going;
- no capped request is in flight at the site past its slot's lease: the cut-off process's downloads
  end before Redis gives their slots to the others.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from scrapy_redislock import CountingLock
from scrapy_redislock.lock.permit import GROUP, LockKeys
from testing.crawlproc import Crawl
from testing.netproxy import LatencyProxy
from testing.site import CrawlSite
from testing.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crawl]


def settings(url: str, name: str, **more: Any) -> dict[str, Any]:
    return {
        "REDISLOCK_URL": url,
        "REDISLOCK_STAGES": {"detail": 3},
        "CONCURRENT_REQUESTS": 16,
        "USER_AGENT": name,  # the site counts each process's requests apart
        **more,
    }


def blocked_reads(client: redis.Redis) -> int:
    """Waits blocked in Redis's line (XREADGROUP ... BLOCK)."""
    return sum(
        1 for c in client.client_list() if c.get("cmd") == "xreadgroup" and "b" in c["flags"]
    )


def served_by(site: CrawlSite, who: set[str]) -> int:
    with site.lock:
        return sum(1 for r in site.served if r.stage == "detail" and r.worker in who)


def in_flight_of(site: CrawlSite, who: set[str]) -> int:
    with site.lock:
        return sum(n for w, n in site.workers_in_flight["detail"].items() if w in who)


def confirmed_grants(client: redis.Redis, pid: int) -> int:
    """Grants of the process ``pid`` that Redis counts as confirmed: renewed (under its owner's own
    consumer) or taken at once (delivery count 2); not those handed to its waits since."""
    keys = LockKeys.of("redislock", "detail")
    count = 0
    for entry in client.xpending_range(keys.slots, GROUP, "-", "+", 100):
        consumer = entry["consumer"].decode()
        if f":{pid}:" in consumer and ("#" not in consumer or entry["times_delivered"] > 1):
            count += 1
    return count


def unconfirmed_grants(client: redis.Redis, pid: int) -> int:
    """Grants Redis handed to the waits of the process ``pid`` that it has not confirmed."""
    keys = LockKeys.of("redislock", "detail")
    return sum(
        1
        for entry in client.xpending_range(keys.slots, GROUP, "-", "+", 100)
        if f":{pid}:" in entry["consumer"].decode()
        and "#" in entry["consumer"].decode()
        and entry["times_delivered"] == 1
    )


def test_the_healthy_processes_get_the_silent_one_s_waits_slots_back_and_go_on(
    redis_url: str,
    redis_client: redis.Redis,
    redis_proxy: Callable[[], LatencyProxy],
    tmp_path: Path,
) -> None:
    """TTL 30 s (a renewal interval of 1 s); before the fix, the two healthy processes started no
    detail request for up to a lease after the cut."""
    proxy = redis_proxy()
    with CrawlSite(delay=0.2) as site:
        common = {"REDISLOCK_TTL": 30}
        silent = Crawl(site.url, "detail:150", settings(proxy.url, "c", **common), tmp_path).start()
        healthy = [
            Crawl(
                site.url, f"detail:150:p={name}", settings(redis_url, name, **common), tmp_path
            ).start()
            for name in ("a", "b")
        ]
        crawls = [silent, *healthy]
        try:
            wait_until(lambda: served_by(site, {"a", "b", "c"}) >= 30, 60, "all three crawling")
            assert silent.process is not None
            # cut it while it holds at most one slot (its share; what it holds stays its own for
            # the lease: it may be downloading with it)
            wait_until(
                lambda: confirmed_grants(redis_client, silent.process.pid) <= 1,  # type: ignore[union-attr]
                30,
                "the silent process holds one slot at most",
            )
            proxy.blackhole()
            cut = time.monotonic()
            kept = confirmed_grants(redis_client, silent.process.pid)
            before = served_by(site, {"a", "b"})
            # the slots freed since go first to its waits (they stay in Redis's line), which cannot
            # confirm them: Redis takes each back after about a renewal interval, and the healthy
            # ones get them (before the fix: each was lost for the lease, 30 s)
            wait_until(
                lambda: unconfirmed_grants(redis_client, silent.process.pid) >= 1,  # type: ignore[union-attr]
                10,
                "a slot handed to a wait of the silent process",
            )
            wait_until(
                lambda: (
                    unconfirmed_grants(redis_client, silent.process.pid) == 0  # type: ignore[union-attr]
                    and blocked_reads(redis_client) <= 4  # a's and b's waits only
                    and in_flight_of(site, {"a", "b"}) >= 3 - kept
                ),
                10,
                f"the healthy processes hold the {3 - kept} slots the silent one does not keep",
            )
            back = time.monotonic() - cut
            wait_until(
                lambda: served_by(site, {"a", "b"}) >= before + 40,
                30,
                "the healthy processes go on crawling",
            )
            print(
                f"cut holding {kept}; every slot handed to its waits back and the healthy "
                f"processes holding {3 - kept} {back:.2f} s after the cut"
            )
            assert site.max_in_flight["detail"] <= 3
        finally:
            proxy.heal()
            for crawl in crawls:
                crawl.wait(120)
        for crawl in crawls:
            assert crawl.code == 0, crawl.tail()
        assert site.max_in_flight["detail"] <= 3
        assert {f"/detail/{n}" for n in range(150)} <= set(site.hits)


# Scrapy's downloader queues a process's requests per site: with one at a time and a delay between
# them, a request that left the middleware with its slot waits there, and starts after the lease
# ran out
QUEUED_IN_DOWNLOADER = {"CONCURRENT_REQUESTS_PER_DOMAIN": 1, "DOWNLOAD_DELAY": 2}


@pytest.mark.parametrize("queued", [False, True], ids=["downloading", "queued-in-downloader"])
def test_a_cut_off_holder_s_downloads_end_before_its_slots_go_to_others(
    redis_url: str,
    redis_client: redis.Redis,
    redis_proxy: Callable[[], LatencyProxy],
    tmp_path: Path,
    queued: bool,
) -> None:
    """TTL 3 s, 6 s pages: before the fix, the cut-off holder's downloads ran on after Redis had
    given their slots to the others (5 in flight at the site, cap 3). Now every capped download
    ends within its slot's lease as last confirmed: here each is cut (a page longer than a lease).
    And with its requests queued in Scrapy's downloader (one at a time per site, 2 s apart): those
    that started there after the leases ran out, their download timeouts set as they left the
    middleware, ran at the site while Redis could give their slots to others; now they are bounded
    again as they start, and not sent."""
    proxy = redis_proxy()
    with CrawlSite(delay=6) as site:
        site.watch_disconnects = True  # an aborted download leaves the site's count at once
        common: dict[str, Any] = {
            "REDISLOCK_TTL": 3,
            "DOWNLOAD_TIMEOUT": 20,
            "REDISLOCK_WAITERS_PER_STAGE": 3,
            **(QUEUED_IN_DOWNLOADER if queued else {}),
        }
        # a rival holds every slot until all three processes wait in Redis's line, the holder first
        rival = CountingLock(
            redis.Redis.from_url(redis_url), "detail", limit=3, ttl=3, auto_renew=True
        )
        held = [rival.acquire(timeout=10) for _ in range(3)]
        holder = Crawl(site.url, "detail:3", settings(proxy.url, "c", **common), tmp_path).start()
        others: list[Crawl] = []
        try:
            wait_until(lambda: blocked_reads(redis_client) >= 2, 60, "the holder waits")
            others = [
                Crawl(
                    site.url, f"detail:3:p={name}", settings(redis_url, name, **common), tmp_path
                ).start()
                for name in ("a", "b")
            ]
            wait_until(lambda: blocked_reads(redis_client) >= 4, 60, "the others wait behind it")
            for permit in held:
                rival.release(permit)
            downloading = 1 if queued else 2
            wait_until(lambda: in_flight_of(site, {"c"}) >= downloading, 30, "the holder downloads")
            proxy.blackhole()  # cut off while holding: its leases run out unrenewed
            # the others get the slots once the holder's leases ran out; by then its downloads
            # were aborted
            wait_until(lambda: in_flight_of(site, {"c"}) == 0, 30, "the holder's downloads over")
            wait_until(lambda: served_by(site, {"a", "b"}) >= 6, 60, "the others' downloads over")
            assert site.max_in_flight["detail"] <= 3, site.samples
        finally:
            proxy.heal()
            rival.close()
            for crawl in (holder, *others):
                crawl.wait(120)
        assert site.max_in_flight["detail"] <= 3
        for crawl in (holder, *others):
            stats = crawl.stats
            # every download was longer than a lease: each was cut by its download timeout, or,
            # queued in the downloader past its lease, not sent (LeaseRanOut)
            cut = sum(
                v
                for k, v in stats.items()
                if k.startswith("downloader/exception_type_count/")
                and ("Timeout" in k or "LeaseRanOut" in k)
            )
            assert cut == stats.get("redislock/detail/lease_bounded") == 3, stats
        if queued:
            assert any("did not start" in line for line in holder.lines), holder.tail()
        print(f"most detail requests in flight at the site: {site.max_in_flight['detail']} (cap 3)")


def section_key(request: Any, spider: Any) -> str | None:
    """REDISLOCK_STAGE_KEY for the test: the first path segment (``/a/7`` -> ``a``)."""
    return urlsplit(request.url).path.strip("/").split("/")[0] or None


def test_a_cut_off_holder_s_download_ends_before_its_key_slot_goes_to_another(
    redis_url: str,
    redis_client: redis.Redis,
    redis_proxy: Callable[[], LatencyProxy],
    tmp_path: Path,
) -> None:
    """A broad crawl's cap is its key's (no capped stage): TTL 3 s, a 6 s page of key a (capped
    at 1). Its holder is cut off from Redis; another process takes the key's slot once the lease
    ran out. The holder's download ends within the key slot's lease as last confirmed, as a capped
    stage's does (it once ran on: 2 in flight at a key capped at 1)."""
    proxy = redis_proxy()
    common = {
        "REDISLOCK_STAGES": {"detail": None},
        "REDISLOCK_STAGE_KEY": f"{__name__}.section_key",
        "REDISLOCK_KEY_LIMITS": {"a": 1},
        "REDISLOCK_TTL": 3,
        "DOWNLOAD_TIMEOUT": 20,
    }
    with CrawlSite(delay=0.02, delays={"a": 6}) as site:
        site.watch_disconnects = True  # an aborted download leaves the site's count at once
        holder = Crawl(site.url, "detail@a:1", settings(proxy.url, "c", **common), tmp_path).start()
        other: Crawl | None = None
        try:
            wait_until(lambda: site.in_flight["a"] >= 1, 60, "the holder downloads")
            proxy.blackhole()  # cut off while holding: its lease runs out unrenewed
            other = Crawl(
                site.url,
                "detail@a:1",
                settings(redis_url, "a", **common),
                tmp_path,
                args={"first": "1000"},
            ).start()
            other.wait(120)
            assert other.stats.get("finish_reason") == "finished", other.tail()
            assert site.max_in_flight["a"] == 1, site.samples
        finally:
            proxy.heal()
            holder.wait(120)
            if other is not None:
                other.wait(120)
        assert site.max_in_flight["a"] == 1
        stats = holder.stats
        cut = sum(
            v
            for k, v in stats.items()
            if k.startswith("downloader/exception_type_count/") and "Timeout" in k
        )
        assert cut == stats.get("redislock/keys/a/lease_bounded") == 1, stats
