"""One process's line for the slots of one capped stage: its requests waiting for a slot in the
downloader (StageLockMiddleware), first come first served, and the waits in Redis's line that serve
them.

A waiting request gets whichever slot comes first: one freed by a finished request of this process
(the local hand-off, :meth:`RequestSlots.free
<scrapy_redislock.requests.requestslots.RequestSlots.free>`, within REDISLOCK_LOCAL_REUSE of Redis's
grant: no Redis round trip) or a grant to one of this process's waits in Redis. The waits in Redis
belong to the line, not to a request: one is opened when more requests wait here than the line has
waits in Redis, and when a request is served locally its wait stays in Redis's line for the next
request (so the process keeps its place in the first-come-first-served line across processes, and
no command is spent withdrawing it). A grant that comes when no request waits here goes on like a
finished request's slot (to a request of the stage queued in StageScheduler, else back to Redis). A
request that gives up (REDISLOCK_WAIT_TIMEOUT, the spider closing) withdraws one wait when the line
has more waits than requests.

The line is the state; :class:`~scrapy_redislock.requests.requestslots.RequestSlots`, its owner,
opens and answers the waits in Redis. Reads no settings itself: the wait's timeout is the caller's.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

from scrapy_redislock.errors import AcquireTimeout

if TYPE_CHECKING:
    from scrapy_redislock.crawl.stagelocks import SlotPermit


class StageLine:
    """The requests of this process waiting for a slot of ``stage``, and its waits in Redis for
    them."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        # requests waiting here, oldest first: each is served once, with a slot or an error
        self.waiters: deque[asyncio.Future[SlotPermit]] = deque()
        # this process's waits in Redis's line for them
        self.asks: set[asyncio.Future[SlotPermit]] = set()

    def __len__(self) -> int:
        """Requests waiting here now."""
        return sum(1 for served in self.waiters if not served.done())

    def join(self) -> asyncio.Future[SlotPermit]:
        """One more request waits here: the future it is served with (a slot or an error)."""
        served: asyncio.Future[SlotPermit] = asyncio.get_running_loop().create_future()
        self.waiters.append(served)
        return served

    def short(self) -> int:
        """How many more waits in Redis the requests waiting here need (one each)."""
        return len(self) - len(self.asks)

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
        served.set_exception(AcquireTimeout(f"stage {self.stage!r}: no slot within {timeout} s"))
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

    def surplus(self) -> list[asyncio.Future[SlotPermit]]:
        """The waits in Redis beyond the requests waiting here (to withdraw)."""
        return list(self.asks)[: max(0, len(self.asks) - len(self))]

    def cancel(self) -> None:
        """The locks closed: every request waiting here stops waiting (cancelled)."""
        while self.waiters:
            served = self.waiters.popleft()
            if not served.done():
                served.cancel()
