"""One crawler's stage locks: an AsyncCountingLock per capped stage, one renewal loop, release on close.

Shared by :class:`~scrapy_redislock.StageLockMiddleware`, :class:`~scrapy_redislock.StageScheduler` and the
worker mixin; get it with ``StageLocks.of(crawler, settings_attr)``. API:

- ``await locks.start()``: PING Redis, write the configured limits (newest process wins, a change is logged),
  start the renewal loop (every ttl/3: ``maintain()`` of every stage at once; lost leases are logged and counted
  in stats as ``<stats_prefix>/<stage>/lost``).
- ``await locks.acquire(stage, timeout)``: a permit, waiting first come first served across processes; Redis
  outages are retried with back-off (the wait goes on, the cap is never exceeded).
- ``await locks.release(permit)``: give one back (errors are logged, the lease then expires by itself).
- ``await locks.close()``: stop the loop and free every permit and waiter of this process, one call per stage.

Reads no settings itself: it is given a checked :class:`~scrapy_redislock.config.RedisLockSettings`.
It must run on the asyncio reactor (it uses ``redis.asyncio``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import redis.exceptions
from scrapy.exceptions import CloseSpider

from scrapy_redislock.aio import AsyncCountingLock
from scrapy_redislock.core import Permit
from scrapy_redislock.errors import AcquireTimeout, LockConnectionError, UnknownStage

if TYPE_CHECKING:
    import redis.asyncio
    from scrapy.crawler import Crawler

    from scrapy_redislock.config import RedisLockSettings

logger = logging.getLogger(__name__)

RETRY_FIRST = 0.1
RETRY_MAX = 5.0


class StageLocks:
    """The capped stages of one crawler process and their single renewal loop."""

    def __init__(
        self,
        crawler: Crawler,
        settings: RedisLockSettings,
        limits: Mapping[str, int | None],
        *,
        lock_prefix: str = "",
        stats_prefix: str = "redislock",
    ) -> None:
        self.crawler = crawler
        self.settings = settings
        self.limits = dict(limits)
        self.stats_prefix = stats_prefix
        self.client: redis.asyncio.Redis = settings.async_client()
        spider = getattr(crawler.spidercls, "name", None)
        self.locks: dict[str, AsyncCountingLock] = {
            stage: AsyncCountingLock(
                self.client,
                f"{lock_prefix}{stage}",
                limit=limit,
                ttl=settings.ttl,
                key_prefix=settings.key_prefix,
                identity={"spider": spider, "waiting": 0},
            )
            for stage, limit in self.limits.items()
            if limit is not None
        }
        self.waiting: dict[str, int] = dict.fromkeys(self.locks, 0)
        self._renewer: asyncio.Task[None] | None = None
        self._starting: asyncio.Future[None] | None = None
        self.started = False
        self.closed = False
        self.sweepers: list[Any] = []  # callables run at each tick (the middleware's leak sweep)

    @property
    def stats(self) -> Any:
        return self.crawler.stats

    def is_capped(self, stage: str) -> bool:
        """True for a capped stage, False for an unlimited one; UnknownStage for a stage not configured."""
        if stage in self.locks:
            return True
        if stage in self.limits:
            return False
        raise UnknownStage(f"stage {stage!r} is not configured; known stages: {sorted(self.limits)}")

    async def start_once(self) -> None:
        """start(), once, however many components ask for it; CloseSpider when Redis is unreachable."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self.start())
        try:
            await asyncio.shield(self._starting)
        except (redis.exceptions.RedisError, OSError) as exc:
            logger.error(
                "Cannot reach Redis at %s (REDISLOCK_URL): %s; closing the spider rather than crawl unthrottled",
                self.settings.safe_url,
                exc,
            )
            raise CloseSpider("redislock_redis_unavailable") from exc

    async def start(self) -> None:
        """Check Redis and publish this process's limits; raises redis errors when Redis is unreachable."""
        await self.client.ping()
        for stage, lock in self.locks.items():
            limit = self.limits[stage]
            previous = await lock.set_limit(limit)  # type: ignore[arg-type]
            if previous is not None and previous != limit:
                logger.warning(
                    "Limit of stage %r changed from %s to %s (this process's settings win)", stage, previous, limit
                )
        if self.locks:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_forever())
        self.started = True

    async def acquire(self, stage: str, timeout: float | None) -> Permit:
        """Wait for a slot of ``stage``; AcquireTimeout after ``timeout`` seconds (None: forever)."""
        lock = self.locks[stage]
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        delay = RETRY_FIRST
        self.waiting[stage] += 1
        try:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    permit = await lock.acquire(timeout=left)
                    break
                except AcquireTimeout:
                    self.stats.inc_value(f"{self.stats_prefix}/{stage}/timeouts")
                    raise
                except (LockConnectionError, redis.exceptions.RedisError) as exc:
                    if deadline is not None and time.monotonic() + delay > deadline:
                        self.stats.inc_value(f"{self.stats_prefix}/{stage}/timeouts")
                        raise AcquireTimeout(f"stage {stage!r}: no slot within {timeout} s ({exc})") from exc
                    logger.warning("Waiting for stage %r: Redis error (%s); retrying in %.1f s", stage, exc, delay)
                    self.stats.inc_value(f"{self.stats_prefix}/redis_errors")
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX)
        finally:
            self.waiting[stage] -= 1
        waited = time.monotonic() - started
        self.stats.inc_value(f"{self.stats_prefix}/{stage}/acquired")
        self.stats.inc_value(f"{self.stats_prefix}/{stage}/wait_time_total", waited)
        self.stats.max_value(f"{self.stats_prefix}/{stage}/wait_time_max", waited)
        return permit

    async def release(self, permit: Permit) -> None:
        lock = self.locks.get(self._stage_of(permit))
        if lock is None:
            return
        try:
            await lock.release(permit)
        except (LockConnectionError, redis.exceptions.RedisError) as exc:
            logger.warning("Could not release a slot of %r (%s); its lease will expire", permit.name, exc)

    def _stage_of(self, permit: Permit) -> str:
        for stage, lock in self.locks.items():
            if lock.name == permit.name:
                return stage
        return permit.name

    async def renew_once(self) -> None:
        """One renewal tick for every stage at once."""

        async def tick(stage: str, lock: AsyncCountingLock) -> None:
            lock.annotate(waiting=self.waiting[stage])
            lost = await lock.maintain()
            if lost:
                self.stats.inc_value(f"{self.stats_prefix}/{stage}/lost", len(lost))

        results = await asyncio.gather(*(tick(s, lock) for s, lock in self.locks.items()), return_exceptions=True)
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise errors[0]

    async def _renew_forever(self) -> None:
        delay = RETRY_FIRST
        while not self.closed:
            await asyncio.sleep(min(lock.renew_interval for lock in self.locks.values()))
            for sweep in self.sweepers:
                await sweep()
            try:
                await self.renew_once()
                delay = RETRY_FIRST
            except Exception as exc:  # never die silently: log, back off, go on
                logger.warning("Renewing stage slots failed (%s); retrying in %.1f s", exc, delay)
                self.stats.inc_value(f"{self.stats_prefix}/redis_errors")
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)

    async def close(self) -> None:
        """Free every permit and waiter of this process (one call per stage) and close the connections."""
        if self.closed:
            return
        self.closed = True
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        for stage, lock in self.locks.items():
            try:
                await lock.aclose()
            except (LockConnectionError, redis.exceptions.RedisError) as exc:
                logger.warning(
                    "Could not free the slots of stage %r on close (%s); they expire after the TTL", stage, exc
                )
        await self.client.aclose()

    @classmethod
    def of(
        cls,
        crawler: Crawler,
        settings: RedisLockSettings,
        *,
        attr: str = "_redislock_stage_locks",
    ) -> StageLocks:
        """The crawler's shared instance for the request stages (created on first use)."""
        existing = getattr(crawler, attr, None)
        if existing is None:
            existing = cls(crawler, settings, settings.stages)
            setattr(crawler, attr, existing)
        return existing
