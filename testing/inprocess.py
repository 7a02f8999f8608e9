"""The request front built in-process, for unit tests: a crawler from ``scrapy.utils.test.get_crawler`` with its
spider and a real (not started) engine, so the middleware sits in the engine's real downloader chain, against a
real Redis. No reactor: the test runs the coroutine with ``asyncio.run``.

    async with front(redis_url, {"detail": 1}) as f:
        f.scheduler.enqueue_request(request); request = await f.next_request(); await f.send(request)
        f.middleware.process_request(request); f.middleware.process_response(request, response)

``f.active`` is the engine's ``downloader.active`` (what the left-the-downloader sweep looks at).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import redis
from scrapy import Request, Spider
from scrapy.crawler import Crawler
from scrapy.utils.defer import maybe_deferred_to_future
from scrapy.utils.test import get_crawler

from scrapy_redislock.crawl.stagelocks import StageLocks
from scrapy_redislock.lock.permit import LockKeys
from scrapy_redislock.requests.middleware import StageLockMiddleware
from scrapy_redislock.requests.requestslots import RequestSlots
from scrapy_redislock.requests.scheduler import StageScheduler
from testing.lockstate import pending_grants


class UnitSpider(Spider):
    name = "unit"


@dataclass
class Front:
    crawler: Crawler
    middleware: StageLockMiddleware
    scheduler: StageScheduler | None
    locks: StageLocks
    slots: RequestSlots

    @property
    def active(self) -> Any:
        return self.crawler.engine.downloader.active  # type: ignore[union-attr]

    async def next_request(self, timeout: float = 10.0) -> Request:
        """The scheduler's next request, asking as the engine does when woken (every loop iteration
        here)."""
        assert self.scheduler is not None
        deadline = time.monotonic() + timeout
        while True:
            request = self.scheduler.next_request()
            if request is not None:
                return request
            if time.monotonic() > deadline:
                raise TimeoutError(f"no request from the scheduler within {timeout} s")
            await asyncio.sleep(0.001)

    def send(self, request: Request) -> asyncio.Future[None]:
        """What the engine does with a request from the scheduler: into ``downloader.active``, then
        through the middleware; a request let go without a slot waits for one there (await the
        future)."""
        self.active.add(request)
        return asyncio.ensure_future(self._through(request))

    async def _through(self, request: Request) -> None:
        waiting = self.middleware.process_request(request)
        if waiting is not None:
            await waiting


def held(client: redis.Redis, stage: str) -> list[str]:
    """The grant ids held in Redis for ``stage`` (any owner)."""
    return pending_grants(client, LockKeys.of("redislock", stage))


def request(stage: str | None, n: int = 0) -> Request:
    meta = {"redislock_stage": stage} if stage else {}
    return Request(f"http://127.0.0.1:9/{stage or 'free'}/{n}", meta=meta, dont_filter=True)


@contextlib.asynccontextmanager
async def front(
    redis_url: str, stages: dict[str, int | None], *, scheduler: bool = True, **settings: Any
) -> AsyncIterator[Front]:
    """The middleware (from the engine's chain) and, with ``scheduler``, an open StageScheduler;
    closed after."""
    crawler = get_crawler(
        UnitSpider,
        {
            "REDISLOCK_URL": redis_url,
            "REDISLOCK_STAGES": stages,
            "REDISLOCK_TTL": 3,
            "DOWNLOADER_MIDDLEWARES": {"scrapy_redislock.StageLockMiddleware": 950},
            "LOG_LEVEL": "INFO",
            "SCHEDULER_MEMORY_QUEUE": "scrapy.squeues.FifoMemoryQueue",  # requests come out in the order put in
            **settings,
        },
    )
    crawler.spider = crawler._create_spider()
    crawler.engine = crawler._create_engine()
    chain = crawler.engine.downloader.middleware.middlewares
    middleware = next(mw for mw in chain if isinstance(mw, StageLockMiddleware))
    sched = StageScheduler.from_crawler(crawler) if scheduler else None
    assert middleware.locks is not None and middleware.slots is not None
    try:  # closed also when the start fails: the clients, their connections
        if sched is not None:
            await maybe_deferred_to_future(sched.open(crawler.spider))
        else:
            assert await middleware.slots.start()
        yield Front(crawler, middleware, sched, middleware.locks, middleware.slots)
    finally:
        if sched is not None:
            await maybe_deferred_to_future(sched.close("finished"))
        await middleware.spider_closed(crawler.spider, "finished")
        await crawler.engine.downloader.handlers._close()
