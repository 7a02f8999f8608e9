"""The request front on a quorum of three independent masters, in real ``scrapy runspider`` crawls
against the local site (which records every request's arrival and answer on the shared monotonic
clock): caps hold, every page is fetched once, nothing is left on any master; one master SIGKILLed
mid-crawl (L=1, q=2: the crawl goes on); one master down with L=3 (q=3: the stage waits, says why,
and resumes only one TTL after the master came back empty); the first master a Sentinel service
whose master is SIGKILLed (L=1: the crawl goes on and follows the promoted replica)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from testing.crawlproc import Crawl, leftover
from testing.redis_server import RedisSentinelServers, RedisServer
from testing.site import CrawlSite

from .test_high_availability import finish, longest_pause, most_at_once, report, served

pytestmark = [pytest.mark.integration, pytest.mark.crawl, pytest.mark.faults]

TTL = 3.0


@pytest.fixture
def masters() -> Iterator[list[RedisServer]]:
    started = [RedisServer().start() for _ in range(3)]
    yield started
    for server in started:
        server.stop()


def held_on(servers: list[RedisServer]) -> list[int]:
    counts = []
    for server in servers:
        with redis.Redis(port=server.port, socket_timeout=5) as client:
            counts.append(leftover(client))
    return counts


def commands(servers: list[RedisServer]) -> int:
    """Commands the masters served so far (INFO commandstats, summed over every master)."""
    total = 0
    for server in servers:
        with redis.Redis(port=server.port, socket_timeout=5) as client:
            total += sum(int(stat["calls"]) for stat in client.info("commandstats").values())
    return total


def crawls(
    site: CrawlSite, masters: list[str], limit: int, pages: int, folder: Path
) -> list[Crawl]:
    """Two crawl processes sharing one capped stage over the three masters' URLs (pages /detail/<n>
    and /d2/<n>)."""
    settings = {
        "REDISLOCK_URL": masters,
        "REDISLOCK_STAGES": {"detail": limit},
        "REDISLOCK_TTL": TTL,
        "CONCURRENT_REQUESTS": 4,
    }
    started = [
        Crawl(site.url, f"detail:{pages}", settings, folder).start(),
        Crawl(site.url, f"detail@d2:{pages}", settings, folder).start(),
    ]
    for crawl in started:
        assert crawl.wait_for_output(f"Stage slots in Redis at [{masters[0].split('://')[0]}://"), (
            crawl.tail()
        )
    return started


def urls(servers: list[RedisServer]) -> list[str]:
    return [server.url for server in servers]


def running(site: CrawlSite, started: list[Crawl], pages: int = 5) -> None:
    """Both processes demonstrably crawling: the site answered ``pages`` of each, and both still
    run."""
    assert site.wait_for(lambda: min(site.done("detail"), site.done("d2")) >= pages, timeout=60)
    assert all(crawl.process is not None and crawl.process.poll() is None for crawl in started)


def test_a_quorum_crawl_holds_the_cap_and_leaves_nothing(
    masters: list[RedisServer], site: CrawlSite, tmp_path: Path
) -> None:
    """L=3 over three masters (q=3), two processes: never more than 3 requests at the site, every
    page once."""
    pages = 60
    started = crawls(site, urls(masters), 3, pages, tmp_path)
    finish(started)
    assert len(site.hits) == 2 * pages and set(site.hits.values()) == {1}
    most, above = most_at_once(served(site, "detail", "d2"), 3)
    report(
        "quorum crawl, N=3 L=3",
        most=most,
        above_cap_s=above,
        commands_per_page=commands(masters) / (2 * pages),
    )
    assert most <= 3 and above == 0
    assert sum(crawl.stats.get("redislock/detail/acquired", 0) for crawl in started) == 2 * pages
    assert held_on(masters) == [0, 0, 0]


def test_a_quorum_crawl_goes_on_with_two_of_three_masters_for_a_mutex(
    masters: list[RedisServer], site: CrawlSite, tmp_path: Path
) -> None:
    """L=1 (q=2): the first master (the waiters' lead) is SIGKILLed mid-crawl; both processes go on
    with the other two, the cap holds, every page is fetched once, nothing is left on the
    survivors."""
    pages = 40
    started = crawls(site, urls(masters), 1, pages, tmp_path)
    running(site, started)
    killed_at = time.monotonic()
    masters[0].kill()
    finish(started)
    assert len(site.hits) == 2 * pages and set(site.hits.values()) == {1}
    records = served(site, "detail", "d2")
    most, above = most_at_once(records, 1)
    after = [r for r in records if r.arrived >= killed_at]
    report(
        "quorum crawl, N=3 L=1, master 0 killed",
        most=most,
        above_cap_s=above,
        longest_pause=longest_pause(records),
        after_kill=len(after),
    )
    assert most == 1 and above == 0
    assert len(after) > 0
    assert held_on(masters[1:]) == [0, 0]


def test_a_quorum_stage_stops_with_a_master_down_and_resumes_one_ttl_after_it_is_back(
    masters: list[RedisServer], site: CrawlSite, tmp_path: Path
) -> None:
    """L=3 over three masters: the safe quorum is 3, so one master down stops granting. The stage
    waits and says why (that master is unreachable); the master comes back empty, and the lock there
    is recreated with every slot reserved for one TTL (a restarted master must not rejoin early): no
    request starts before that TTL is over. Then the crawl finishes, capped, every page once,
    nothing left on any master."""
    site.delay = 0.1
    pages = 40
    started = crawls(site, urls(masters), 3, pages, tmp_path)
    running(site, started)
    masters[1].kill()
    killed_at = time.monotonic()  # after: it starts the window in which nothing may be granted
    unreachable = f"master 1 (redis://127.0.0.1:{masters[1].port}/0): unreachable"
    assert any(crawl.wait_for_output(unreachable, timeout=30) for crawl in started)
    said = next(line for crawl in started for line in crawl.lines if unreachable in line)
    assert "has no free slot after " in said and "masters have a free slot, 3 needed" in said, said
    before = len(site.served)
    # before start(): a crawl may reach the master before start() has seen it ready
    back_at = time.monotonic()
    masters[1].start()  # empty: no persistence
    assert all(crawl.process is not None and crawl.process.poll() is None for crawl in started)
    finish(started)
    records = served(site, "detail", "d2")
    stalled = [r.arrived for r in records if killed_at + 0.5 < r.arrived < back_at + TTL]
    resumed = min(r.arrived for r in records if r.arrived > killed_at + 0.5)
    report("quorum crawl, N=3 L=3, master 1 "
           "down", served_before_restart=before, down_s=back_at - killed_at,
           resumed_after_restart=resumed - back_at, longest_pause=longest_pause(records),
           lost=sum(c.stats.get("redislock/detail/lost", 0) for c in started))  # fmt: skip
    # nothing granted while down, nor for a TTL after
    assert stalled == [], [s - back_at for s in stalled]
    assert len(site.hits) == 2 * pages and set(site.hits.values()) == {1}
    most, above = most_at_once(records, 3)
    assert most <= 3 and above == 0
    assert held_on(masters) == [0, 0, 0]


def evalsha_calls(server: RedisServer) -> int:
    """Lock scripts the server ran so far (INFO commandstats): whether a crawl reached it."""
    with redis.Redis(port=server.port, socket_timeout=5) as client:
        return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_a_quorum_crawl_with_a_sentinel_service_as_one_master_follows_its_failover(
    site: CrawlSite, tmp_path: Path
) -> None:
    """L=1 (q=2) over three masters, the first (the waiters' lead) a Sentinel service
    (``redis+sentinel://``: master, replica, three sentinels), the others plain redis-servers.
    Mid-crawl the service's master is SIGKILLed, with its writes paused and every one on the replica
    first (so that the failover loses no grant: a lost one is the window described for one Sentinel,
    not what this test is about). The crawl goes on with the other two, the sentinels promote the
    replica, the crawl uses it; the cap holds at the site, every page is fetched once, both
    processes exit 0, nothing is left held on any master (the service read through its promoted
    master)."""
    site.delay = 0.1
    pages = 40
    with RedisSentinelServers() as service, RedisServer() as one, RedisServer() as two:
        started = crawls(site, [service.url(), one.url, two.url], 1, pages, tmp_path)
        running(site, started)
        dead = service.master()
        # the crawl reached the service's master through the sentinels
        assert evalsha_calls(dead) > 0
        # a page a second until the replica is promoted: the crawl cannot end before
        site.delay = 1.0
        service.ask(dead, "CLIENT", "PAUSE", "10000", "WRITE")
        service.wait_synced()  # every grant and release is on the replica
        promoted, promoted_after = service.fail_over()
        used_before = evalsha_calls(promoted)
        site.delay = 0.1
        # still crawling
        assert all(crawl.process is not None and crawl.process.poll() is None for crawl in started)
        finish(started)
        assert len(site.hits) == 2 * pages and set(site.hits.values()) == {1}
        records = served(site, "detail", "d2")
        most, above = most_at_once(records, 1)
        report("quorum crawl, N=3 L=1, master 0 a Sentinel service that fails "
               "over", promoted_after=promoted_after,
               most=most, above_cap_s=above, longest_pause=longest_pause(records),
               promoted_scripts=evalsha_calls(promoted) - used_before)  # fmt: skip
        assert most == 1 and above == 0
        # the crawl followed the service to its promoted master
        assert evalsha_calls(promoted) > used_before
        assert held_on([promoted, one, two]) == [0, 0, 0]
