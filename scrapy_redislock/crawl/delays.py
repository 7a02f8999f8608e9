"""Delays: the cluster-wide delays and rate windows of stages, keys and scopes, on Redis's clock.

- :meth:`Delays.wait_start` books the next start of a stage or ``key:<key>`` at least its delay
  after the previous booking, sleeps until it and confirms it against the previous *confirmed* start
  (:mod:`scrapy_redislock.lock.delay`): one EVALSHA per start while the name is free, two when it
  waited; with no delay (a gap of 0) it only waits out a Retry-After pause;
- :meth:`Delays.went_out`: a confirmed start whose request reached Scrapy's downloader more than
  :data:`LATE_SEND` after its confirmation moves the name's next start back by its lateness;
- :meth:`Delays.wait_rate`: N starts per T seconds, a sliding log on Redis's clock
  (``lock/scripts/rate.lua``), one wait per name and process; a logged start that goes out late
  moves its entry to when it went (``lock/scripts/rate_late.lua``); :meth:`Delays.rate_full` says
  whether a key's or scope's window was full at, or after, this process's last try (told to wait,
  or it took the last place) till a try a window later finds room at once and leaves some;
- a request's several waits (a stage's delay, its key's, a scope's rate window...) run one after
  another: before one of them sleeps, the starts the request confirmed or logged before it are
  moved to the end of that sleep (one script each), so that no other process's start of those
  names comes closer than their gap, or into their window, while this request still waits.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from scrapy_redislock._redis import Backoff
from scrapy_redislock.crawl.reach import REDIS_ERRORS
from scrapy_redislock.lock.delay import (
    book_start,
    confirm_start,
    delay_keys,
    gap_of,
    push_rate,
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
# seconds a request's earlier starts are moved ahead while it waits behind another of this process
# for a rate window (again every half of it)
LINE_HOLD = 1.0
# entries in the table of rate windows found full past which those whose window has passed are
# dropped (and again each time the table doubles)
RATE_PRUNE_AT = 1024

__all__ = ["LATE_SEND", "ConfirmedStart", "Delays", "RateStart", "Start"]


@dataclass(frozen=True)
class ConfirmedStart:
    """A start confirmed on Redis's clock: of ``name``, at ``at`` (seconds since the epoch), keeping
    ``gap`` after it, after ``waited`` seconds of sleep; ``confirmed`` is when the confirmation came
    back, or was sent if its round trip took more than :data:`LATE_SEND` (:meth:`Delays._reply`), on
    this process's monotonic clock."""

    name: str
    at: float
    gap: float
    waited: float
    confirmed: float


@dataclass(frozen=True)
class RateStart:
    """A start logged in a rate window on Redis's clock: of ``name``, at ``at`` (seconds since the
    epoch), as ``member`` of its log of ``window`` seconds, after ``waited`` seconds of sleep;
    ``confirmed`` as for :class:`ConfirmedStart`."""

    name: str
    at: float
    member: str
    window: float
    waited: float
    confirmed: float


Start = ConfirmedStart | RateStart


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
        # the rate windows this process last found full (a try told to wait, or
        # one that took the last place), with when each is surely past, till a try after that, not
        # lined up behind another, finds room at once and leaves some: their requests leave
        # StageScheduler one at a time (StartWaits); passed entries are pruned once the table doubles
        self._rate_full: dict[str, float] = {}
        self._rate_prune_at = RATE_PRUNE_AT

    async def wait_start(
        self, name: str, delay: float, earlier: Sequence[Start] = ()
    ) -> ConfirmedStart:
        """Book the next start of ``name`` (a stage, or ``key:<key>``) ``delay`` after the previous
        one, across every process (first come, first served), sleep until it and confirm it against
        the previous confirmed start (:mod:`scrapy_redislock.lock.delay`). Redis errors are logged
        and retried with back-off (a start is never let through unconfirmed). ``earlier``: the
        request's starts before this one, moved to the end of each sleep here."""
        gap = gap_of(delay, self.randomize)
        keys = delay_keys(self.key_prefix, name)
        booking, confirmed = await self._reply(lambda: book_start(keys, gap), name)
        waited, wait, at = 0.0, booking.wait, booking.at
        while not booking.confirmed:
            if wait > 0:
                await self._sleep(wait, earlier)
                waited += wait
            (wait, at), confirmed = await self._reply(lambda: confirm_start(keys, gap), name)
            if not wait:
                break
            self.stats.inc_value("redislock/delay/held_back")
        return ConfirmedStart(name, at, gap, waited, confirmed)

    async def wait_rate(
        self, name: str, count: int, window: float, earlier: Sequence[Start] = ()
    ) -> RateStart:
        """Start once fewer than ``count`` starts of ``name`` (``key:<scope>``) lie in the last
        ``window`` seconds on Redis's clock, across every process (``lock/scripts/rate.lua``): one
        script per try, one try per freed place. One wait per scope in this process: its other
        requests line up behind it. ``earlier`` as for :meth:`wait_start`."""
        keys = delay_keys(self.key_prefix, name)
        line = self._rate_lines.setdefault(name, asyncio.Lock())
        self._rate_users[name] += 1
        waited = 0.0
        try:
            # a try lined up behind another of this process's (the count covers the holder and
            # those queued, with no gap between a release and the next one's wake-up) finds room
            # mostly because that one waited for it: the window stays held
            lined_up = self._rate_users[name] > 1
            await self._acquire_line(line, earlier)
            try:
                while True:
                    self._rate_count += 1
                    member = f"{self._rate_token}:{self._rate_count}"
                    (wait, now, left), confirmed = await self._reply(
                        functools.partial(take_rate, keys, count, window, member), name
                    )
                    if not wait:
                        if not left:  # took the window's last place: full till its oldest goes
                            self._found_full(name, window)
                        elif not waited and not lined_up and self._passed(name):
                            self._rate_full.pop(name, None)
                        return RateStart(name, now, member, window, waited, confirmed)
                    self._found_full(name, max(window, wait))
                    await self._sleep(wait, earlier)
                    waited += wait
            finally:
                line.release()
        finally:
            self._rate_users[name] -= 1
            if not self._rate_users[name]:
                del self._rate_users[name]
                del self._rate_lines[name]

    def _found_full(self, name: str, lasting: float) -> None:
        """A try of ``name`` was told to wait, or took its window's last place; the window stays
        full for about ``lasting`` seconds more (its length, or the wait when longer: an entry moved
        late may lie ahead). The entries whose time has passed with no try of this process waiting
        are dropped once the table doubles."""
        now = self.clock()
        self._rate_full[name] = now + lasting
        if len(self._rate_full) >= self._rate_prune_at:
            for passed in [n for n, until in self._rate_full.items() if until < now]:
                if passed not in self._rate_users:
                    del self._rate_full[passed]
            self._rate_prune_at = max(RATE_PRUNE_AT, 2 * len(self._rate_full))

    def _passed(self, name: str) -> bool:
        """The window of ``name`` was last found full a window or more ago: only then may a try
        that finds room lift the hold (a burst's entries, logged together, are freed together, so
        the tries right after a wait find room beside each other)."""
        return self._rate_full.get(name, 0.0) <= self.clock()

    def rate_full(self, name: str) -> bool:
        """The rate window of ``name`` (a stage, or ``key:<scope>``) was full at, or after, this process's
        last try of it (told to wait, or it took the last place), and no try since, a window or
        more later, found room at once and left some (a try lined up behind another of this
        process's, or one that waited, does not count; forgotten once passed, see
        :meth:`_found_full`)."""
        return name in self._rate_full

    def rate_waiting(self, name: str | None = None) -> bool:
        """A request of this process waits for a place in the full rate window of ``name``;
        without one, whether any window was found full (a cheap look first)."""
        if name is None:
            return bool(self._rate_full)
        return name in self._rate_full and name in self._rate_users

    def went_out(self, start: Start) -> None:
        """The request of ``start`` reached Scrapy's downloader now: if that is more than
        :data:`LATE_SEND` after its confirmation came back, the name's next start keeps the gap
        after now, or its entry in the rate window moves to now (one script, in a task of its own;
        a failure only loses the correction)."""
        lateness = self.clock() - start.confirmed
        what = "rate" if isinstance(start, RateStart) else "delay"
        self.stats.max_value(f"redislock/{what}/send_lag_max", lateness)
        if lateness <= LATE_SEND or self.closed:
            return
        self.stats.inc_value(f"redislock/{what}/late_sends")
        task = asyncio.get_running_loop().create_task(
            adrive(self._moved(start, lateness), self.runner, start.name)
        )
        self._pushes.add(task)
        task.add_done_callback(self._pushed)

    def _moved(self, start: Start, lateness: float) -> Operation[bool]:
        """The script that tells Redis ``start`` goes out ``lateness`` seconds after its reply."""
        keys = delay_keys(self.key_prefix, start.name)
        if isinstance(start, RateStart):
            return push_rate(keys, start.member, start.at + lateness, start.window)
        return push_start(keys, start.at, lateness, start.gap)

    async def _sleep(self, seconds: float, earlier: Sequence[Start]) -> None:
        """Sleep before a start, the request's ``earlier`` starts moved to the sleep's end first:
        they go out with this one, and until it no other start of their names may come within
        their gap or window (counted as ``redislock/delay/held_back_starts``). The sleep ends
        where the moves said, their round trip included."""
        deadline = self.clock() + seconds
        await self._hold(earlier, deadline)
        await asyncio.sleep(max(0.0, deadline - self.clock()))

    async def _hold(self, earlier: Sequence[Start], until: float) -> None:
        """Move the request's ``earlier`` starts to ``until`` (this process's monotonic clock)."""
        if not earlier:
            return
        moves = [
            self._delay_command(
                functools.partial(self._moved, start, until - start.confirmed), start.name
            )
            for start in earlier
        ]
        await asyncio.gather(*moves)
        self.stats.inc_value("redislock/delay/held_back_starts", len(earlier))

    async def _acquire_line(self, line: asyncio.Lock, earlier: Sequence[Start]) -> None:
        """This process's one wait for a rate window: the requests behind it line up here, first
        come, first served, their ``earlier`` starts moved :data:`LINE_HOLD` ahead every half of
        it meanwhile (as before a sleep: their names keep their gaps after the moment they go)."""
        if not earlier or not line.locked():
            await line.acquire()
            return
        acquiring = asyncio.ensure_future(line.acquire())
        try:
            while True:
                await self._hold(earlier, self.clock() + LINE_HOLD)
                done, _ = await asyncio.wait({acquiring}, timeout=LINE_HOLD / 2)
                if done:
                    return
        except BaseException:
            if acquiring.done() and not acquiring.cancelled():
                line.release()  # acquired just as this wait was cancelled
            else:
                acquiring.cancel()
            raise

    def _pushed(self, task: asyncio.Task[bool]) -> None:
        self._pushes.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("Could not move a late start's next start: %s", task.exception())

    async def _delay_command(self, make: Callable[[], Operation[T]], name: str) -> T:
        """One delay operation, retried with back-off on Redis errors until :meth:`close`."""
        return (await self._reply(make, name))[0]

    async def _reply(self, make: Callable[[], Operation[T]], name: str) -> tuple[T, float]:
        """:meth:`_delay_command`'s reply, and the moment a start it confirms is taken to be
        confirmed, on this process's clock: when the reply came, or, when it took more than
        :data:`LATE_SEND`, when the command was sent (a reply held up on its way back, or a stall
        before it was read, is lateness the late send's correction must count)."""
        backoff = Backoff()
        while True:
            sent = self.clock()
            try:
                value = await adrive(make(), self.runner, name)
                replied = self.clock()
                return value, sent if replied - sent > LATE_SEND else replied
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
