"""Start-up and shut-down of one :class:`~scrapy_redislock.crawl.stagelocks.StageLocks`.

Start: :meth:`Lifecycle.start_once` runs the locks' ``start()`` once, however many components
ask, retried with back-off and a warning each time while Redis is unreachable (down, or failing
over) for up to REDISLOCK_CONNECT_TIMEOUT s; credentials or an ACL refused are not retried. When it
stays unreachable, or refuses us, the failure is logged once, saying which: the spider_opened
signal then closes the spider (a scheduler must not raise CloseSpider from open(): Scrapy would
skip opening its scraper and log a traceback at close), and the crawl exits with status 1.

Shut-down: a started StageLocks joins the process's renewal loop and, under a Twisted reactor, a
"before shutdown" trigger, so that an unclean shutdown (a second Ctrl-C) frees its slots before the
process exits (without a reactor, the renewal loop being cancelled does the same).
:meth:`Lifecycle.close` cancels the waits in progress, then frees every permit and waiter of this
process, one ``aclose()`` per lock, and then any grant Redis handed a cancelled wait late; no step
waits on Redis for longer than CLOSE_TIMEOUT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import redis.exceptions
from scrapy import signals
from scrapy.exceptions import CloseSpider
from scrapy.utils.defer import deferred_from_coro
from scrapy.utils.reactor import is_reactor_installed

from scrapy_redislock._redis import AsyncRedisClient, Backoff
from scrapy_redislock.crawl.engine import StartLogCount, count_start_logs
from scrapy_redislock.crawl.reach import OUTAGE_ERRORS, REDIS_ERRORS, REFUSED
from scrapy_redislock.crawl.renewer import Renewer, gather_bounded
from scrapy_redislock.errors import ConfigError
from scrapy_redislock.lock.base import CommandRunner
from scrapy_redislock.lock.core import release_consumer
from scrapy_redislock.lock.interface import AsyncLock
from scrapy_redislock.lock.protocol import adrive

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

    from scrapy_redislock.crawl.deployment import Deployment
    from scrapy_redislock.crawl.requestslots import RequestSlots
    from scrapy_redislock.crawl.settings import RedisLockSettings


class Locks(Protocol):
    """What the lifecycle drives: a StageLocks."""

    crawler: Crawler
    settings: RedisLockSettings
    stats_prefix: str
    closed: bool
    retire_on_close: bool
    fan_out: int | None
    deployment: Deployment
    slots: RequestSlots

    @property
    def locks(self) -> Mapping[str, AsyncLock[Any]]: ...

    @property
    def clients(self) -> Sequence[AsyncRedisClient]: ...

    @property
    def stats(self) -> Any: ...

    @property
    def renew_interval(self) -> float: ...

    async def start(self) -> None: ...

    async def tick(self) -> None: ...

    async def close_unclean(self) -> None: ...

    async def close(self) -> None: ...


logger = logging.getLogger(__name__)

START_BACKOFF = (0.25, 5.0)  # first and longest pause between tries to reach Redis at start
# a close never waits longer than this for Redis (a paused server must not hang the crawl)
CLOSE_TIMEOUT = 5.0
# seconds for Redis to see cancelled waits' connections close before the last sweep
LATE_GRANT_PAUSE = 0.02
# a forced shutdown waits at most this long for Redis to take the slots back
UNCLEAN_CLOSE_TIMEOUT = 3.0


class SystemEvents(Protocol):
    """The system event triggers of Twisted's IReactorCore, which every reactor provides. (Twisted's
    interfaces declare their methods without ``self``, for the mypy-zope plugin: without it mypy
    reads each argument one place off.)"""

    def addSystemEventTrigger(
        self,
        phase: str,
        eventType: str,
        callable: Callable[..., Any],
        *args: object,
        **kwargs: object,
    ) -> Any: ...

    def removeSystemEventTrigger(self, triggerID: Any) -> None: ...


class Lifecycle:
    """Start once, join and leave the renewal loop and the reactor's shutdown trigger, close."""

    def __init__(self, locks: Locks) -> None:
        self.locks = locks
        self.failure: CloseSpider | None = None
        self.started = False
        self._starting: asyncio.Future[None] | None = None
        self._renewer: Renewer | None = None
        self._shutdown_trigger: Any = None
        # acquire() calls in progress, cancelled on close
        self.waits: set[asyncio.Task[Any]] = set()
        # what the start logs before Scrapy counts (it counts from spider_opened)
        self.start_logs: StartLogCount | None = None
        self.opened = False  # the spider_opened signal came
        locks.crawler.signals.connect(self._spider_opened, signal=signals.spider_opened)
        locks.crawler.signals.connect(self._engine_stopped, signal=signals.engine_stopped)

    async def start_once(self) -> bool:
        """start(), once, however many components ask; False when Redis cannot be reached or refuses
        us.

        The failure is logged once, saying which of the two it was. The spider_opened signal then
        closes the spider (a scheduler must not raise CloseSpider from open(): Scrapy would skip
        opening its scraper and log a traceback at close), and the crawl exits with status 1.
        """
        if self._starting is None:
            if not self.opened:
                self.start_logs = count_start_logs(self.locks.crawler)
            self._starting = asyncio.ensure_future(self._start_retrying())
        try:
            await asyncio.shield(self._starting)
        except (*REDIS_ERRORS, ConfigError) as exc:
            self._start_failed(exc)
        return self.failure is None

    async def _start_retrying(self) -> None:
        """start(), tried again with back-off while Redis is unreachable, up to
        REDISLOCK_CONNECT_TIMEOUT seconds.

        A process started during a failover, or just before Redis, waits instead of closing at once;
        credentials or an ACL refused are not retried.
        """
        timeout = self.locks.settings.redis.connect_timeout
        deadline = time.monotonic() + timeout
        backoff = Backoff(*START_BACKOFF)
        while True:
            try:
                await self.locks.start()
                return
            except REDIS_ERRORS as exc:
                left = deadline - time.monotonic()
                if (
                    not isinstance(exc, OUTAGE_ERRORS)
                    or isinstance(exc, REFUSED)
                    or self.locks.closed
                    or left <= 0
                ):
                    raise
                delay = min(backoff.next(), left)
                logger.warning(
                    "Redis at %s (%s) is not reachable yet (%s); trying again in %.1f s, for %.0f s more (REDISLOCK_CONNECT_TIMEOUT = %g)",  # noqa: E501
                    self.locks.settings.redis.safe_url,
                    self.locks.settings.redis.url_setting,
                    exc,
                    delay,
                    left,
                    timeout,
                )
                self.locks.stats.inc_value(f"{self.locks.stats_prefix}/redis_errors")
                await asyncio.sleep(delay)

    def _start_failed(self, exc: BaseException) -> None:
        if self.failure is not None:
            return
        source = self.locks.settings.redis.url_setting
        if isinstance(exc, ConfigError):
            logger.error("%s; closing the spider rather than crawl unthrottled", exc)
            self.failure = CloseSpider("redislock_config_error")
        elif isinstance(exc, redis.exceptions.NoPermissionError):
            logger.error(
                "Redis at %s (%s) refused a command to this user (ACL): %s; the crawl needs the crawler role (python -m scrapy_redislock.cli.acl crawler); closing the spider rather than crawl unthrottled",  # noqa: E501
                self.locks.settings.redis.safe_url,
                source,
                exc,
            )
            self.failure = CloseSpider("redislock_redis_refused")
        elif isinstance(exc, redis.exceptions.AuthenticationError):
            logger.error(
                "Redis at %s (%s) refused the credentials: %s Check the password or ACL user in the URL or in REDISLOCK_PARAMS; closing the spider rather than crawl unthrottled",  # noqa: E501
                self.locks.settings.redis.safe_url,
                source,
                exc,
            )
            self.failure = CloseSpider("redislock_redis_auth_failed")
        else:
            logger.error(
                "Cannot reach Redis at %s (%s): %s; waited %g s (REDISLOCK_CONNECT_TIMEOUT); closing the spider rather than crawl unthrottled",  # noqa: E501
                self.locks.settings.redis.safe_url,
                source,
                exc,
                self.locks.settings.redis.connect_timeout,
            )
            self.failure = CloseSpider("redislock_redis_unavailable")
        # Connected now, so that it runs after every other spider_closed handler: the crawl did not
        # really start, and Scrapy's commands exit with status 1 only for a crawler without a spider
        # ("bootstrap failed").
        self.locks.crawler.signals.connect(self._mark_failed, signal=signals.spider_closed)

    async def _spider_opened(self, spider: Any) -> None:
        self.opened = True
        if self.start_logs is not None:
            self.start_logs.hand_over()
        if not await self.start_once():
            assert self.failure is not None
            raise self.failure

    def _engine_stopped(self) -> None:
        if self.start_logs is not None:  # a crawl that never opened its spider: stop counting
            self.start_logs.hand_over()

    def _mark_failed(self, spider: Any) -> None:
        # the stats of a start that failed span its wait for Redis (CoreStats timed them from
        # spider_opened) and count its warnings and error (see crawl/engine.py: StartLogCount)
        if self.start_logs is not None:
            self.start_logs.timed_from_start()
        self.locks.crawler.spider = None

    def join_renewal(self) -> None:
        """Join the process's renewal loop, and free the slots if the reactor shuts down first."""
        self._renewer = Renewer.current()
        self._renewer.join(self.locks)
        if is_reactor_installed():
            from twisted.internet import reactor

            self._shutdown_trigger = cast(SystemEvents, reactor).addSystemEventTrigger(
                "before", "shutdown", self._reactor_stopping
            )

    def leave_renewal(self) -> None:
        if self._shutdown_trigger is not None:
            from twisted.internet import reactor

            with contextlib.suppress(ValueError, KeyError):
                cast(SystemEvents, reactor).removeSystemEventTrigger(self._shutdown_trigger)
            self._shutdown_trigger = None
        if self._renewer is not None:
            self._renewer.leave(self.locks)

    def _reactor_stopping(self) -> Any:
        self._shutdown_trigger = None
        if self.locks.closed:
            return None
        return deferred_from_coro(self.locks.close_unclean())

    # -- close -------------------------------------------------------------------------------------

    async def close_unclean(self) -> None:
        """The process is going away without closing the spider (a second Ctrl-C): free its slots
        now."""
        if self.locks.closed:
            return
        logger.warning(
            "Forced shutdown: freeing this process's stage slots in Redis before exiting"
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.locks.close(), UNCLEAN_CLOSE_TIMEOUT)

    async def close(self) -> None:
        """Cancel every wait, then free every permit and waiter of this process: one aclose() per
        stage."""
        if self.locks.closed:
            return
        self.locks.closed = True
        # every slot of this process is freed below, one call per lock
        self.locks.slots.ledger.clear()
        self.leave_renewal()
        waits = [task for task in self.waits if task is not asyncio.current_task()]
        for task in waits:
            task.cancel()
        pending = set(waits) | set(self.locks.slots.releasing)
        if pending:
            await asyncio.wait(pending, timeout=CLOSE_TIMEOUT)

        async def free(stage: str, lock: AsyncLock[Any]) -> None:
            closing = lock.aclose(retire=self.locks.retire_on_close)
            try:
                await asyncio.wait_for(closing, CLOSE_TIMEOUT)
            except (TimeoutError, *REDIS_ERRORS) as exc:
                logger.warning(
                    "Could not free the slots of stage %r on close (%s); they come back after the TTL (%s s)",
                    stage,
                    exc or "timeout",
                    lock.ttl,
                )

        if self.started:  # else nothing was ever acquired (Redis unreachable at start)
            await gather_bounded(
                [free(s, lock) for s, lock in self.locks.locks.items()], self.locks.fan_out
            )
            with contextlib.suppress(TimeoutError, *REDIS_ERRORS):
                await asyncio.wait_for(self._free_late_grants(), CLOSE_TIMEOUT)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.locks.deployment.aclose(), CLOSE_TIMEOUT)

    async def _free_late_grants(self) -> None:
        """Free a grant Redis handed to a cancelled wait after aclose() (it may see the wait's
        connection close only after serving it a slot freed by aclose() itself); without this it
        would wait for the TTL. On every master of a quorum (one owner name on all)."""
        if not self.locks.locks:
            return
        await asyncio.sleep(LATE_GRANT_PAUSE)

        async def on(client: AsyncRedisClient) -> None:
            runner = CommandRunner(client)
            for lock in self.locks.locks.values():
                if not lock.queued:
                    continue  # only light grants (released above): no wait, nothing in its stream
                freed = await adrive(release_consumer(lock.keys, lock.owner), runner, lock.name)
                if freed:
                    logger.debug("Freed %d late grant(s) of %r on close", freed, lock.name)

        results = await asyncio.gather(
            *(on(client) for client in self.locks.clients), return_exceptions=True
        )
        errors = [result for result in results if isinstance(result, BaseException)]
        if len(errors) == len(results):
            raise errors[0]


__all__ = ["Lifecycle", "SystemEvents"]
