"""One process's line for the slots of one capped stage: its requests waiting for a slot in the
downloader (StageLockMiddleware), first come first served, and the waits in Redis's line that serve
them.

A waiting request gets whichever slot comes first: one freed by a finished request of this process
(the local hand-off, :meth:`RequestSlots.free
<scrapy_redislock.crawl.requestslots.RequestSlots.free>`, within REDISLOCK_LOCAL_REUSE of Redis's
grant: no Redis round trip) or a grant to one of this process's waits in Redis. The waits in Redis
belong to the line, not to a request: one is opened when more requests wait here than the line has
waits in Redis, and when a request is served locally its wait stays in Redis's line for the next
request (so the process keeps its place in the first-come-first-served line across processes, and
no command is spent withdrawing it). A grant that comes when no request waits here goes on like a
finished request's slot (to a request of the stage queued in StageScheduler, else back to Redis). A
request that gives up (REDISLOCK_WAIT_TIMEOUT, the spider closing) withdraws one wait when the line
has more waits than requests.

Reads no settings itself: the wait's timeout is the caller's.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Protocol

from scrapy_redislock.errors import AcquireTimeout

if TYPE_CHECKING:
    from scrapy_redislock.crawl.requestslots import SlotPermit

logger = logging.getLogger("scrapy_redislock.crawl.stagelocks")


class Owner(Protocol):
    """What a line needs of its StageLocks and their request slots."""

    @property
    def closed(self) -> bool: ...

    async def acquire(self, stage: str, timeout: float | None) -> SlotPermit: ...

    def place(self, permit: SlotPermit) -> None: ...

    def count(self, stage: str, what: str) -> None: ...


class StageLine:
    """The requests of this process waiting for a slot of ``stage``, and its waits in Redis for
    them."""

    def __init__(self, owner: Owner, stage: str) -> None:
        self.owner = owner
        self.stage = stage
        # requests waiting here, oldest first: each is served once, with a slot or an error
        self.waiters: deque[asyncio.Future[SlotPermit]] = deque()
        # this process's waits in Redis's line for them
        self.asks: set[asyncio.Future[SlotPermit]] = set()

    def __len__(self) -> int:
        """Requests waiting here now."""
        return sum(1 for served in self.waiters if not served.done())

    async def wait(self, timeout: float | None) -> SlotPermit:
        """A slot for one request, first come first served in this process; AcquireTimeout after
        ``timeout`` s (None: none), counted as ``<stage>/timeouts``."""
        loop = asyncio.get_running_loop()
        served: asyncio.Future[SlotPermit] = loop.create_future()
        self.waiters.append(served)
        timer = None if timeout is None else loop.call_later(timeout, self._expire, served, timeout)
        self._ask()
        given = False
        try:
            permit = await served
            given = True
            return permit
        finally:
            if timer is not None:
                timer.cancel()
            if not given:
                self._gave_up(served)

    def offer(self, permit: SlotPermit) -> bool:
        """Give ``permit`` to the oldest request waiting here; False when none waits."""
        while self.waiters:
            served = self.waiters.popleft()
            if not served.done():
                served.set_result(permit)
                return True
        return False

    def _ask(self) -> None:
        """One wait in Redis per request waiting here."""
        while len(self.asks) < len(self) and not self.owner.closed:
            ask = asyncio.ensure_future(self.owner.acquire(self.stage, None))
            self.asks.add(ask)
            ask.add_done_callback(self._answered)

    def _answered(self, ask: asyncio.Future[SlotPermit]) -> None:
        """A wait in Redis ended: its slot goes to the oldest request waiting here, else on."""
        self.asks.discard(ask)
        if ask.cancelled():
            if self.owner.closed:
                self.cancel()
            else:
                self._ask()  # withdrawn as surplus (nothing to do), or cancelled by someone else
            return
        error = ask.exception()
        if error is not None:
            # what the request's own wait would have raised (a Redis error is retried inside)
            for served in self.waiters:
                if not served.done():
                    served.set_exception(error)
                    break
            self._ask()
            return
        permit = ask.result()
        if not self.offer(permit):
            self.owner.place(permit)

    def _expire(self, served: asyncio.Future[SlotPermit], timeout: float) -> None:
        if served.done():
            return
        self.owner.count(self.stage, "timeouts")
        served.set_exception(AcquireTimeout(f"stage {self.stage!r}: no slot within {timeout} s"))

    def _gave_up(self, served: asyncio.Future[SlotPermit]) -> None:
        """A request stopped waiting without taking a slot (timeout, cancel): a slot it was handed
        meanwhile goes on; a wait in Redis beyond the requests left is withdrawn."""
        if served in self.waiters:
            self.waiters.remove(served)
        if not served.done():
            served.cancel()
        elif not served.cancelled() and served.exception() is None:
            permit = served.result()  # handed to it just as it was cancelled
            if not self.offer(permit):
                self.owner.place(permit)
        surplus = len(self.asks) - len(self)
        for ask in list(self.asks)[: max(0, surplus)]:
            ask.cancel()

    def cancel(self) -> None:
        """The locks closed: every request waiting here stops waiting (cancelled)."""
        while self.waiters:
            served = self.waiters.popleft()
            if not served.done():
                served.cancel()
