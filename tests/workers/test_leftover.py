"""A dupefilter left by an earlier crawl of the worker front (issue 42): a run that finds one with no
queued or in-flight work and no worker alive clears it when not persisting (a crawl killed before
its close left it), or says so and does not finish as a clean ``finished`` when it filtered all it
was given (SCHEDULER_PERSIST = True)."""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Iterator

import pytest
import redis

from testing.crawlproc import staged_worker
from testing.redis_server import RedisServer
from testing.site import CrawlSite
from testing.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crawl]
PAGES = 20
BASE = "redislock:{staged}"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as started:
        yield started


def finish(process: subprocess.Popen[str], timeout: float = 90) -> tuple[int, str]:
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output


def finish_reason(output: str) -> str | None:
    found = re.search(r"'finish_reason': '([^']+)'", output)
    return found.group(1) if found else None


def nobody_alive(client: redis.Redis, ttl_ms: int) -> bool:
    seconds, micros = client.time()
    now = int(seconds) * 1000 + int(micros) // 1000
    return not client.zrangebyscore(f"{BASE}:alive", now - ttl_ms, "+inf")


SETTINGS = {"REDISLOCK_WORKER_STAGES": {"a": None}, "REDISLOCK_IDLE_CLOSE": 1}


def test_a_dupefilter_left_by_a_killed_crawl_is_cleared_when_not_persisting(
    server: RedisServer,
) -> None:
    """The crawl fetched every page and was SIGKILLed before its close: its dupefilter stayed. The
    next run (SCHEDULER_PERSIST = False) clears it, says so at WARNING, and fetches every page
    again (before: it fetched nothing, the duplicates were logged at DEBUG, and it exited 0 as
    'finished')."""
    client = redis.Redis.from_url(server.url)
    settings = {**SETTINGS, "SCHEDULER_PERSIST": False}
    with CrawlSite() as site:
        first = staged_worker(server.url, site.url, f"a:{PAGES}", settings)
        try:
            wait_until(lambda: site.count("a") == PAGES, 60, "the first crawl's pages")
            # every request handled and acknowledged: nothing queued or in flight, only the dupefilter
            wait_until(
                lambda: (
                    int(client.get(f"{BASE}:inflight_total") or 0) == 0
                    and not client.llen(f"{BASE}:queue:a")
                ),
                30,
                "the first crawl's acknowledgements",
            )
        finally:
            first.send_signal(signal.SIGKILL)  # before its close: the dupefilter stays
            finish(first)
        assert client.scard(f"{BASE}:dupefilter") == PAGES
        wait_until(lambda: nobody_alive(client, 2000), 30, "the killed worker's beat to lapse")
        code, output = finish(staged_worker(server.url, site.url, f"a:{PAGES}", settings))
        assert code == 0, output[-3000:]
        assert finish_reason(output) == "finished", output[-3000:]
        assert (
            f"found the dupefilter of an earlier crawl of spider 'staged' ({PAGES} fingerprints)"
            in output
        ), output[-3000:]
        assert sorted(site.hits.values()) == [2] * PAGES  # every page again
    client.close()


def test_a_kept_dupefilter_that_filters_a_whole_run_is_no_clean_finish(
    server: RedisServer,
) -> None:
    """SCHEDULER_PERSIST = True keeps the dupefilter of a finished crawl, as scrapy-redis does: a run
    of the same requests is told so at start, fetches nothing, says so with the count at close,
    and finishes as redislock_all_filtered with exit status 1."""
    settings = {**SETTINGS, "SCHEDULER_PERSIST": True}
    with CrawlSite() as site:
        code, output = finish(staged_worker(server.url, site.url, f"a:{PAGES}", settings))
        assert code == 0 and finish_reason(output) == "finished", output[-3000:]
        code, output = finish(staged_worker(server.url, site.url, f"a:{PAGES}", settings))
        assert "the dupefilter of an earlier crawl of spider 'staged' is kept" in output
        assert (
            f"fetched nothing: the {PAGES} request(s) it was given were all filtered" in output
        ), output[-3000:]
        assert finish_reason(output) == "redislock_all_filtered", output[-3000:]
        assert code == 1
        assert sorted(site.hits.values()) == [1] * PAGES


def test_a_second_worker_of_a_live_crawl_clears_nothing(server: RedisServer) -> None:
    """Not a leftover: a worker that starts while another works (its dupefilter, its queue) clears
    nothing and says nothing of it; every page once."""
    settings = {**SETTINGS, "SCHEDULER_PERSIST": False}
    # the first worker alone would take 20 s: still at work when the second has started, however
    # slowly
    with CrawlSite(delay=1.0) as site:
        first = staged_worker(
            server.url, site.url, f"a:{PAGES}", {**settings, "CONCURRENT_REQUESTS": 1}
        )
        try:
            wait_until(lambda: site.count("a") >= 2, 60, "the first worker's pages")
        except AssertionError:
            first.kill()
            finish(first)
            raise
        second = staged_worker(server.url, site.url, f"a:{PAGES}", settings)
        code, output = finish(second)
        assert code == 0 and "earlier crawl" not in output, output[-3000:]
        code, output = finish(first)
        assert code == 0 and "earlier crawl" not in output, output[-3000:]
        assert sorted(site.hits.values()) == [1] * PAGES
