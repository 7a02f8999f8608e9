"""Which request goes with which slot, from the scheduler or the middleware's own wait until the
request is done; the local hand-off of a finished request's slot (to a request of this process
waiting in the middleware first, in its stage's :class:`~scrapy_redislock.crawl.stageline.StageLine`,
then to one queued in StageScheduler); releases, retried until Redis takes them.

Part of :class:`~scrapy_redislock.crawl.stagelocks.StageLocks` (its ``slots``); see that module's
docstring for the hand-off's rules. The bookkeeping itself is the pure
:class:`~scrapy_redislock.crawl.ledger.PermitLedger`; this adds what needs the locks: releasing,
counting, logging. Reads no settings itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from scrapy_redislock._loop import start_now
from scrapy_redislock.crawl.engine import downloader_active
from scrapy_redislock.crawl.ledger import PermitLedger
from scrapy_redislock.crawl.reach import REDIS_ERRORS
from scrapy_redislock.crawl.stageline import StageLine
from scrapy_redislock.lock.interface import AsyncLock
from scrapy_redislock.lock.permit import Permit
from scrapy_redislock.lock.quorum import QuorumPermit

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler

    from scrapy_redislock.crawl.settings import RedisLockSettings

logger = logging.getLogger("scrapy_redislock.crawl.stagelocks")

# What a slot is: a Permit, or a QuorumPermit on a quorum.
SlotPermit = Permit | QuorumPermit


class Locks(Protocol):
    """What the slots need of their StageLocks."""

    crawler: Crawler
    settings: RedisLockSettings
    stats_prefix: str
    closed: bool

    @property
    def stats(self) -> Any: ...

    def lock_of(self, permit: SlotPermit) -> AsyncLock[Any] | None: ...

    def stage_of(self, permit: SlotPermit) -> str | None: ...

    def released(self, permit: SlotPermit) -> None: ...

    async def acquire(self, stage: str, timeout: float | None) -> SlotPermit: ...


# the meta key that keeps a request's own download timeout while a slot's lease bounds it
OWN_TIMEOUT = "redislock_download_timeout"


def within_lease(request: Request, left: float, default: float) -> bool:
    """Bound ``request``'s download to ``left`` seconds (what is left of its slot's lease as last
    confirmed, less a margin): Scrapy aborts it then (``download_timeout``: TimeoutError, retried
    like any). The request's own timeout (``download_timeout`` in meta, else ``default``, Scrapy's
    DOWNLOAD_TIMEOUT) is kept in ``meta["redislock_download_timeout"]``, so that a retry, which
    copies meta, starts from it again. True when the lease is the shorter."""
    meta = request.meta
    own = float(meta.setdefault(OWN_TIMEOUT, meta.get("download_timeout", default)))
    # never 0: Scrapy reads a 0 timeout as none
    meta["download_timeout"] = max(0.001, min(own, left))
    return left < own


def slot_id(permit: SlotPermit) -> str:
    """How the log names a slot: its grant id (a quorum permit: its token, a grant per master)."""
    return permit.grant if isinstance(permit, Permit) else permit.token


class RequestSlots:
    """The slots of one :class:`~scrapy_redislock.crawl.stagelocks.StageLocks` that go with
    requests."""

    def __init__(self, locks: Locks) -> None:
        self.locks = locks
        settings = locks.settings
        # request -> the slot it goes with (or its error)
        self.ledger: PermitLedger[Request, SlotPermit] = PermitLedger(
            min(settings.local_reuse, settings.ttl / 2)
        )
        self._takers: list[Callable[[str, SlotPermit], bool]] = []
        self._lenders: list[Callable[[str], SlotPermit | None]] = []
        self._hold_hooks: list[Callable[[Request], None]] = []
        self.releasing: set[asyncio.Task[None]] = set()
        # releases Redis did not take (outage); retried every tick
        self._unreleased: list[SlotPermit] = []
        # stage -> the requests of this process waiting for its slots in the middleware
        self.lines: dict[str, StageLine] = {}

    def add_taker(self, taker: Callable[[str, SlotPermit], bool]) -> None:
        """Register ``taker(stage, permit) -> bool``: True when it keeps a freed slot for a queued
        request."""
        self._takers.append(taker)

    def add_lender(self, lender: Callable[[str], SlotPermit | None]) -> None:
        """Register ``lender(stage) -> permit or None``: a slot it keeps for a queued request, which
        a request of the stage that arrives to wait in the middleware takes instead (it left the
        scheduler before the slot was freed: it is older)."""
        self._lenders.append(lender)

    def add_hold_hook(self, hook: Callable[[Request], None]) -> None:
        """Register ``hook(request)``, called when a request that waited in the middleware got its
        slot."""
        self._hold_hooks.append(hook)

    def count(self, stage: str, what: str) -> None:
        self.locks.stats.inc_value(f"{self.locks.stats_prefix}/{stage}/{what}")

    # -- waiting in the middleware -----------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.locks.closed

    async def acquire(self, stage: str, timeout: float | None) -> SlotPermit:
        """One wait in Redis's line (for a :class:`StageLine`)."""
        return await self.locks.acquire(stage, timeout)

    async def wait(self, stage: str, timeout: float | None) -> SlotPermit:
        """A slot for a request waiting in the middleware: one a lender keeps (at once), else from
        this process's line for the stage (a slot freed here, or a grant to one of its waits in
        Redis); AcquireTimeout after ``timeout`` s."""
        for lender in self._lenders:
            permit = lender(stage)
            if permit is not None:
                return permit
        line = self.lines.get(stage)
        if line is None:
            line = self.lines[stage] = StageLine(self, stage)
        return await line.wait(timeout)

    def place(self, permit: SlotPermit) -> None:
        """A slot granted with no request waiting for it here: to a taker (a queued request of its
        stage) if one wants it, else back to Redis. Not counted as reused: Redis granted it just
        now."""
        if not self._pass_on(permit, local=False):
            self.release_soon(permit)

    # -- release -----------------------------------------------------------------------------------

    async def release(self, permit: SlotPermit) -> None:
        """Give a slot back; a Redis error leaves it for the next tick to retry (it stays renewed
        until then)."""
        lock = self.locks.lock_of(permit)
        if lock is None or permit.lost:
            return
        try:
            await lock.release(permit)
        except REDIS_ERRORS as exc:
            if self.locks.closed:
                return  # close() frees every grant of this process in one call anyway
            logger.warning(
                "Could not release a slot of %r (%s); retrying at the next renewal",
                permit.name,
                exc,
            )
            self._unreleased.append(permit)
        else:
            self.locks.released(permit)

    def release_soon(self, permit: SlotPermit) -> None:
        """release() in a task kept until done (so plain callbacks can release without awaiting);
        the command is sent in this call where asyncio allows it (see
        :func:`~scrapy_redislock._loop.start_now`)."""
        task = start_now(self.release(permit))
        self.releasing.add(task)
        task.add_done_callback(self.releasing.discard)

    async def retry_releases(self) -> None:
        """Send again the releases Redis did not take; raises the first Redis error (the tick backs
        off)."""
        pending, self._unreleased = self._unreleased, []
        for index, permit in enumerate(pending):
            lock = self.locks.lock_of(permit)
            if lock is None or permit.lost:
                continue
            try:
                await lock.release(permit)
            except REDIS_ERRORS:
                self._unreleased.extend(pending[index:])
                raise

    # -- the hand-off: scheduler -> middleware -> next request -------------------------------------

    def hand(self, request: Request, outcome: SlotPermit | BaseException) -> None:
        """StageScheduler lets ``request`` go with this slot (or fails it with this error at the
        middleware)."""
        self.ledger.hand(request, outcome)

    def take(self, request: Request) -> SlotPermit | BaseException | None:
        """What ``request`` came with from the scheduler: its slot (held until :meth:`finish`), an
        error (given once), or None. A slot that is no longer usable is dropped and None returned:
        the request must wait for another rather than start without a valid lease."""
        outcome = self.ledger.peek(request)
        if outcome is None:
            return None
        if isinstance(outcome, BaseException):
            self.ledger.forget(request)
        elif not self.usable(outcome):
            self.ledger.forget(request)
            self.release_soon(outcome)
            return None
        return outcome

    def hold(self, request: Request, permit: SlotPermit) -> None:
        """``request`` holds ``permit`` (it waited for it in the middleware) until
        :meth:`finish`."""
        self.ledger.hold(request, permit)
        for hook in self._hold_hooks:
            hook(request)

    def permit_of(self, request: Request) -> SlotPermit | None:
        """The slot ``request`` holds now, if any."""
        return self.ledger.permit_of(request)

    def has_slot(self, request: Request) -> bool:
        """Whether ``request`` holds a slot now (handed one by the scheduler, or got one in the
        middleware)."""
        return self.ledger.has_slot(request)

    def holding(self) -> list[Request]:
        """The requests of this process that hold a slot now (handed out by the scheduler or waited
        for in the middleware, and not finished): StageScheduler counts their keys
        (REDISLOCK_STAGE_KEY) before a hand-out."""
        return self.ledger.holding()

    def finish(self, request: Request) -> None:
        """``request`` is done with its slot (download over, answered, dropped); nothing when it has
        none."""
        permit = self.ledger.finish(request)
        if permit is not None:
            self.free(permit)

    def free(self, permit: SlotPermit) -> None:
        """Pass a slot on to a parked request of this process (see the module docstring), else
        release it now."""
        if not self._pass_on(permit):
            self.release_soon(permit)

    def usable(self, permit: SlotPermit) -> bool:
        """Whether ``permit`` may go with a request now: held under a valid lease as far as this
        process knows (``permit.usable`` on the lock's clock, monotonic). When not, it is counted
        and logged; the caller drops it.

        A local check: a slot waiting for a request (StageScheduler's ready queue, a finished
        request's slot) may have been lost, or its lease may have run out while Redis was out of
        reach, and another process may hold it by now."""
        now = time.monotonic()
        if permit.usable(now):
            return True
        stage = self.locks.stage_of(permit) or permit.name
        self.count(stage, "unusable")
        if permit.lost or permit.released:
            logger.info("Slot %s of %r was lost: no request starts with it", slot_id(permit), stage)
        else:
            logger.warning(
                "Slot %s of %r: its lease ran out %.1f s ago unrenewed (Redis out of reach, or a stall); no request starts with it",  # noqa: E501
                slot_id(permit),
                stage,
                now - permit.valid_until,
            )
        return False

    def _pass_on(self, permit: SlotPermit, local: bool = True) -> bool:
        """Give a freed slot (``local``) or a fresh grant to a request of this process: first to
        the oldest waiting in the middleware (in Redis's line too: its wait there stays for the
        next request), then to a taker (StageScheduler's queued requests)."""
        stage = self.locks.stage_of(permit)
        line = self.lines.get(stage or "")
        if stage is None or self.locks.closed or (not self._takers and not line):
            return False
        if not self.ledger.young(permit, time.monotonic()):
            # back to Redis's line, where other processes may wait (and never near the lease's end)
            return False
        if not self.usable(permit):
            return False
        if line is not None and line.offer(permit):
            if local:
                self.count(stage, "reused")
            return True
        for taker in self._takers:
            if taker(stage, permit):
                if local:
                    self.count(stage, "reused")
                return True
        return False

    def sweep(self) -> None:
        """Free the slots of requests that left the downloader without finishing here (missing from
        ``downloader.active`` at two ticks in a row: the engine adds a request to it in the same
        call that takes it from the scheduler, so one tick would do; two cost nothing)."""
        for permit in self.ledger.sweep(downloader_active(self.locks.crawler)):
            logger.debug(
                "Freeing slot %s, whose request left the downloader unseen", slot_id(permit)
            )
            self.free(permit)
