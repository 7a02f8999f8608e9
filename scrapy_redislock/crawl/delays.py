"""Delays: the cluster-wide delays and rate windows of stages, keys and scopes, on Redis's clock.

- :meth:`Delays.wait_start` books the next start of a stage or ``key:<key>`` at least its delay
  after the previous booking, sleeps until it and confirms it against the previous *confirmed* start
  (:mod:`scrapy_redislock.lock.delay`): one EVALSHA per start while the name is free, two when it
  waited; with no delay (a gap of 0) it only waits out a Retry-After pause;
- :meth:`Delays.went_out`: a confirmed start whose request reached Scrapy's downloader more than
  :data:`LATE_SEND` after its confirmation moves the name's next start back by its lateness;
- :meth:`Delays.wait_rate`: N starts per T seconds, a sliding log on Redis's clock
  (``lock/scripts/rate.lua``), one wait per name and process.

Every operation goes through the keys' registry's one runner (its scripts registered once); a
booking, a confirmation and a rate window's try are retried with back-off on Redis errors until
:meth:`Delays.close` (a start is never let through unconfirmed), a late start's correction is not
(a failure only loses the correction). Reads no settings itself (its owner passes
REDISLOCK_RANDOMIZE_DELAY).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from scrapy_redislock._redis import Backoff
from scrapy_redislock.crawl.reach import REDIS_ERRORS
from scrapy_redislock.lock.delay import (
    book_start,
    confirm_start,
    delay_keys,
    gap_of,
    push_start,
    take_rate,
)
from scrapy_redislock.lock.protocol import Operation, adrive

if TYPE_CHECKING:
    from scrapy_redislock.lock.base import CommandRunner
    from scrapy_redislock.lock.core import Clock

logger = logging.getLogger(__name__)
T = TypeVar("T")
# seconds from a start's confirmation to its request reaching the downloader beyond which the
# name's next start is moved back (one more script): a few loop iterations on an idle process
LATE_SEND = 0.001

__all__ = ["LATE_SEND", "ConfirmedStart", "Delays"]


@dataclass(frozen=True)
class ConfirmedStart:
    """A start confirmed on Redis's clock: of ``name``, at ``at`` (seconds since the epoch), keeping
    ``gap`` after it, after ``waited`` seconds of sleep; ``confirmed`` is when the confirmation came
    back, on this process's monotonic clock."""

    name: str
    at: float
    gap: float
    waited: float
    confirmed: float


class Delays:
    """The delays and rate windows of one crawler's requests (see the module docstring)."""

    def __init__(
        self,
        runner: CommandRunner,
        key_prefix: str,
        stats: Any,
        *,
        randomize: bool,
        clock: Clock = time.monotonic,
    ) -> None:
        self.runner = runner
        self.key_prefix = key_prefix
        self.stats = stats
        self.randomize = randomize  # REDISLOCK_RANDOMIZE_DELAY
        self.clock = clock
        self.closed = False
        self._pushes: set[asyncio.Task[bool]] = set()  # late starts' corrections under way
        # one wait per rate-limited scope and process (the others line up here, first come first
        # served); members of rate logs: this process's token and a count
        self._rate_lines: dict[str, asyncio.Lock] = {}
        self._rate_users: Counter[str] = Counter()
        self._rate_token = uuid.uuid4().hex[:12]
        self._rate_count = 0

    async def wait_start(self, name: str, delay: float) -> ConfirmedStart:
        """Book the next start of ``name`` (a stage, or ``key:<key>``) ``delay`` after the previous
        one, across every process (first come, first served), sleep until it and confirm it against
        the previous confirmed start (:mod:`scrapy_redislock.lock.delay`). Redis errors are logged
        and retried with back-off (a start is never let through unconfirmed)."""
        gap = gap_of(delay, self.randomize)
        keys = delay_keys(self.key_prefix, name)
        booking = await self._delay_command(lambda: book_start(keys, gap), name)
        waited, wait, at = 0.0, booking.wait, booking.at
        while not booking.confirmed:
            if wait > 0:
                await asyncio.sleep(wait)
                waited += wait
            wait, at = await self._delay_command(lambda: confirm_start(keys, gap), name)
            if not wait:
                break
            self.stats.inc_value("redislock/delay/held_back")
        return ConfirmedStart(name, at, gap, waited, self.clock())

    async def wait_rate(self, name: str, count: int, window: float) -> tuple[float, float]:
        """Start once fewer than ``count`` starts of ``name`` (``key:<scope>``) lie in the last
        ``window`` seconds on Redis's clock, across every process (``lock/scripts/rate.lua``): one
        script per try, one try per freed place; returns (the start, seconds since the epoch on
        Redis's clock; seconds waited). One wait per scope in this process: its other requests line
        up behind it."""
        keys = delay_keys(self.key_prefix, name)
        line = self._rate_lines.setdefault(name, asyncio.Lock())
        self._rate_users[name] += 1
        waited = 0.0
        try:
            async with line:
                while True:
                    self._rate_count += 1
                    member = f"{self._rate_token}:{self._rate_count}"
                    wait, now = await self._delay_command(
                        functools.partial(take_rate, keys, count, window, member), name
                    )
                    if not wait:
                        return now, waited
                    await asyncio.sleep(wait)
                    waited += wait
        finally:
            self._rate_users[name] -= 1
            if not self._rate_users[name]:
                del self._rate_users[name]
                del self._rate_lines[name]

    def went_out(self, start: ConfirmedStart) -> None:
        """The request of ``start`` reached Scrapy's downloader now: if that is more than
        :data:`LATE_SEND` after its confirmation came back, the name's next start keeps the gap
        after now (one script, in a task of its own; a failure only loses the correction)."""
        lateness = self.clock() - start.confirmed
        self.stats.max_value("redislock/delay/send_lag_max", lateness)
        if lateness <= LATE_SEND or self.closed:
            return
        self.stats.inc_value("redislock/delay/late_sends")
        keys = delay_keys(self.key_prefix, start.name)
        task = asyncio.get_running_loop().create_task(
            adrive(push_start(keys, start.at, lateness, start.gap), self.runner, start.name)
        )
        self._pushes.add(task)
        task.add_done_callback(self._pushed)

    def _pushed(self, task: asyncio.Task[bool]) -> None:
        self._pushes.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("Could not move a late start's next start: %s", task.exception())

    async def _delay_command(self, make: Callable[[], Operation[T]], name: str) -> T:
        """One delay operation, retried with back-off on Redis errors until :meth:`close`."""
        backoff = Backoff()
        while True:
            try:
                return await adrive(make(), self.runner, name)
            except REDIS_ERRORS as exc:
                if self.closed:
                    raise
                pause = backoff.next()
                logger.warning(
                    "Booking a start of %r: Redis error (%s); retrying in %.1f s", name, exc, pause
                )
                self.stats.inc_value("redislock/redis_errors")
                await asyncio.sleep(pause)

    def close(self) -> None:
        """The keys' registry closes (the spider's close, a forced shutdown): no more retries; the
        late starts' corrections under way are dropped."""
        self.closed = True
        for push in list(self._pushes):
            push.cancel()
