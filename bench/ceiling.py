"""Scrapy's own ceiling for a stage held at N requests in flight: the same crawl with no Redis at
all.

bench/middleware.py enables it with ``DOWNLOADER_MIDDLEWARES = {"bench.ceiling.LocalCap": 950}`` and
``CEILING_STAGE = "detail"``. Each process keeps at most ``CEILING_PER_PROCESS`` (1) requests of
that stage (the first path segment of the test sites' URLs) in flight with an in-process semaphore,
taken in ``process_request`` and given back when the request leaves the downloader, the points where
StageLockMiddleware acquires and releases. 3 processes then keep at most 3 in flight with no
hand-off between processes and no round trip: what Scrapy alone achieves on this machine is the most
a lock could give.

Scrapy's own per-slot concurrency (``DOWNLOAD_SLOTS``) cannot serve here: in Scrapy 2.19 on the
asyncio reactor, ``Downloader._process_queue`` starts every queued request of a slot at once when
one finishes (the transfer is counted in a task that has not run yet), so a slot of concurrency 1
had 8 requests at the site.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

from scrapy import Request, signals


class LocalCap:
    """At most CEILING_PER_PROCESS requests of CEILING_STAGE in flight in this process; no Redis."""

    def __init__(self, stage: str, per_process: int) -> None:
        self.stage = stage
        self.slots = asyncio.Semaphore(per_process)
        self.holding: set[Request] = set()

    @classmethod
    def from_crawler(cls, crawler: Any) -> LocalCap:
        cap = cls(
            crawler.settings.get("CEILING_STAGE", "detail"),
            crawler.settings.getint("CEILING_PER_PROCESS", 1),
        )
        crawler.signals.connect(cap.request_left_downloader, signal=signals.request_left_downloader)
        return cap

    async def process_request(self, request: Request) -> None:
        if urlsplit(request.url).path.split("/")[1:2] == [self.stage]:
            await self.slots.acquire()
            self.holding.add(request)

    def request_left_downloader(self, request: Request, spider: Any) -> None:
        if request in self.holding:
            self.holding.discard(request)
            self.slots.release()
