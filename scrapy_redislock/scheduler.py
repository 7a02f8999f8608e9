"""StageScheduler: requests of a saturated stage wait here, cheaply, instead of in the downloader.

Scrapy counts a request as active in the downloader before the middleware chain runs, and stops pulling from
the scheduler once ``CONCURRENT_REQUESTS`` are active; requests parked in a middleware for a full stage would
starve every other stage (head-of-line blocking) and hold up the engine's close. This scheduler wraps the real
one (Scrapy's by default, or scrapy-redis's) and hands out a capped request only together with a slot: the
requests of a full stage are parked here, one waiter task per stage blocks in Redis (first come, first served
across processes) and wakes the engine as soon as a slot is granted, so other stages keep flowing.

Settings read: REDISLOCK_SCHEDULER_INNER (the wrapped scheduler class, default Scrapy's), REDISLOCK_PARK_LIMIT
(how many capped requests may be parked in memory, taken out of the inner queue), REDISLOCK_WAITERS_PER_STAGE,
plus the REDISLOCK_* settings read by :func:`scrapy_redislock.config.read_settings`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from scrapy.utils.defer import deferred_from_coro
from scrapy.utils.misc import build_from_crawler, load_object

from scrapy_redislock.config import read_settings
from scrapy_redislock.errors import AcquireTimeout, ConfigError, UnknownStage
from scrapy_redislock.stagelocks import StageLocks
from scrapy_redislock.stages import stage_of

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from twisted.internet.defer import Deferred

    from scrapy_redislock.core import Permit

logger = logging.getLogger(__name__)

MIDDLEWARE_PATH = "scrapy_redislock.StageLockMiddleware"


def wake_engine(crawler: Crawler) -> None:
    """Ask the engine to pull from the scheduler now rather than at its next heartbeat (up to 5 s later).

    Scrapy has no public call for this; the engine slot's ``nextcall`` is what the engine itself schedules
    after every finished download. If a future Scrapy renames it, we fall back to the heartbeat.
    """
    slot = getattr(getattr(crawler, "engine", None), "_slot", None)
    nextcall = getattr(slot, "nextcall", None)
    if nextcall is not None:
        nextcall.schedule()


def _middleware_enabled(crawler: Crawler) -> bool:
    from scrapy_redislock.middleware import StageLockMiddleware

    configured = crawler.settings.getwithbase("DOWNLOADER_MIDDLEWARES")
    for path, order in configured.items():
        if order is None:
            continue
        try:
            if load_object(path) is StageLockMiddleware:
                return True
        except (ImportError, ValueError, NameError, AttributeError):
            continue
    return False


class StageScheduler:
    """A scheduler that releases capped requests only together with a slot of their stage."""

    def __init__(self, crawler: Crawler) -> None:
        self.crawler = crawler
        self.settings = read_settings(crawler.settings)
        if not _middleware_enabled(crawler):
            raise ConfigError(
                f"SCHEDULER = 'scrapy_redislock.StageScheduler' needs the middleware too: "
                f"DOWNLOADER_MIDDLEWARES = {{{MIDDLEWARE_PATH!r}: 950}}"
            )
        inner_path = crawler.settings.get("REDISLOCK_SCHEDULER_INNER") or "scrapy.core.scheduler.Scheduler"
        try:
            inner_cls = load_object(inner_path)
        except (ImportError, ValueError, NameError, AttributeError) as exc:
            raise ConfigError(f"REDISLOCK_SCHEDULER_INNER cannot be loaded: {inner_path!r} ({exc})") from None
        self.inner = build_from_crawler(inner_cls, crawler)
        self.park_limit = crawler.settings.getint("REDISLOCK_PARK_LIMIT", 10000)
        self.waiters_per_stage = crawler.settings.getint("REDISLOCK_WAITERS_PER_STAGE", 2)
        if self.park_limit < 1:
            raise ConfigError(f"REDISLOCK_PARK_LIMIT must be >= 1, got {self.park_limit!r}")
        if self.waiters_per_stage < 1:
            raise ConfigError(f"REDISLOCK_WAITERS_PER_STAGE must be >= 1, got {self.waiters_per_stage!r}")
        self.locks = StageLocks.of(crawler, self.settings)
        self.parked: dict[str, deque[tuple[float, Request]]] = {s: deque() for s in self.locks.locks}
        self.ready: dict[str, deque[Permit]] = {s: deque() for s in self.locks.locks}
        self.waiters: dict[str, set[asyncio.Task[None]]] = {s: set() for s in self.locks.locks}
        self.handed: dict[Request, Permit | BaseException] = {}
        self.closing = False

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> StageScheduler:
        return cls(crawler)

    # -- the scheduler interface -------------------------------------------------------------

    def open(self, spider: Spider) -> Deferred[None] | None:
        result = self.inner.open(spider) if hasattr(self.inner, "open") else None
        return deferred_from_coro(self._open(result))

    async def _open(self, inner_result: Any) -> None:
        if inner_result is not None:
            from scrapy.utils.defer import maybe_deferred_to_future

            await maybe_deferred_to_future(inner_result)
        await self.locks.start_once()

    def close(self, reason: str) -> Deferred[None] | None:
        self.closing = True
        return deferred_from_coro(self._close(reason))

    async def _close(self, reason: str) -> None:
        for tasks in self.waiters.values():
            for task in tasks:
                task.cancel()
        for stage, permits in self.ready.items():
            while permits:
                await self.locks.release(permits.popleft())
            # Give parked requests back to the inner queue, so a persistent queue keeps them.
            while self.parked[stage]:
                _, request = self.parked[stage].popleft()
                request.dont_filter = True
                self.inner.enqueue_request(request)
        if hasattr(self.inner, "close"):
            from scrapy.utils.defer import maybe_deferred_to_future

            result = self.inner.close(reason)
            if result is not None:
                await maybe_deferred_to_future(result)

    def has_pending_requests(self) -> bool:
        return self.inner.has_pending_requests() or any(self.parked.values())

    def __len__(self) -> int:
        return len(self.inner) + sum(len(q) for q in self.parked.values())

    def enqueue_request(self, request: Request) -> bool:
        return bool(self.inner.enqueue_request(request))

    def next_request(self) -> Request | None:
        for stage, parked in self.parked.items():
            if parked:
                self._ensure_waiters(stage)
        request = self._next_ready()
        if request is not None:
            return request
        while sum(len(q) for q in self.parked.values()) < self.park_limit:
            request = self.inner.next_request()
            if request is None:
                return None
            stage = stage_of(request, self.settings, self.crawler.spider)
            try:
                capped = stage is not None and self.locks.is_capped(stage)
            except UnknownStage:
                return request  # the middleware fails it with a clear error
            if not capped:
                return request
            assert stage is not None
            self.parked[stage].append((time.monotonic(), request))
            self._ensure_waiters(stage)
            request = self._next_ready()
            if request is not None:
                return request
        return None

    # -- slots ------------------------------------------------------------------------------

    def take(self, request: Request) -> Permit | BaseException | None:
        """The permit (or the error) this scheduler handed out with ``request``, for the middleware."""
        return self.handed.pop(request, None)

    def _next_ready(self) -> Request | None:
        timeout = self.settings.wait_timeout
        now = time.monotonic()
        for stage, parked in self.parked.items():
            if parked and self.ready[stage]:
                _, request = parked.popleft()
                self.handed[request] = self.ready[stage].popleft()
                return request
            if parked and timeout is not None and now - parked[0][0] > timeout:
                _, request = parked.popleft()
                self.crawler.stats.inc_value(f"redislock/{stage}/timeouts")
                self.handed[request] = AcquireTimeout(f"stage {stage!r}: no slot within {timeout} s")
                return request
        return None

    def _ensure_waiters(self, stage: str) -> None:
        wanted = min(len(self.parked[stage]) - len(self.ready[stage]), self.waiters_per_stage)
        while len(self.waiters[stage]) < wanted and not self.closing and self.locks.started:
            task = asyncio.get_event_loop().create_task(self._wait_for_slot(stage))
            self.waiters[stage].add(task)
            task.add_done_callback(self.waiters[stage].discard)

    async def _wait_for_slot(self, stage: str) -> None:
        try:
            permit = await self.locks.acquire(stage, self.settings.wait_timeout)
            self.waiters[stage].discard(asyncio.current_task())  # type: ignore[arg-type]
        except AcquireTimeout:
            wake_engine(self.crawler)  # the oldest parked request has timed out by now
            return
        if self.closing:
            await self.locks.release(permit)
            return
        self.ready[stage].append(permit)
        wake_engine(self.crawler)
        if len(self.parked[stage]) > len(self.ready[stage]):
            self._ensure_waiters(stage)
        else:
            # More slots than parked requests (they were taken meanwhile): do not sit on a slot.
            await asyncio.sleep(0)
            while len(self.ready[stage]) > len(self.parked[stage]):
                await self.locks.release(self.ready[stage].pop())
