"""StageLockMiddleware: cap the requests in flight per stage across every process of a crawl.

A request's stage comes from ``meta["redislock_stage"]``, the ``@stage(...)`` decorator on its callback,
REDISLOCK_CALLBACK_STAGES, or REDISLOCK_DEFAULT_STAGE; ``meta["dont_redislock"]`` opts it out. A capped request
holds a slot of its stage from here until its download ends (response, exception, timeout, a later middleware's
IgnoreRequest) and the slot is released then; permits are kept by request object, never in ``meta``, so retries
and redirects (which copy meta) never carry one.

With :class:`~scrapy_redislock.StageScheduler` the slot was already granted when the request left the
scheduler; without it (or for requests that bypass the scheduler, such as robots.txt and media downloads), the
request waits here for a slot: caps still hold, but a full stage then holds up other stages (see README).

Settings read: REDISLOCK_ENABLED, REDISLOCK_STAGES and the rest via :func:`scrapy_redislock.config.read_settings`.
Stats: redislock/<stage>/acquired, wait_time_total, wait_time_max, lost, timeouts; redislock/unknown_stage.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from scrapy import Request, Spider, signals
from scrapy.exceptions import IgnoreRequest, NotConfigured
from scrapy.utils.asyncio import is_asyncio_available

from scrapy_redislock.config import read_settings
from scrapy_redislock.core import Permit
from scrapy_redislock.errors import ConfigError, UnknownStage
from scrapy_redislock.stagelocks import StageLocks
from scrapy_redislock.stages import stage_of

if TYPE_CHECKING:
    from typing import Self

    from scrapy.crawler import Crawler
    from scrapy.http import Response

logger = logging.getLogger(__name__)

# How often requests waiting here check whether the engine is closing (they must not hold up its close).
CLOSE_CHECK_INTERVAL = 0.2


class StageLockMiddleware:
    """Downloader middleware holding one slot of the request's stage while the request is downloaded."""

    def __init__(self, crawler: Crawler) -> None:
        self.crawler = crawler
        self.settings = read_settings(crawler.settings)
        if not self.settings.enabled:
            raise NotConfigured("REDISLOCK_ENABLED is False")
        if not self.settings.stages:
            raise NotConfigured("REDISLOCK_STAGES is empty: no stage to cap")
        if not is_asyncio_available():
            raise ConfigError(
                "StageLockMiddleware needs Scrapy's asyncio reactor (TWISTED_REACTOR = "
                "'twisted.internet.asyncioreactor.AsyncioSelectorReactor', the default): it talks to Redis "
                "with redis.asyncio so that the reactor thread never blocks"
            )
        self.locks = StageLocks.of(crawler, self.settings)
        self.permits: dict[Request, Permit] = {}
        self._releasing: set[asyncio.Future[None]] = set()
        self.locks.sweepers.append(self.sweep)
        crawler.signals.connect(self.spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(self.spider_closed, signal=signals.spider_closed)
        crawler.signals.connect(self.request_left, signal=signals.request_left_downloader)

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        return cls(crawler)

    async def spider_opened(self, spider: Spider) -> None:
        await self.locks.start_once()

    def process_request(self, request: Request, spider: Spider | None = None) -> Coroutine[Any, Any, None] | None:
        """None at once when there is nothing to wait for; a coroutine only when the request must wait here.

        A plain method keeps uncapped requests and requests the scheduler already got a slot for free of any
        coroutine round trip (Scrapy awaits whatever the method returns).
        """
        stage = stage_of(request, self.settings, self.crawler.spider)
        if stage is None:
            return None
        try:
            capped = self.locks.is_capped(stage)
        except UnknownStage:
            self.crawler.stats.inc_value("redislock/unknown_stage")
            raise
        if not capped:
            return None
        handed = self._from_scheduler(request)
        if isinstance(handed, BaseException):
            raise handed
        if handed is not None:
            self.permits[request] = handed
            return None
        return self._wait_and_hold(request, stage)

    async def _wait_and_hold(self, request: Request, stage: str) -> None:
        self.permits[request] = await self._wait_here(stage)

    def _from_scheduler(self, request: Request) -> Permit | BaseException | None:
        scheduler = getattr(getattr(self.crawler, "engine", None), "_slot", None)
        take = getattr(getattr(scheduler, "scheduler", None), "take", None)
        return take(request) if take is not None else None

    async def _wait_here(self, stage: str) -> Permit:
        """Wait in the middleware (no StageScheduler, or a request that bypassed it); never hold up close."""
        wait = asyncio.ensure_future(self.locks.acquire(stage, self.settings.wait_timeout))
        while not wait.done():
            await asyncio.wait({wait}, timeout=CLOSE_CHECK_INTERVAL)
            if not wait.done() and self._engine_closing():
                wait.cancel()
                raise IgnoreRequest(f"spider closing while waiting for a slot of stage {stage!r}")
        return wait.result()

    def _engine_closing(self) -> bool:
        engine = getattr(self.crawler, "engine", None)
        slot = getattr(engine, "_slot", None)
        return engine is None or not engine.running or getattr(slot, "closing", None) is not None or self.locks.closed

    def process_response(self, request: Request, response: Response, spider: Spider | None = None) -> Response:
        self._release_soon(request)
        return response

    def process_exception(self, request: Request, exception: Exception, spider: Spider | None = None) -> None:
        self._release_soon(request)

    def request_left(self, request: Request, spider: Spider) -> None:
        self._release_soon(request)

    def _release_soon(self, request: Request) -> None:
        """Give the slot back in a task (kept, so it is not garbage-collected); the response goes on at once."""
        permit = self.permits.pop(request, None)
        if permit is not None:
            task = asyncio.ensure_future(self.locks.release(permit))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def spider_closed(self, spider: Spider, reason: str) -> None:
        if self._releasing:
            await asyncio.wait(set(self._releasing), timeout=5)
        await self.locks.close()
        self.permits.clear()

    async def sweep(self) -> None:
        """Release permits of requests that left the downloader without passing back through us."""
        engine = getattr(self.crawler, "engine", None)
        active = getattr(getattr(engine, "downloader", None), "active", None)
        if active is None:
            return
        for request in [r for r in self.permits if r not in active]:
            await self.locks.release(self.permits.pop(request))
