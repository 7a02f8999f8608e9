"""How the worker front tells a Redis outage: one warning when it starts, one info line when Redis
answers again.

An outage (Redis down, paused, restarting, a Sentinel or Cluster failover) makes every Redis call of
a worker fail until it is over: the loop's step, the pushes of what callbacks yielded, the
acknowledgements. Each of them retries with back-off and loses nothing, so an outage is not an
error: :class:`OutageLog` says so once, as a WARNING, with the first error; the failures after it
(every retry of every caller) go to DEBUG; the first call that gets an answer logs one INFO line
with how long it lasted. The callers count every failure (``redislock/workers/redis_errors``). An
ERROR is kept for what loses work (see the scheduler). :meth:`OutageLog.retrying` is the one retry
loop those callers share.

Imports neither Scrapy nor Twisted; reads no settings.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from scrapy_redislock._redis import Backoff
from scrapy_redislock.crawl.reach import OUTAGE_ERRORS

if TYPE_CHECKING:
    from scrapy_redislock.lock.core import Clock

T = TypeVar("T")

# A call sent before Redis came back can fail just after another call's answer ended the outage:
# within this many seconds of the end, a failure is a straggler of that outage (DEBUG), not a new
# one.
STRAGGLERS = 2.0

# the worker front's log lines, in one place
logger = logging.getLogger("scrapy_redislock.workers.scheduler")


class OutageLog:
    """The state of one worker's view of Redis: answering, or in an outage since when (see the
    module docstring)."""

    def __init__(
        self,
        worker: str,
        on_failure: Callable[[], None] | None = None,
        on_back: Callable[[], None] | None = None,
        *,
        clock: Clock,
    ) -> None:
        self.worker = worker
        self.clock = clock  # monotonic seconds (the scheduler's: a fake one in unit tests)
        self.on_failure = on_failure  # every failed call of :meth:`retrying` (to count it)
        self.on_back = on_back  # the call of :meth:`retrying` that ended an outage
        # when (on the clock) the first failure of the current outage came
        self.since: float | None = None
        self.failures = 0  # failed calls in the current outage
        self.ended: float = -STRAGGLERS  # when the last outage ended

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, what: str, exc: BaseException, retry_in: float | None = None) -> None:
        """A call failed with an outage error: WARNING for the first of an outage, DEBUG for the
        others."""
        self.failures += 1
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        retry = f"; retrying in {retry_in:.1f} s" if retry_in is not None else ""
        if self.since is None and self.clock() - self.ended < STRAGGLERS:
            logger.debug(
                "Worker %s: %s failed just after Redis came back (%s)%s",
                self.worker,
                what,
                error,
                retry,
            )
            return
        if self.since is None:
            self.since = self.clock()
            logger.warning(
                "Worker %s: Redis does not answer (%s, %s); waiting for it, retrying with back-off (nothing is dropped; the crawl goes on when it answers)",  # noqa: E501
                self.worker,
                what,
                error,
            )
        else:
            logger.debug("Worker %s: %s failed (%s)%s", self.worker, what, error, retry)

    def answered(self) -> None:
        """A call got an answer: the end of an outage, if one was going on (INFO, once)."""
        if self.since is None:
            return
        self.ended = self.clock()
        lasted, failures = self.ended - self.since, self.failures
        self.since, self.failures = None, 0
        logger.info(
            "Worker %s: Redis answers again after %.1f s (%d failed calls retried); going on",
            self.worker,
            lasted,
            failures,
        )

    async def retrying(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Retry a call until Redis answers: a request yielded by a callback must not be dropped.
        Only an outage is retried; Redis refusing the command is raised."""
        backoff = Backoff()
        while True:
            try:
                result = await call()
            except OUTAGE_ERRORS as exc:
                if self.on_failure is not None:
                    self.on_failure()
                delay = backoff.next()
                self.failed(what, exc, delay)
                await asyncio.sleep(delay)
                continue
            if self.down and self.on_back is not None:
                self.on_back()
            self.answered()
            return result


__all__ = ["OutageLog"]
