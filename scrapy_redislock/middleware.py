"""StageLockMiddleware: cap the requests in flight per stage across every process of a crawl.

A request's stage comes from ``meta["redislock_stage"]``, the ``@stage(...)`` decorator on its callback,
REDISLOCK_CALLBACK_STAGES, or REDISLOCK_DEFAULT_STAGE; ``meta["dont_redislock"]`` opts it out, and robots.txt is
never throttled (see :func:`scrapy_redislock.stages.stage_of`). A capped request holds a slot of its stage from
here until its download ends, and the slot is released on every outcome: response, exception (download timeout
included), IgnoreRequest or a response from a later middleware, a request dropped on the way (found by a sweep at
every renewal tick), the spider closing. Permits are kept by request object, never in ``meta``, so retries and
redirects (which copy meta) never carry one.

With :class:`~scrapy_redislock.StageScheduler` the slot was granted before the request left the scheduler and is
picked up here. Without it, and for requests that bypass the scheduler (``engine.download_async``: media
pipelines), the request waits here, in Redis's FIFO: caps hold, but a waiting request occupies one of
CONCURRENT_REQUESTS (so a saturated stage slows the others) and gives up with IgnoreRequest when the spider closes.

Settings read (via :func:`scrapy_redislock.config.read_settings`): REDISLOCK_ENABLED, REDISLOCK_URL (and the
scrapy-redis fallbacks), REDISLOCK_PARAMS, REDISLOCK_STAGES, REDISLOCK_TTL, REDISLOCK_KEY_PREFIX,
REDISLOCK_DEFAULT_STAGE, REDISLOCK_CALLBACK_STAGES, REDISLOCK_WAIT_TIMEOUT.
Stats: redislock/<stage>/{acquired,wait_time_total,wait_time_max,lost,timeouts}, redislock/unknown_stage,
redislock/redis_errors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from scrapy import Request, Spider, signals
from scrapy.exceptions import IgnoreRequest, NotConfigured
from scrapy.utils.asyncio import is_asyncio_available

from scrapy_redislock.config import read_settings
from scrapy_redislock.core import Permit
from scrapy_redislock.errors import ConfigError, UnknownStage
from scrapy_redislock.stagelocks import StageLocks, downloader_active, engine_closing, engine_scheduler
from scrapy_redislock.stages import stage_of

if TYPE_CHECKING:
    from typing import Self

    from scrapy.crawler import Crawler
    from scrapy.http import Response

logger = logging.getLogger(__name__)

# How often requests waiting here check whether the engine is closing (its close waits for them).
CLOSE_CHECK_INTERVAL = 0.1


def check_reactor(crawler: Crawler, component: str) -> None:
    """ConfigError unless asyncio can be used: every Redis call runs on the reactor thread with redis.asyncio.

    A ConfigError, not NotConfigured: Scrapy would drop a middleware raising NotConfigured and crawl unthrottled.
    """
    try:
        available = is_asyncio_available()
    except RuntimeError:  # no reactor and no running loop: nothing can run yet, let Scrapy report that
        return
    if not available:
        raise ConfigError(
            f"{component} needs asyncio: TWISTED_REACTOR is {crawler.settings.get('TWISTED_REACTOR')!r}; use "
            "'twisted.internet.asyncioreactor.AsyncioSelectorReactor' (Scrapy's default) or "
            "TWISTED_REACTOR_ENABLED = False. Redis is only called with redis.asyncio, so that the reactor never blocks"
        )


class StageLockMiddleware:
    """Downloader middleware holding one slot of the request's stage while the request is downloaded."""

    def __init__(self, crawler: Crawler) -> None:
        self.crawler = crawler
        self.settings = read_settings(crawler.settings)
        if not self.settings.enabled:
            raise NotConfigured("REDISLOCK_ENABLED is False")
        if not self.settings.stages:
            raise NotConfigured("REDISLOCK_STAGES is empty: no stage to cap")
        check_reactor(crawler, "StageLockMiddleware")
        self.locks = StageLocks.of(crawler, self.settings)
        self.permits: dict[Request, Permit] = {}  # by request object: never in meta, which copies carry
        self.waiting: Counter[str] = Counter()  # requests waiting here, per stage
        self._waits: set[asyncio.Task[Permit]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self._closing = False
        self._suspects: set[Request] = set()
        self.locks.add_waiting_source(self.waiting.__getitem__)
        self.locks.add_tick_hook(self.sweep)
        crawler.signals.connect(self.spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(self.spider_closed, signal=signals.spider_closed)
        crawler.signals.connect(self.request_left, signal=signals.request_left_downloader)

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        return cls(crawler)

    async def spider_opened(self, spider: Spider) -> None:
        await self.locks.start_once()

    # -- the request's way through ---------------------------------------------------------------------------------

    def process_request(self, request: Request, spider: Spider | None = None) -> Coroutine[Any, Any, None] | None:
        """None at once when there is nothing to wait for; a coroutine only when the request must wait here.

        A plain method keeps uncapped requests, and requests whose slot came with them from the scheduler, free of
        any coroutine round trip.
        """
        handed = self._from_scheduler(request)
        if isinstance(handed, Permit):
            self.permits[request] = handed
            return None
        if handed is not None:
            raise handed  # the scheduler's verdict, e.g. AcquireTimeout after REDISLOCK_WAIT_TIMEOUT
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
        return self._wait_here(request, stage)

    def _from_scheduler(self, request: Request) -> Permit | BaseException | None:
        take = getattr(engine_scheduler(self.crawler), "take_permit", None)
        return take(request) if take is not None else None

    async def _wait_here(self, request: Request, stage: str) -> None:
        """Wait in Redis's FIFO (no StageScheduler, or a request that bypassed it); give up when the spider closes."""
        started = time.monotonic()
        wait = asyncio.ensure_future(self.locks.acquire(stage, self.settings.wait_timeout))
        self._waits.add(wait)
        self.waiting[stage] += 1
        self._watch_close()
        try:
            permit = await wait
        except asyncio.CancelledError:
            if self._closing and wait.cancelled():
                raise IgnoreRequest(f"spider closing while waiting for a slot of stage {stage!r}") from None
            raise
        finally:
            self._waits.discard(wait)
            self.waiting[stage] -= 1
        self.permits[request] = permit
        self.locks.record_grant(stage, time.monotonic() - started)

    def _watch_close(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._close_watch())

    async def _close_watch(self) -> None:
        """One task for all waits here: when the engine closes, they end at once instead of holding up its close."""
        while self._waits:
            if engine_closing(self.crawler) or self.locks.closed:
                self._closing = True
                for wait in list(self._waits):
                    wait.cancel()
                return
            await asyncio.sleep(CLOSE_CHECK_INTERVAL)

    def process_response(self, request: Request, response: Response, spider: Spider | None = None) -> Response:
        self._release(request)
        return response

    def process_exception(self, request: Request, exception: Exception, spider: Spider | None = None) -> None:
        self._release(request)

    def request_left(self, request: Request, spider: Spider) -> None:
        """The download is over (request_left_downloader fires before process_response): free the slot now."""
        self._release(request)

    def _release(self, request: Request) -> None:
        permit = self.permits.pop(request, None)
        if permit is None:
            # A slot the scheduler handed out with a request that never reached process_request (an earlier
            # middleware answered it from a cache, or raised IgnoreRequest).
            handed = self._from_scheduler(request)
            permit = handed if isinstance(handed, Permit) else None
        if permit is not None:
            self.locks.release_soon(permit)

    async def sweep(self) -> None:
        """At every renewal tick: free slots of requests that left the downloader without passing back here.

        A request must be missing from ``downloader.active`` at two ticks in a row (the engine adds a request
        to it in the same call that takes it from the scheduler, so one tick would do; two costs nothing).
        """
        active = downloader_active(self.crawler)
        if active is None:
            return
        gone = {request for request in self.permits if request not in active}
        for request in gone & self._suspects:
            permit = self.permits.pop(request, None)
            if permit is not None:
                logger.debug("Freeing the slot of %s, which left the downloader unseen", request)
                await self.locks.release(permit)
        self._suspects = gone

    async def spider_closed(self, spider: Spider, reason: str) -> None:
        """Free every permit and waiter of this process (one call per stage) before spider_closed completes."""
        self._closing = True
        await self.locks.close()
        self.permits.clear()
