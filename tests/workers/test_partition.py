"""Worker front, one worker cut off from Redis (its REDIS_URL goes through a testing/netproxy.py
LatencyProxy that blackholes it; Redis, the site and the other workers carry on): no capped request
of it is in flight at the site once its stage slot's lease may have run out, so the site never sees
more workers of the stage at once than its cap. Real workers (``scrapy runspider``), counted at the
site."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable

import pytest
import redis

from testing.crawlproc import staged_worker
from testing.netproxy import LatencyProxy
from testing.site import CrawlSite
from testing.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crawl]


class Worker:
    """A worker process whose output is read as it comes (a full pipe would stop it)."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def stop(self) -> str:
        self.process.kill()
        self.process.wait(30)
        self.reader.join(10)
        assert self.process.stdout is not None
        self.process.stdout.close()
        return "".join(self.lines)


def in_flight_of(site: CrawlSite, who: str) -> int:
    with site.lock:
        return site.workers_in_flight["detail"].get(who, 0)


# Scrapy's downloader queues a worker's requests per site: with one at a time and a delay between
# them, a request handed out under the slot's lease waits there, and starts after the lease ran out
QUEUED_IN_DOWNLOADER = {"CONCURRENT_REQUESTS_PER_DOMAIN": 1, "DOWNLOAD_DELAY": 2}


@pytest.mark.parametrize("queued", [False, True], ids=["downloading", "queued-in-downloader"])
def test_a_cut_off_worker_s_downloads_end_before_its_slot_goes_to_another(
    redis_url: str,
    redis_client: redis.Redis,  # flushed: no queue a killed worker of another test left
    redis_proxy: Callable[[], LatencyProxy],
    queued: bool,
) -> None:
    """TTL 3 s, 6 s pages, detail capped at 3 workers, 4 workers: before the fix the cut-off
    worker's downloads ran on after the fourth had taken its slot (4 workers in flight). And with
    its requests queued in Scrapy's downloader (one at a time per site, 2 s apart): one that
    started there after the lease ran out, its download timeout set when it was handed out, ran
    while the fourth held the slot; now it is bounded again as it starts, and not sent."""
    proxy = redis_proxy()
    with CrawlSite(delay=6) as site:
        site.watch_disconnects = True  # an aborted download leaves the site's count at once
        settings = {
            "REDISLOCK_WORKER_STAGES": {"detail": 3},
            "REDISLOCK_TTL": 3,
            "RETRY_ENABLED": False,
            "DOWNLOAD_TIMEOUT": 20,
            "LOG_LEVEL": "WARNING",
            **(QUEUED_IN_DOWNLOADER if queued else {}),
        }
        plan = "detail:400"
        cut = Worker(staged_worker(proxy.url, site.url, plan, {**settings, "USER_AGENT": "w1"}))
        workers = [cut]
        try:
            wait_until(lambda: in_flight_of(site, "w1") >= 1, 60, "the first worker downloads")
            workers += [
                Worker(staged_worker(redis_url, site.url, plan, {**settings, "USER_AGENT": name}))
                for name in ("w2", "w3", "w4")
            ]
            wait_until(
                lambda: len(site.workers_in_flight["detail"]) == 3, 60, "three workers download"
            )
            wait_until(lambda: in_flight_of(site, "w1") >= 1, 30, "the first one downloads")
            proxy.blackhole()  # cut off while downloading: its slot's lease runs out unrenewed
            wait_until(lambda: in_flight_of(site, "w1") == 0, 30, "its downloads over")
            # the worker that had no slot takes it once the lease ran out in Redis
            takers = {"w2", "w3", "w4"}
            wait_until(
                lambda: len(takers & set(site.workers_in_flight["detail"])) == 3,
                30,
                "the other three download",
            )
            if queued:
                wait_until(
                    lambda: any("did not start" in line for line in cut.lines),
                    30,
                    "its request queued in the downloader not sent",
                )
            assert site.max_workers["detail"] <= 3, site.samples[-30:]
        finally:
            proxy.heal()
            outputs = [worker.stop() for worker in workers]
        assert site.max_workers["detail"] <= 3
        assert site.abandoned["detail"] >= 1  # downloads were cut at their slot's lease
        print(
            f"most workers with detail in flight at once: {site.max_workers['detail']} (cap 3); "
            f"{site.abandoned['detail']} downloads cut at their slot's lease"
        )
        # cut by the download timeout the lease set (a page is longer than a lease)
        assert "took longer than" in outputs[0]
