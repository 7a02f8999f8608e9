"""CloseWaits: the requests waiting in StageLockMiddleware for a slot, of their stage
(:meth:`RequestSlots.wait <scrapy_redislock.requests.requestslots.RequestSlots.wait>`) or of their key
or another scope (:class:`~scrapy_redislock.requests.throttle.ScopeThrottle`), or for their start
(a delay, a rate window, a Retry-After's pause), and what becomes of them when the spider closes.
One record and one watch for all: they hold one of CONCURRENT_REQUESTS each, and the engine's close
waits for them.

Once the engine closes:

- a request that left StageScheduler goes back into its queue (JOBDIR and SCHEDULER_PERSIST keep
  it) and out of the downloader with IgnoreRequest, counted as
  ``redislock/<stage>/given_back_at_close`` or ``redislock/keys/given_back_at_close``; dropped,
  said at WARNING, if the scheduler cannot take it;
- the others (no StageScheduler, or media downloads, which an item waits for) keep waiting while
  what they wait for makes progress; the waits of a stage or key that is paused, or that frees no
  slot anywhere for REDISLOCK_TTL + DOWNLOAD_TIMEOUT, are dropped (IgnoreRequest), said at WARNING
  with counts and counted as ``redislock/<stage>/dropped_at_close`` or
  ``redislock/keys/dropped_at_close``, so that the close never hangs for ever; a wait for a start
  ends by itself (a delay or window is at most a day, a pause 600 s);
- once the slots' registry closes (spider_closed), the waits left end with IgnoreRequest.

Reads REDISLOCK_TTL (through the checked settings) and DOWNLOAD_TIMEOUT.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from scrapy.exceptions import IgnoreRequest

from scrapy_redislock._loop import every
from scrapy_redislock.crawl.engine import engine_closing, one_per_crawler

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler

    from scrapy_redislock.crawl.settings import RedisLockSettings
    from scrapy_redislock.crawl.stagelocks import StageLocks

logger = logging.getLogger(__name__)
T = TypeVar("T")

# How often the waits check whether the engine is closing (its close waits for them).
CLOSE_CHECK_INTERVAL = 0.1
# Once it closes, how often what they wait for is checked for progress (one read of the lock in
# Redis per stage or key).
STALL_CHECK_INTERVAL = 1.0


@dataclass
class Waiting:
    """A request waiting in the middleware for a slot of ``name`` (a stage; a key or scope when
    ``keyed``) of the registry ``locks``, or for its start (``start``: a delay, a rate window, a
    pause); given back to the scheduler or dropped at close."""

    request: Request
    name: str
    locks: StageLocks
    keyed: bool
    start: bool = False
    given_back: bool = False
    dropped: bool = False

    @property
    def what(self) -> str:
        return f"key {self.name!r}" if self.keyed else f"stage {self.name!r}"

    @property
    def stats(self) -> str:
        return "redislock/keys" if self.keyed else f"redislock/{self.name}"

    @property
    def open(self) -> bool:
        return not (self.given_back or self.dropped)


class CloseWaits:
    """The crawler's requests waiting in the middleware for a slot (see the module docstring)."""

    @classmethod
    def of(cls, crawler: Crawler, settings: RedisLockSettings) -> CloseWaits:
        """The crawler's one instance (the middleware's stage waits and the throttle's key
        waits)."""
        return one_per_crawler(crawler, "_redislock_close_waits", lambda: cls(crawler, settings))

    def __init__(self, crawler: Crawler, settings: RedisLockSettings) -> None:
        self.crawler = crawler
        self.stall_window = settings.ttl + crawler.settings.getfloat("DOWNLOAD_TIMEOUT", 180)
        self.waits: dict[asyncio.Future[Any], Waiting] = {}
        # StageScheduler's (serve_scheduler): whether a request left it, and the way back in
        self.left_scheduler: Callable[[Request], bool] | None = None
        self.give_back: Callable[[Request], bool] | None = None
        self._watcher: asyncio.Task[None] | None = None

    def serve_scheduler(
        self, left: Callable[[Request], bool], give_back: Callable[[Request], bool]
    ) -> None:
        """StageScheduler, once, over an inner scheduler it can give requests back to:
        ``left(request)``, whether the request left it (not one that bypassed it), and
        ``give_back(request)``, back into its queue (False once it has closed)."""
        self.left_scheduler, self.give_back = left, give_back

    async def wait(
        self,
        request: Request,
        name: str,
        locks: StageLocks,
        slot: Awaitable[T],
        *,
        keyed: bool = False,
        start: bool = False,
    ) -> T:
        """``request``'s slot of ``name``, from ``slot`` (with ``start``: its start); IgnoreRequest
        when the spider closes meanwhile and the request is given back to the scheduler, dropped,
        or its registry closed. A slot's wait runs in a task of its own; a start's in the request's
        own task, which the close cancels (most starts go at once: no task, no loop turn more)."""
        wait: asyncio.Future[Any] | None = (
            asyncio.current_task() if start else asyncio.ensure_future(slot)
        )
        assert wait is not None  # a start is waited for in a task
        waiting = self.waits[wait] = Waiting(request, name, locks, keyed, start)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(
                every(self._interval, self._tick, what="watching the waits for the close")
            )
        try:
            return await (slot if start else wait)
        except asyncio.CancelledError:
            if waiting.given_back:
                self._hand_back(waiting)
            if waiting.dropped or (locks.closed and wait.cancelled()):
                if waiting.start:
                    raise IgnoreRequest(
                        f"spider closing while waiting for its start of {waiting.what}"
                    ) from None
                raise IgnoreRequest(
                    f"spider closing while waiting for a slot of {waiting.what}"
                ) from None
            raise
        finally:
            del self.waits[wait]

    def _interval(self) -> float:
        return STALL_CHECK_INTERVAL if engine_closing(self.crawler) else CLOSE_CHECK_INTERVAL

    async def _tick(self) -> bool:
        """One look: nothing before the engine closes; then give back what left the scheduler, and
        drop the waits of what is paused or stalled, or whose registry closed."""
        if not engine_closing(self.crawler):
            return bool(self.waits)
        self._hand_back_all()
        stalled: dict[tuple[StageLocks, str], str] = {}
        for waiting in [w for w in self.waits.values() if w.open and not w.start]:
            about = (waiting.locks, waiting.name)
            if waiting.locks.closed:
                stalled[about] = "its slots were closed"
            elif about not in stalled:
                stalled[about] = await waiting.locks.reports.stalled(
                    waiting.name, self.stall_window
                )
        for (locks, name), why in sorted(stalled.items(), key=lambda item: item[0][1]):
            if why:
                self._drop(locks, name, why)
        return bool(self.waits)

    def _hand_back_all(self) -> None:
        """Every request that left StageScheduler and waits here goes back to the scheduler's queue
        (see :meth:`_hand_back`) instead of waiting for a slot it would take only to be fetched
        during the close. Requests that bypassed the scheduler (media downloads: an item waits for
        them) keep waiting."""
        left = self.left_scheduler
        if left is None or self.give_back is None:
            return
        handing: Counter[tuple[bool, str]] = Counter()
        for wait, waiting in list(self.waits.items()):
            if waiting.open and left(waiting.request) and wait.cancel():
                waiting.given_back = True
                handing[waiting.start, "their key" if waiting.keyed else waiting.what] += 1
        for (start, what), count in sorted(handing.items()):
            if start:
                logger.info(
                    "Spider closing: %d request(s) waiting for their start of %s (a delay, a rate window or a pause) go back to the scheduler's queue",  # noqa: E501
                    count,
                    what,
                )
            else:
                logger.info(
                    "Spider closing: %d request(s) waiting for a slot of %s go back to the scheduler's queue",
                    count,
                    what,
                )

    def _hand_back(self, waiting: Waiting) -> None:
        """Back into the scheduler's queue, and out of the downloader with IgnoreRequest (its slots
        are released as for any exception); if the scheduler cannot take it, it is dropped, said
        at WARNING."""
        assert self.give_back is not None
        try:
            given = self.give_back(waiting.request)
        except Exception as exc:  # the queue's own error (Redis refused, a serializer)
            logger.warning(
                "Spider closing: could not give %s back to the scheduler: %s", waiting.request, exc
            )
            given = False
        if given:
            self.crawler.stats.inc_value(f"{waiting.stats}/given_back_at_close")
            if waiting.start:
                raise IgnoreRequest(
                    f"spider closing: given back to the scheduler while waiting for its start of {waiting.what}"
                )
            raise IgnoreRequest(
                f"spider closing: given back to the scheduler while waiting for a slot of {waiting.what}"
            )
        self.crawler.stats.inc_value(f"{waiting.stats}/dropped_at_close")
        if waiting.start:
            logger.warning(
                "Spider closing: dropped %s, waiting for its start of %s: the scheduler could not take it back",
                waiting.request,
                waiting.what,
            )
        else:
            logger.warning(
                "Spider closing: dropped %s, waiting for a slot of %s: the scheduler could not take it back",
                waiting.request,
                waiting.what,
            )
        waiting.dropped = True

    def _drop(self, locks: StageLocks, name: str, why: str) -> None:
        """The waits for ``name`` of ``locks`` are given up: their requests fail with
        IgnoreRequest."""
        dropped = [
            waiting
            for wait, waiting in list(self.waits.items())
            if waiting.open
            and not waiting.start
            and waiting.locks is locks
            and waiting.name == name
            and wait.cancel()
        ]
        for waiting in dropped:
            waiting.dropped = True
        if dropped:
            first = dropped[0]
            self.crawler.stats.inc_value(f"{first.stats}/dropped_at_close", len(dropped))
            logger.warning(
                "Spider closing: dropped %d request(s) waiting for a slot of %s (%s)",
                len(dropped),
                first.what,
                why,
            )


__all__ = ["CloseWaits"]
