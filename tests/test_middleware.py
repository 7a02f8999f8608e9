"""Real crawls (`scrapy runspider` processes) against a local HTTP server and a real redis-server."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from scrapy_redislock import CountingLock
from tests.crawlproc import crawl_command, run_crawl, start_crawl
from tests.crawlsite import CrawlSite

pytestmark = [pytest.mark.integration, pytest.mark.crawl]
STAGES = {"detail": 3, "comments": None}


@pytest.fixture
def site() -> Iterator[CrawlSite]:
    with CrawlSite(delay=0.05) as running:
        yield running


def settings(redis_url: str, **extra: Any) -> dict[str, Any]:
    return {"REDISLOCK_URL": redis_url, "REDISLOCK_STAGES": STAGES, "CONCURRENT_REQUESTS": 16, **extra}


def leftover(client: redis.Redis) -> int:
    """Grants still held in Redis, over every lock."""
    total = 0
    for key in client.scan_iter("redislock:*:slots"):
        total += int(client.xpending(key, "holders")["pending"])
    return total


def stat(output: str, name: str) -> Any:
    for line in output.splitlines():
        if f"'{name}':" in line:
            return eval(line.split(":", 1)[1].strip().rstrip(","))  # our own stats dump
    return None


def test_no_head_of_line_blocking(redis_url: str, redis_client: redis.Redis, site: CrawlSite) -> None:
    """300 capped detail requests queued before 300 uncapped comments: comments still fill the free slots."""
    code, output = run_crawl(site.url, "detail:300,comments:300", settings(redis_url))
    assert code == 0, output[-3000:]
    assert "'finish_reason': 'finished'" in output
    assert site.max_in_flight["detail"] == 3
    assert site.max_in_flight["comments"] >= 12
    assert sum(site.hits.values()) == 600
    # Comments started at once, not after the details.
    first_comment = min(site.arrivals["comments"]) - min(site.arrivals["detail"])
    assert first_comment < 1.0
    assert stat(output, "redislock/detail/acquired") == 300
    assert leftover(redis_client) == 0


def test_head_of_line_blocking_without_the_scheduler(redis_url: str, site: CrawlSite) -> None:
    """The contrast: with the middleware alone, parked detail requests fill CONCURRENT_REQUESTS."""
    code, output = run_crawl(site.url, "detail:150,comments:50", settings(redis_url, SCHEDULER=None))
    assert code == 0, output[-3000:]
    assert site.max_in_flight["detail"] == 3
    first_comment = min(site.arrivals["comments"]) - min(site.arrivals["detail"])
    # 150 - 16 details must finish (3 at a time, 50 ms each) before a comment gets in: > 2 s.
    assert first_comment > 2.0, first_comment


def test_caps_hold_across_processes(redis_url: str, redis_client: redis.Redis, site: CrawlSite) -> None:
    crawls = [start_crawl(site.url, "detail:60,comments:30", settings(redis_url)) for _ in range(3)]
    outputs = [c.communicate(timeout=120)[0] for c in crawls]
    assert all(c.returncode == 0 for c in crawls), outputs[0][-2000:]
    assert site.max_in_flight["detail"] == 3
    assert site.hits and len(site.hits) == 90 and all(n == 3 for n in site.hits.values())
    assert leftover(redis_client) == 0


def test_middleware_alone_caps_and_does_not_hang_on_close(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite
) -> None:
    """Without the scheduler, requests wait in the middleware; a timed close must not hang on them."""
    site.delay = 0.3
    started = time.monotonic()
    code, output = run_crawl(
        site.url,
        "detail:200",
        settings(redis_url, SCHEDULER=None, REDISLOCK_STAGES={"detail": 1}, CLOSESPIDER_TIMEOUT=2),
        timeout=60,
    )
    took = time.monotonic() - started
    assert code == 0, output[-3000:]
    assert "'finish_reason': 'closespider_timeout'" in output
    assert site.max_in_flight["detail"] == 1
    assert took < 20, took
    assert leftover(redis_client) == 0


def test_sigterm_while_requests_wait(redis_url: str, redis_client: redis.Redis, site: CrawlSite) -> None:
    site.delay = 0.3
    for scheduler in ("scrapy_redislock.StageScheduler", None):
        crawl = start_crawl(site.url, "detail:100,comments:5", settings(redis_url, SCHEDULER=scheduler))
        time.sleep(4)
        crawl.send_signal(signal.SIGTERM)
        output = crawl.communicate(timeout=30)[0]
        assert "'finish_reason': 'shutdown'" in output, output[-3000:]
        assert leftover(redis_client) == 0


def test_slot_freed_by_another_process_is_used_at_once(
    redis_url: str, redis_client: redis.Redis, site: CrawlSite
) -> None:
    outsider = CountingLock(redis_client, "detail", limit=3, auto_renew=True)
    outsider.set_limit(3)
    held = [outsider.acquire() for _ in range(3)]
    crawl = start_crawl(site.url, "detail:3", settings(redis_url))
    time.sleep(5)  # the crawl is up and its requests are parked, waiting in Redis
    assert not site.arrivals["detail"]
    delays = []
    for permit in held:
        released = time.monotonic()
        outsider.release(permit)
        deadline = released + 5
        seen = len(delays) + 1
        while len(site.arrivals["detail"]) < seen and time.monotonic() < deadline:
            time.sleep(0.001)
        delays.append(site.arrivals["detail"][seen - 1] - released)
        time.sleep(0.3)
    crawl.communicate(timeout=30)
    outsider.close()
    print("hand-off delays (s):", [round(d, 4) for d in delays])
    assert max(delays) < 0.5  # milliseconds in practice; the engine heartbeat would be 5 s


def test_bad_configuration_stops_the_crawl(redis_url: str, site: CrawlSite) -> None:
    for bad, named in [
        ({"REDISLOCK_STAGES": {"detail": -1}}, "REDISLOCK_STAGES['detail']"),
        ({"REDISLOCK_STAGES": {"detail": "three"}}, "'three'"),
        ({"REDISLOCK_STAGES": ["detail"]}, "REDISLOCK_STAGES must be a dict"),
        ({"REDISLOCK_URL": "http://nope"}, "REDISLOCK_URL"),
        ({"REDISLOCK_TTL": 0}, "REDISLOCK_TTL"),
    ]:
        code, output = run_crawl(site.url, "detail:3", settings(redis_url, **bad), timeout=60)
        assert code != 0 or "ConfigError" in output, output[-2000:]
        assert "ConfigError" in output and named in output, output[-2000:]
    assert not site.hits  # nothing was fetched unthrottled


def test_unreachable_redis_closes_the_spider(site: CrawlSite) -> None:
    for scheduler in ("scrapy_redislock.StageScheduler", None):
        _, output = run_crawl(
            site.url, "detail:3,comments:3", settings("redis://127.0.0.1:1/0", SCHEDULER=scheduler), timeout=60
        )
        assert "'finish_reason': 'redislock_redis_unavailable'" in output, output[-3000:]
    assert "'finish_reason': 'redislock_redis_unavailable'" in output, output[-3000:]
    assert "REDISLOCK_URL" in output
    assert not site.hits


def test_unknown_stage_fails_the_request(redis_url: str, site: CrawlSite) -> None:
    code, output = run_crawl(site.url, "detail:2,nosuch:2", settings(redis_url))
    assert code == 0
    assert stat(output, "redislock/unknown_stage") == 2
    assert "stage 'nosuch' is not configured; known stages: ['comments', 'detail']" in output
    assert not [path for path in site.hits if "nosuch" in path]


def test_requests_bypassing_the_scheduler_are_counted(redis_url: str, site: CrawlSite) -> None:
    """engine.download_async (media pipelines) passes the middleware: counted in its stage.

    robots.txt is exempt even with a default stage (capped requests wait for it in RobotsTxtMiddleware).
    """
    code, output = run_crawl(
        site.url,
        "detail:4",
        settings(redis_url, ROBOTSTXT_OBEY=True, REDISLOCK_DEFAULT_STAGE="detail"),
        timeout=60,
    )
    assert code == 0 and "'finish_reason': 'finished'" in output, output[-3000:]
    assert site.hits["/robots.txt"] == 1
    assert stat(output, "redislock/detail/acquired") == 4
    for scheduler in ("scrapy_redislock.StageScheduler", None):
        site.hits.clear()
        command = crawl_command(site.url, "detail:4", settings(redis_url, SCHEDULER=scheduler))
        command += ["-a", "direct=3"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=Path(__file__).parent.parent)
        assert sum(1 for path in site.hits if path.startswith("/direct/")) == 3, done.stdout[-3000:]
        assert stat(done.stdout + done.stderr, "redislock/detail/acquired") == 7


def test_killed_crawler_slots_return(redis_url: str, redis_client: redis.Redis, site: CrawlSite) -> None:
    site.delay = 0.2
    victim = start_crawl(site.url, "detail:200", settings(redis_url, REDISLOCK_TTL=1.5))
    deadline = time.monotonic() + 20
    while leftover(redis_client) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed = time.monotonic()
    before = len(site.arrivals["detail"])
    survivor = start_crawl(site.url, "detail:5", settings(redis_url, REDISLOCK_TTL=1.5))
    output = survivor.communicate(timeout=60)[0]
    assert survivor.returncode == 0 and "'finish_reason': 'finished'" in output
    first_after = site.arrivals["detail"][before]
    assert first_after - killed < 1.5 + 0.5 + 5  # ttl + renew interval, + the survivor's start-up time
    assert leftover(redis_client) == 0


def test_redis_pause_mid_crawl(redis_url: str, redis_client: redis.Redis, site: CrawlSite) -> None:
    """Redis frozen for 3 s: waiting requests wait, nothing crashes, the crawl finishes with the cap held."""
    pid = int(redis_client.info("server")["process_id"])
    crawl = start_crawl(site.url, "detail:60,comments:20", settings(redis_url))
    time.sleep(3)
    import os

    os.kill(pid, signal.SIGSTOP)
    time.sleep(3)
    os.kill(pid, signal.SIGCONT)
    output = crawl.communicate(timeout=90)[0]
    assert crawl.returncode == 0 and "'finish_reason': 'finished'" in output, output[-3000:]
    assert site.max_in_flight["detail"] <= 3
    assert len(site.hits) == 80
    assert leftover(redis_client) == 0
