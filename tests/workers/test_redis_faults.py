"""The worker front when a stage is paused and when Redis goes away: nothing queued is cleared or
forgotten, a Redis that comes back empty is said loudly, an outage is one warning.

Real ``scrapy runspider`` workers (``testing/spiders/workerspider.py``) against a local site; the
restart and outage tests run their own redis-server (``testing.redis_server.RedisServer``), which
they kill and start again.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
from typing import Any

import pytest
import redis
import redis.asyncio

from scrapy_redislock.workers.queue import QueueKeys, StageQueues
from testing.crawlproc import staged_worker
from testing.redis_server import RedisServer
from testing.site import CrawlSite
from testing.waiting import wait_until
from tests.workers.test_mixin import seed, stat

KEYS = QueueKeys.of("redislock", "staged")


class Worker:
    """A worker process whose output is read as it comes (to wait for a line while it runs)."""

    def __init__(self, redis_url: str, site: CrawlSite, settings: dict[str, Any]) -> None:
        self.process = staged_worker(redis_url, site.url, "", settings)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        # closed at the end of the output (an open pipe is a ResourceWarning)
        with self.process.stdout:
            for line in self.process.stdout:
                self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def running(self) -> bool:
        return self.process.poll() is None

    def ended(self) -> str | None:
        """For wait_until: that the worker ended, with its last output."""
        return None if self.running() else f"the worker ended:\n{self.output[-3000:]}"

    def finish(self, timeout: float = 90, code: int = 0) -> str:
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            self.reader.join()
            raise AssertionError(
                f"the worker did not end within {timeout} s:\n{self.output[-3000:]}"
            ) from None
        self.reader.join()
        assert self.process.returncode == code, self.output[-3000:]
        return self.output

    def kill(self) -> None:
        if self.running():
            self.process.kill()
        self.process.wait()
        self.reader.join()


def lines_with(output: str, text: str) -> list[str]:
    return [line for line in output.splitlines() if text in line]


def finish_reason(output: str) -> str:
    found = re.search(r"'finish_reason': '([^']*)'", output)
    return found.group(1) if found else ""


# -- a paused stage is work: no idle close, no clear -----------------------------------------------


@pytest.mark.integration
@pytest.mark.crawl
def test_a_paused_stage_keeps_an_idle_close_worker_waiting_and_its_queue_then_every_page_is_fetched(
    redis_url: str, admin_url: str, redis_client: redis.Redis
) -> None:
    """Issue 26, item 1: a stage at limit 0 with 30 queued requests, REDISLOCK_IDLE_CLOSE 0.5 s and
    SCHEDULER_PERSIST False (scrapy-redis's default). The worker must neither close as idle nor
    clear the queues: the old code did both at the engine's first idle check (5 s in), its last look
    at the queues (at its previous heartbeat, every ttl/3 = 6 s) being older than
    REDISLOCK_IDLE_CLOSE. Once the limit is raised it fetches every page once."""
    with CrawlSite(delay=0.02) as site:
        pages = {f"/a/{n}" for n in range(30)}
        seed(redis_url, "staged", ["a"], {"a": [site.url + page for page in sorted(pages)]})
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 0},
            "REDISLOCK_TTL": 18,
            "REDISLOCK_IDLE_CLOSE": 0.5,
        }
        worker = Worker(redis_url, site, settings)
        try:
            wait_until(
                lambda: redis_client.zcard(KEYS.alive) == 1,
                60,
                "the worker to register",
                ended=worker.ended,
            )
            (name,) = redis_client.zrange(KEYS.alive, 0, -1)
            first = redis_client.zscore(KEYS.alive, name)
            assert first is not None
            # The engine's idle checks come every 5 s: wait for the worker's next heartbeat (6 s
            # later on Redis's clock), after the first of them.
            wait_until(
                lambda: (redis_client.zscore(KEYS.alive, name) or 0) - first >= 5500,
                60,
                "the worker's next heartbeat while the stage is paused",
                ended=worker.ended,
            )
            assert redis_client.llen(KEYS.queue("a")) == 30, "the paused stage's queue was touched"
            assert not site.hits
            assert "cleared the queues" not in worker.output
            raised = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "scrapy_redislock",
                    "set-limit",
                    "workers:a",
                    "1",
                    "--url",
                    admin_url,
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert raised.returncode == 0, raised.stdout + raised.stderr
            output = worker.finish()
        finally:
            worker.kill()
        assert finish_reason(output) == "finished"
        assert set(site.hits) == pages and set(site.hits.values()) == {1}
        # the crawl is finished now: the last worker out clears
        assert "cleared the queues" in output
        assert redis_client.keys("redislock:{staged}:*") == []


def test_the_last_worker_out_clears_only_a_finished_crawl(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """SCHEDULER_PERSIST = False at close (StageQueues.clear_if_finished): nothing is deleted while
    a stage queue (a paused one's too) or an in-flight record holds a request; a flush on start
    (clear_if_alone) still flushes."""

    async def scenario() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        last = StageQueues(client, "staged", ["a", "b"], ttl=30, worker="last")
        try:
            await last.beat(None)
            await last.epoch()
            await last.push("b", "fp0", b"r0")
            # queued (the stage may be paused: no matter)
            assert await last.clear_if_finished() == -1
            assert (
                redis_client.llen(KEYS.queue("b")) == 1 and redis_client.scard(KEYS.dupefilter) == 1
            )
            (popped,) = await last.pop("b", 5) or []
            assert await last.clear_if_finished() == -1  # in flight
            assert redis_client.hlen(KEYS.inflight("last")) == 1
            await last.ack([popped[0]])
            assert await last.clear_if_finished() == 1
            assert redis_client.keys("redislock:{staged}:*") == []
            await last.beat(None)
            await last.push("a", "fp1", b"r1")
            # SCHEDULER_FLUSH_ON_START: the operator asked for it
            assert await last.clear_if_alone()
            assert redis_client.keys("redislock:{staged}:*") == []
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_the_queues_epoch_changes_only_when_the_crawl_state_is_gone(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        a, b = (StageQueues(client, "staged", ["a"], ttl=30, worker=name) for name in "ab")
        try:
            epoch = await a.epoch()
            assert epoch and await b.epoch() == epoch and await a.epoch() == epoch
            await a.beat(None)
            await a.leave()  # unregistered (as a worker taken for dead): the state is still there
            assert await a.epoch() == epoch
            redis_client.flushdb()  # a restart without persistence
            assert await b.epoch() not in ("", epoch)
        finally:
            await client.aclose()

    asyncio.run(scenario())


# -- Redis restarted empty, and an outage ----------------------------------------------------------


@pytest.mark.integration
@pytest.mark.crawl
@pytest.mark.faults
def test_redis_restarted_empty_under_a_worker_is_one_error_a_stat_and_its_own_finish_reason() -> (
    None
):
    """Issue 26, item 4: the queues vanish with a restart without persistence. The old code went on
    as if nothing happened (at most a "taken for dead" warning) and finished as ``finished``."""
    with RedisServer() as server, CrawlSite(delay=0.05) as site:
        seed(server.url, "staged", ["a"], {"a": [f"{site.url}/a/{n}" for n in range(80)]})
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 1},
            "REDISLOCK_TTL": 1.5,
            "REDISLOCK_IDLE_CLOSE": 1,
        }
        worker = Worker(server.url, site, settings)
        try:
            wait_until(lambda: len(site.hits) >= 5, 60, "the crawl to start", ended=worker.ended)
            server.kill()
            server.start()  # empty: no persistence
            output = worker.finish(code=1)  # lost work is no clean exit
        finally:
            worker.kill()
        errors = lines_with(output, " ERROR: ")
        assert len(errors) == 1, errors
        assert "Redis lost the worker queues of spider 'staged'" in errors[0]
        assert stat(output, "redislock/workers/queue_lost") == 1
        assert finish_reason(output) == "redislock_queue_lost"
        assert "taken for dead" not in output
        assert "Traceback" not in output
        assert len(site.hits) < 80  # what the restart lost was never fetched


@pytest.mark.integration
@pytest.mark.crawl
@pytest.mark.faults
def test_a_redis_outage_is_one_warning_then_one_info_line_no_error_no_traceback_every_page_fetched() -> (
    None
):
    """Issue 26, item 6: Redis killed mid-crawl and started again with its data (AOF, fsync always).
    The old code logged ERROR "Worker loop failed; retrying" with a traceback at every retry of the
    loop."""
    aof = ["--appendonly", "yes", "--appendfsync", "always"]
    with RedisServer(extra_args=aof) as server, CrawlSite(delay=0.05) as site:
        pages = {f"/a/{n}" for n in range(100)}
        seed(server.url, "staged", ["a"], {"a": [site.url + page for page in sorted(pages)]})
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 1},
            "REDISLOCK_TTL": 3,
            "REDISLOCK_IDLE_CLOSE": 1,
        }
        worker = Worker(server.url, site, settings)
        try:
            wait_until(lambda: len(site.hits) >= 10, 60, "the crawl to start", ended=worker.ended)
            server.kill()
            wait_until(
                lambda: (
                    "Redis does not answer" in worker.output
                    or "Worker loop failed" in worker.output
                ),
                30,
                "the worker to see the outage",
                ended=worker.ended,
            )
            server.start()  # its data back from the AOF
            output = worker.finish()
        finally:
            worker.kill()
        assert "Traceback" not in output
        assert not lines_with(output, " ERROR: "), lines_with(output, " ERROR: ")
        front = [line for line in output.splitlines() if "[scrapy_redislock.workers" in line]
        down = [line for line in front if "Redis does not answer" in line]
        back = [line for line in front if "Redis answers again" in line]
        assert len(down) == 1 and " WARNING: " in down[0], down
        assert len(back) == 1 and " INFO: " in back[0], back
        assert not [line for line in front if "retrying in" in line and " DEBUG: " not in line], (
            front
        )
        assert stat(output, "redislock/workers/redis_errors") >= 1
        assert finish_reason(output) == "finished"
        # nothing lost (at least once: a pop whose reply was cut may run twice)
        assert set(site.hits) == pages
