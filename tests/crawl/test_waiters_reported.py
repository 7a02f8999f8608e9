"""Waiters are reported for as long as they wait (issue 26, item 5), in a real crawl (`scrapy
runspider`) against a real redis-server: once a process's waits for a stage end, ``status --json``
(``processes[].waiting``, ``stages[].waiters``, what the ``/metrics`` gauge
``redislock_stage_waiters`` reads) shows 0 within a renewal interval, while the process goes on
running. Before, the last ``waiting=N`` stayed in Redis until the process exited."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from scrapy_redislock import CountingLock
from scrapy_redislock.cli.main import main
from testing.crawlproc import Crawl, leftover
from testing.site import CrawlSite
from testing.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crawl]


def stage_status(url: str, stage: str) -> dict[str, Any]:
    """The stage as ``python -m scrapy_redislock status --json`` prints it."""
    out, err = io.StringIO(), io.StringIO()
    code = main(["status", "--json", "--url", url], env={}, stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    return next(s for s in json.loads(out.getvalue())["stages"] if s["stage"] == stage)


def crawl_waiting(url: str, stage: str) -> int:
    """What the crawl process (spider ``plan``) reports waiting for the stage."""
    return sum(p["waiting"] for p in stage_status(url, stage)["processes"] if p["spider"] == "plan")


def test_waiters_are_reported_until_their_waits_end_not_until_the_process_exits(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite, tmp_path: Path
) -> None:
    """An outsider holds the only slot of 'list': the crawl's 3 list requests wait (reported). It
    frees the slot, the crawl fetches them, and its reported waiters drop to 0 within a renewal
    interval (1 s; 3 s allowed) while a slow uncapped page keeps the process running for seconds
    more."""
    outsider = CountingLock(redis_client, "list", limit=1, ttl=30, auto_renew=True)
    outsider.set_limit(1)
    permit = outsider.acquire()
    # the test spider's @stage("detail") callback
    settings = {
        "REDISLOCK_URL": redis_url,
        "REDISLOCK_STAGES": {"list": 1, "detail": None},
        "REDISLOCK_TTL": 30,  # renewals every second; an owner is forgotten only 3 leases (90 s) after its last one
        "CONCURRENT_REQUESTS": 8,
    }
    crawl = Crawl(site.url, "list:3,free:1:sleep=12", settings, tmp_path).start()
    try:
        wait_until(
            lambda: crawl_waiting(redis_url, "list") > 0, 60, "waiters reported", detail=crawl.tail
        )
        outsider.release(permit)
        assert site.wait_for(lambda: site.done("list") == 3, timeout=30), crawl.tail()
        done = time.monotonic()
        wait_until(
            lambda: stage_status(redis_url, "list")["waiters"] == 0,
            3,
            "no waiters reported",
            detail=lambda: (stage_status(redis_url, "list"), crawl.tail()),
        )
        print(f"waiters shown as 0 {time.monotonic() - done:.2f} s after the last list page")
        # still running: not its exit that did it
        assert crawl.process is not None and crawl.process.poll() is None
        assert crawl_waiting(redis_url, "list") == 0
    finally:
        outsider.close()
        crawl.wait()
    assert crawl.code == 0 and crawl.stats["finish_reason"] == "finished", crawl.tail()
    assert crawl.stats["redislock/list/acquired"] == 3
    assert leftover(redis_client) == 0
