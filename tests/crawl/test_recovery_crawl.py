"""A crawl whose Redis restarts empty does not stall for the recovery window when nobody else may
hold: one process (the only owner alive at its last renewal) takes slots again within about a
renewal interval, with the default 30 s lease (issue 42: it stalled 36 s)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from testing.crawlproc import Crawl
from testing.redis_server import RedisServer
from testing.site import CrawlSite

pytestmark = [pytest.mark.integration, pytest.mark.crawl, pytest.mark.faults]
TTL = 30  # the default lease: waiting it out would outlast the wait below


def test_a_lone_process_takes_slots_again_without_waiting_out_the_window(
    site: CrawlSite, tmp_path: Path
) -> None:
    site.delay = 0.05
    with RedisServer() as server:
        crawl = Crawl(
            site.url,
            "detail:400",
            {
                "REDISLOCK_URL": server.url,
                "REDISLOCK_STAGES": {"detail": 3},
                "REDISLOCK_TTL": TTL,
                "CONCURRENT_REQUESTS": 8,
            },
            tmp_path,
        ).start()
        try:
            took = restart_and_watch(server, site, crawl)
        finally:
            stop(crawl)
    assert took < TTL / 2
    assert site.max_in_flight["detail"] <= 3


def stop(crawl: Crawl) -> None:
    """SIGTERM (no need to crawl the rest), and SIGKILL if it does not end: a failed assertion
    leaves no crawl behind."""
    assert crawl.process is not None
    if crawl.process.poll() is None:
        crawl.signal()
        try:
            crawl.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            crawl.process.kill()
            crawl.process.wait()


def restart_and_watch(server: RedisServer, site: CrawlSite, crawl: Crawl) -> float:
    """Restart Redis empty mid-crawl; the seconds until 30 more pages were fetched."""
    assert crawl.wait_for_output("Stage slots in Redis at", timeout=60), crawl.tail()
    assert site.wait_for(lambda: site.count("detail") >= 30, timeout=60), crawl.tail()
    server.kill()
    server.start()  # empty
    restarted, before = time.monotonic(), site.count("detail")
    # what was in flight finishes; then new requests get slots of the recreated lock
    assert site.wait_for(lambda: site.count("detail") >= before + 30, timeout=TTL / 2), crawl.tail()
    return time.monotonic() - restarted
