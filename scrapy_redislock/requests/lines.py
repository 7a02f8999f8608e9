"""One process's lines for the slots of one registry's names (the stages of
:class:`~scrapy_redislock.crawl.stagelocks.StageLocks`, or the keys and scopes of
:class:`~scrapy_redislock.crawl.keylocks.KeyLocks`): its requests waiting for a slot in the
downloader (StageLockMiddleware, ScopeThrottle), first come first served per name, and the waits in
Redis's line that serve them. One path for a stage's slot and a key's or scope's.

A waiting request gets whichever slot comes first: one freed by a finished request of this process
(the local hand-off, :meth:`SlotLines.pass_on`, within the local reuse bound :meth:`SlotLines.young`:
no Redis round trip) or a grant to one of this process's waits in Redis. The waits in Redis belong
to the line, not to a request: one is opened when more requests wait here than the line has waits
in Redis, and when a request is served locally its wait stays in Redis's line for the next request
(so the process keeps its place in the first-come-first-served line across processes, and no
command is spent withdrawing it). A request that gives up (REDISLOCK_WAIT_TIMEOUT, the spider
closing) withdraws one wait when the line has more waits than its requests and those wanted
(below). A line with no request and no wait left is forgotten (a broad crawl meets thousands of
keys).

The name's requests queued in StageScheduler wait there and take none of CONCURRENT_REQUESTS; what
they have and want is the line's :class:`~.kept.KeptSlots` (``kept``): the line keeps as many more
waits in Redis as they want (:meth:`SlotLines.ask`), each with the owner's ``ask_timeout``. A slot
no request waits for here (a grant, or a freed slot passed on) is kept for them while one could use
it, else it goes back to Redis; so is the AcquireTimeout of a wait that runs out with no request
waiting here (the name's next queued request fails with it). At each renewal round of the front
(:meth:`SlotLines.upkeep`) what is kept and no queued request can use goes back, then the waits no
longer wanted are withdrawn. A line's wait for a stage takes a free slot first while one may well be
free (:meth:`StageLocks.look <scrapy_redislock.crawl.stagelocks.StageLocks.look>`), the same take a
request's key or scope is taken with first. The owner may bound the waits in Redis under way at once
over all its names (``bound``: each blocks one connection, and a broad crawl meets thousands of
keys); the others wait here for their turn. The bound applies only to the waits beyond one per
request waiting here: a request waiting in the middleware may hold other slots (its key's while it
waits for a scope's), so its wait never queues behind waits that may be waiting for those very
slots. A wait that meets a Retry-After's pause of its name (a key's) tells the owner (``on_pause``)
and sleeps it out outside the bound, so that one paused site does not hold up the others' waits.

Reads no settings itself: the wait's timeout, the bound, the local reuse bound (REDISLOCK_LOCAL_REUSE,
at most half REDISLOCK_TTL) and what is kept are the owner's, :class:`~.requestslots.RequestSlots`
for stages and :class:`~.throttle.ScopeThrottle` for keys and scopes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from scrapy_redislock.crawl.reach import REDIS_ERRORS
from scrapy_redislock.errors import AcquireTimeout, Paused

if TYPE_CHECKING:
    from scrapy_redislock.crawl.stagelocks import SlotPermit
    from scrapy_redislock.requests.kept import KeptSlots

logger = logging.getLogger(__name__)


class SlotLine:
    """The requests of this process waiting for a slot of ``name`` (a ``kind``: stage, key), and
    its waits in Redis for them."""

    def __init__(self, name: str, kind: str = "stage") -> None:
        self.name = name
        self.kind = kind
        # requests waiting here, oldest first: each is served once, with a slot or an error
        self.waiters: deque[asyncio.Future[SlotPermit]] = deque()
        # this process's waits in Redis's line for them, and those of them under the owner's bound
        self.asks: set[asyncio.Future[SlotPermit]] = set()
        self.bounded: set[asyncio.Future[SlotPermit]] = set()
        # waits withdrawn here (cancelled as surplus): any other cancel is the loop's or close's
        self.withdrawn: set[asyncio.Future[SlotPermit]] = set()

    def __len__(self) -> int:
        """Requests waiting here now."""
        return sum(1 for served in self.waiters if not served.done())

    def join(self) -> asyncio.Future[SlotPermit]:
        """One more request waits here: the future it is served with (a slot or an error)."""
        served: asyncio.Future[SlotPermit] = asyncio.get_running_loop().create_future()
        self.waiters.append(served)
        return served

    def short(self, wanted: int = 0) -> int:
        """How many more waits in Redis the requests waiting here need (one each), and ``wanted``
        more for requests waiting elsewhere."""
        return len(self) + wanted - len(self.asks)

    def offer(self, permit: SlotPermit) -> bool:
        """Give ``permit`` to the oldest request waiting here; False when none waits."""
        while self.waiters:
            served = self.waiters.popleft()
            if not served.done():
                served.set_result(permit)
                return True
        return False

    def fail_oldest(self, error: BaseException) -> None:
        """The oldest request waiting here fails with ``error`` (what a wait in Redis raised)."""
        for served in self.waiters:
            if not served.done():
                served.set_exception(error)
                break

    def expire(self, served: asyncio.Future[SlotPermit], timeout: float) -> bool:
        """A request's wait ran out: it fails with AcquireTimeout; False when it was served
        already."""
        if served.done():
            return False
        served.set_exception(
            AcquireTimeout(f"{self.kind} {self.name!r}: no slot within {timeout} s")
        )
        return True

    def leave(self, served: asyncio.Future[SlotPermit]) -> SlotPermit | None:
        """A request stopped waiting without taking a slot (timeout, cancel): a slot handed to it
        meanwhile, to go on."""
        if served in self.waiters:
            self.waiters.remove(served)
        if not served.done():
            served.cancel()
        elif not served.cancelled() and served.exception() is None:
            return served.result()  # handed to it just as it was cancelled
        return None

    def withdraw(self, wanted: int = 0) -> None:
        """Cancel the waits in Redis beyond the requests waiting here and ``wanted``, those under
        the bound first (each frees a place under it)."""
        extra = max(0, -self.short(wanted))
        for ask in sorted(self.asks, key=lambda ask: ask not in self.bounded)[:extra]:
            self.withdrawn.add(ask)
            ask.cancel()

    def cancel(self) -> None:
        """The locks closed, or the loop is ending: every request waiting here stops waiting
        (cancelled)."""
        while self.waiters:
            served = self.waiters.popleft()
            if not served.done():
                served.cancel()


class SlotLines:
    """The lines of one registry's names in this process (see the module docstring)."""

    def __init__(
        self,
        kept: KeptSlots,
        *,
        reuse_for: float,
        kind: str = "stage",
        ask_timeout: float | None = None,
        bound: int | None = None,
    ) -> None:
        self.kept = kept  # what the names' queued requests have and want
        self.locks = kept.locks  # the registry the waits in Redis go to
        self.kind = kind  # what its names are, for messages: stage, key
        self.reuse_for = reuse_for  # the local hand-off's bound, in seconds since Redis's grant
        self.ask_timeout = ask_timeout  # a wait's own timeout in Redis (None: none)
        # waits in Redis under way at once, over all names (None: no bound)
        self.bound = None if bound is None else asyncio.Semaphore(max(1, bound))
        self.lines: dict[str, SlotLine] = {}
        # told when a Retry-After paused a name one of the waits here is for (name, seconds)
        self.on_pause: Callable[[str, float], None] | None = None

    def waiting(self, name: str) -> int:
        """Requests waiting here for a slot of ``name`` now."""
        line = self.lines.get(name)
        return 0 if line is None else len(line)

    def asking(self, name: str) -> int:
        """This process's waits in Redis for a slot of ``name`` now (or waiting for their turn
        under the bound)."""
        line = self.lines.get(name)
        return 0 if line is None else len(line.asks)

    def young(self, permit: SlotPermit, now: float) -> bool:
        """Whether a finished request's slot may pass straight to another request of this process:
        granted by Redis less than the reuse bound ago (after that it goes back to Redis's
        first-come-first-served line, where other processes may wait)."""
        return now - permit.acquired_at < self.reuse_for

    def offer(self, permit: SlotPermit) -> bool:
        """Give ``permit`` to the oldest request of this process waiting for a slot of its name (in
        Redis's line too: its wait there stays for the next request); False when none waits."""
        line = self.lines.get(self.locks.stage_of(permit) or "")
        return line is not None and line.offer(permit)

    def pass_on(self, permit: SlotPermit, now: float) -> str | None:
        """The local hand-off, for a stage's slot and a key's or scope's alike: give a freed slot
        to a request of this process, the oldest waiting here, else one queued in StageScheduler
        (kept for it while one could use it). Only a young, usable slot (``now`` on the owner's
        clock) passes on. The name it went to, or None: the caller sends it back to Redis."""
        name = self.locks.stage_of(permit)
        if name is None or self.locks.closed:
            return None
        if not self.waiting(name) and not self.kept.could_use(name):
            return None  # nobody here to pass it to
        if not self.young(permit, now):
            # back to Redis's line, where other processes may wait (and never near the lease's end)
            return None
        if not self.locks.usable(permit, now):
            return None
        if self.offer(permit) or self.kept.offer(name, permit):
            return name
        return None

    def free(self, permit: SlotPermit) -> None:
        """A request is done with ``permit``: passed on here (:meth:`pass_on`, counted as
        ``<name>/reused``), else back to Redis now. One rule for a stage's slot and a key's."""
        name = self.pass_on(permit, self.locks.clock())
        if name is None:
            self.locks.release_soon(permit)
        else:
            self.locks.count(name, "reused")

    def upkeep(self) -> None:
        """At each renewal round of the front: what is kept and no queued request can use (or can
        no longer go with one) goes back first, then the waits in Redis no longer wanted are
        withdrawn."""
        self.kept.prune()
        self.trim()

    async def wait(self, name: str, timeout: float | None) -> SlotPermit:
        """A slot of ``name`` from this process's line for it (a slot freed here, or a grant to one
        of its waits in Redis); AcquireTimeout after ``timeout`` s (None: none), counted as
        ``<name>/timeouts``."""
        line = self.lines.get(name)
        if line is None:
            line = self.lines[name] = SlotLine(name, self.kind)
        served = line.join()
        loop = asyncio.get_running_loop()
        timer = (
            None
            if timeout is None
            else loop.call_later(timeout, self._expire, line, served, timeout)
        )
        self._ask(line)
        given = False
        try:
            permit = await served
            given = True
            return permit
        finally:
            if timer is not None:
                timer.cancel()
            if not given:
                self._gave_up(line, served)
            self._tidy(line)

    def ask(self, name: str) -> None:
        """The owner has requests of ``name`` queued and nothing kept for them: they wait from now
        (unless they did already), and as many more waits in Redis as they want are opened."""
        self.kept.asked(name)
        line = self.lines.get(name)
        if line is None:
            line = self.lines[name] = SlotLine(name, self.kind)
        self._ask(line)
        self._tidy(line)

    def trim(self) -> None:
        """Withdraw the waits in Redis that neither a request waiting here nor the queued ones need
        any more (at each renewal round of the front)."""
        for line in list(self.lines.values()):
            line.withdraw(self.kept.wanted(line.name))

    def _place(self, line: SlotLine, outcome: SlotPermit | AcquireTimeout) -> None:
        """A grant no request waits for here, or a wanted wait's timeout: kept for the queued
        requests while one could use it, else back to Redis (an error forgotten). A key's wait is
        opened again at once while they want more (``keep_asking``); a stage's when its owner asks
        again, so that a grant its requests could not use, given back, is not chased by another."""
        if self.kept.offer(line.name, outcome):
            if self.kept.keep_asking:
                self._ask(line)
        elif not isinstance(outcome, BaseException):
            self.locks.release_soon(outcome)

    def _ask(self, line: SlotLine) -> None:
        """One wait in Redis per request waiting in ``line``, and those the queued ones want."""
        while line.short(self.kept.wanted(line.name)) > 0 and not self.locks.closed:
            # one unbounded wait per request waiting here; the wanted ones under the bound
            bounded = self.bound is not None and len(line.asks) - len(line.bounded) >= len(line)
            ask = asyncio.ensure_future(self._get(line.name, bounded))
            line.asks.add(ask)
            if bounded:
                line.bounded.add(ask)
            ask.add_done_callback(functools.partial(self._answered, line))

    async def _get(self, name: str, bounded: bool) -> SlotPermit:
        """A slot of ``name`` for the line (``bounded``: once fewer than ``bound`` waits are under
        way; none once the locks closed meanwhile: the registry cancels it). A Retry-After's pause of the name
        (a key's) is told to the owner (``on_pause``) and waited out here, outside the bound: other
        names' waits go on meanwhile. AcquireTimeout after ``ask_timeout`` s, pauses included."""
        clock = self.locks.clock
        deadline = None if self.ask_timeout is None else clock() + self.ask_timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - clock())
            try:
                if self.bound is None or not bounded:
                    return await self._look_then_wait(name, left)
                async with self.bound:
                    return await self._look_then_wait(name, left)
            except Paused as paused:
                if self.on_pause is not None:
                    self.on_pause(name, paused.wait)
                if deadline is not None and clock() + paused.wait > deadline:
                    await asyncio.sleep(max(0.0, deadline - clock()))  # not at once, not again
                    raise AcquireTimeout(
                        f"{self.kind} {name!r}: paused beyond the wait's {self.ask_timeout} s"
                    ) from paused
                await asyncio.sleep(paused.wait)

    async def _look_then_wait(self, name: str, timeout: float | None) -> SlotPermit:
        """Taken at once while one may well be free (:meth:`StageLocks.look
        <scrapy_redislock.crawl.stagelocks.StageLocks.look>`), else, or when the look fails, by a
        wait in Redis's line (which retries Redis errors)."""
        try:
            permit = await self.locks.look(name)
        except (*REDIS_ERRORS, Paused):
            permit = None  # the wait retries Redis errors (with a warning and back-off)
        if permit is not None:
            return permit
        return await self.locks.acquire(name, timeout)  # cancelled at once if closed meanwhile

    def _answered(self, line: SlotLine, ask: asyncio.Future[SlotPermit]) -> None:
        """A wait in Redis ended: its slot goes to the oldest request waiting in ``line``, else to
        the owner's ``place``."""
        line.asks.discard(ask)
        line.bounded.discard(ask)
        withdrawn = ask in line.withdrawn
        line.withdrawn.discard(ask)
        if ask.cancelled():
            if withdrawn and not self.locks.closed:
                self._ask(line)  # as many as are wanted now (none, unless more came meanwhile)
            else:
                # the locks closed, or the event loop is ending (it cancels every task): a wait
                # opened again now would never run, and nothing would close it
                line.cancel()
        elif isinstance(error := ask.exception(), AcquireTimeout):
            # a wanted wait ran out: a request waiting here has a timer of its own
            if not len(line):
                self._place(line, error)
            self._ask(line)
        elif error is not None:
            # what the request's own wait would have raised (a Redis error is retried inside); a
            # wanted wait's is logged, and the owner asks again when it still wants one
            if len(line):
                line.fail_oldest(error)
                self._ask(line)
            else:
                logger.warning("A wait for a slot of %s %r failed: %r", self.kind, line.name, error)
        elif not line.offer(permit := ask.result()):
            self._place(line, permit)
        self._tidy(line)

    def _expire(self, line: SlotLine, served: asyncio.Future[SlotPermit], timeout: float) -> None:
        if line.expire(served, timeout):
            self.locks.count(line.name, "timeouts")

    def _gave_up(self, line: SlotLine, served: asyncio.Future[SlotPermit]) -> None:
        """A request stopped waiting without taking a slot (timeout, cancel): a slot it was handed
        meanwhile goes on; a wait in Redis beyond the requests left is withdrawn."""
        permit = line.leave(served)
        if permit is not None and not line.offer(permit):
            self._place(line, permit)
        line.withdraw(self.kept.wanted(line.name))

    def _tidy(self, line: SlotLine) -> None:
        """Forget a line with no request and no wait in Redis left."""
        if not line.asks and not line.waiters and self.lines.get(line.name) is line:
            del self.lines[line.name]


__all__ = ["SlotLine", "SlotLines"]
