"""The request front's slots: which request goes with which slot, from the scheduler or the
middleware's own wait until the request is done; the local hand-off of a finished request's slot;
the lines of requests waiting in the middleware per stage (:class:`~.lines.SlotLines`, as the keys'
and scopes' in ScopeThrottle); the slots kept for queued requests of StageScheduler; the sweep of
requests that left the downloader.

One :class:`RequestSlots` per crawler (``RequestSlots.of(crawler, settings)``), shared by
StageLockMiddleware and StageScheduler; it uses the crawler's
:class:`~scrapy_redislock.crawl.stagelocks.StageLocks` (the registry both fronts share: acquire,
release, renewal) downward. The bookkeeping of who holds what is the pure
:class:`~.ledger.PermitLedger`. API (all on the reactor thread)::

    slots = RequestSlots.of(crawler, settings)     # slots.locks: the crawler's StageLocks
    permit = await slots.wait(stage, timeout)      # StageLockMiddleware: a slot kept for a queued request (it is
                                                   # older), else one from this process's line for the stage
    slots.hand(request, permit_or_error)           # StageScheduler: the request leaves with this slot (or error)
    slots.take(request)            # StageLockMiddleware: what came with it (an error only once), or None (also
                                   # when its slot is no longer usable: dropped)
    slots.hold(request, permit)    # StageLockMiddleware: a slot it waited for itself
    slots.holding()                # the requests that hold a slot now (StageScheduler counts their keys)
    slots.finish(request)          # the request is done with its slot: passed on locally (see below) or released
    slots.serve_scheduler(queued=, could_use=)     # StageScheduler, once: what it has queued
    slots.kept                     # KeptSlots: slots kept for the stages' queued requests (count, take,
                                   # waited; release_all: StageScheduler's end)
    slots.lines.ask(stage)         # StageScheduler: waits in Redis for a stage's queued requests (their grants kept)
    slots.stand_down()             # StageScheduler closes, or the engine does: keep nothing
    await slots.close()            # forget who holds what, then close the locks (one aclose() per stage)

The permit hand-off: a slot goes with its request object (never in ``meta``, which retries and
redirects copy) from the scheduler (``hand``) or the middleware's own wait (``hold``) until
``finish``. The one sweep of requests that left the downloader without passing back through the
middleware (another middleware replaced or dropped them) runs at every renewal tick: a request
missing from ``downloader.active`` at two ticks in a row has its slot freed.

Local hand-off: when a request finishes and this process has a request of the same stage waiting
for a slot in the middleware (the oldest goes first: its wait in Redis's line stays, for the next
request, see :mod:`.lines`) or queued in StageScheduler, the slot passes to it at once, in the
same call, with no Redis command: the grant stays held, its lease goes on (renewed with the
others), and the fencing token stays the grant's (two requests of one process in a row may carry
the same fence; it still grows with every grant Redis makes). So that no other process starves, a
slot passes on this way only while it is younger than REDISLOCK_LOCAL_REUSE seconds (and half the
lease) since Redis granted it; after that the next finish releases it to Redis's
first-come-first-served line (where this process's own waiters queue too). A slot used locally is a
slot held: its lease is valid, so the cap holds even while Redis is unreachable (a held slot may
then still pass on within that bound; nothing new is granted). Counted as
``redislock/<stage>/reused``.

A slot found lost, or past the end of its lease (:meth:`StageLocks.usable
<scrapy_redislock.crawl.stagelocks.StageLocks.usable>`), never goes with a request: ``take``, the
local hand-off and the scheduler's hand-out drop it (released, in case Redis still holds it), and
its request waits for another slot. Counted as ``redislock/<stage>/unusable``.

Reads REDISLOCK_LOCAL_REUSE, REDISLOCK_TTL, REDISLOCK_WAITERS_PER_STAGE and REDISLOCK_WAIT_TIMEOUT
from the checked settings it is given. The clock (a
``Callable[[], float]``, ``time.monotonic`` by default) times the local reuse bound and a kept
slot's lease.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from scrapy_redislock.crawl.engine import (
    downloader_active,
    engine_closing,
    one_per_crawler,
)
from scrapy_redislock.crawl.stagelocks import SlotPermit, StageLocks, slot_id
from scrapy_redislock.requests.closewaits import CloseWaits
from scrapy_redislock.requests.kept import KeptSlots
from scrapy_redislock.requests.ledger import PermitLedger
from scrapy_redislock.requests.lines import SlotLines

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler

    from scrapy_redislock.crawl.settings import RedisLockSettings
    from scrapy_redislock.lock.core import Clock

logger = logging.getLogger("scrapy_redislock.crawl.stagelocks")


class RequestSlots:
    """The slots of one crawler's requests (see the module docstring)."""

    def __init__(
        self,
        crawler: Crawler,
        settings: RedisLockSettings,
        locks: StageLocks,
        *,
        clock: Clock = time.monotonic,
    ) -> None:
        self.crawler = crawler
        self.locks = locks
        self.clock = clock
        # request -> the slot it goes with (or its error)
        self.ledger: PermitLedger[Request, SlotPermit] = PermitLedger()
        # slots kept for the next queued request of their stage (a finished request's, or a grant
        # to a wait for the queued requests), or the error such a wait ran out with; with them,
        # REDISLOCK_WAITERS_PER_STAGE slots in hand or asked for per stage
        self.kept = KeptSlots(
            crawler,
            locks,
            could_use=self._could_use_now,
            most=settings.waiters_per_stage,
            keep_asking=False,
        )
        # per stage: the requests of this process waiting for its slots in the middleware, and
        # the waits in Redis for them and the queued ones
        self.lines = SlotLines(
            self.kept,
            reuse_for=settings.reuse_bound,
            ask_timeout=settings.wait_timeout,
        )
        # the requests waiting in the middleware, for a slot of a stage among others
        self.waits = CloseWaits.of(crawler, settings)
        self.stages = list(locks.locks)  # the capped stages
        # StageScheduler's (serve_scheduler): how many of a stage's requests it has queued, and how
        # many slots they could use now; None without it
        self._queued: Callable[[str], int] | None = None
        self._could_use: Callable[[str], int] | None = None
        self._standing_down = False  # the scheduler closes, or the engine does: keep nothing
        locks.add_waiting_source(self._waiting_for)
        locks.add_tick_hook(self.tick)

    @classmethod
    def of(
        cls, crawler: Crawler, settings: RedisLockSettings, *, clock: Clock = time.monotonic
    ) -> RequestSlots:
        """The crawler's one instance, over its StageLocks for the request stages (created on first
        use)."""
        return one_per_crawler(
            crawler,
            "_redislock_request_slots",
            lambda: cls(
                crawler, settings, StageLocks.of(crawler, settings, clock=clock), clock=clock
            ),
        )

    def serve_scheduler(
        self, *, queued: Callable[[str], int], could_use: Callable[[str], int]
    ) -> None:
        """StageScheduler, once: ``queued(stage)``, its requests of the stage (for the status CLI);
        ``could_use(stage)``, how many slots they could use now."""
        self._queued, self._could_use = queued, could_use

    def _waiting_for(self, stage: str) -> int:
        """Requests of this process waiting for a slot of ``stage``: in the middleware, and queued
        in the scheduler."""
        waiting = self.waits.waiting(self.locks, stage)
        return waiting + (0 if self._queued is None else self._queued(stage))

    # -- waiting in the middleware -----------------------------------------------------------------

    async def wait(self, stage: str, timeout: float | None) -> SlotPermit:
        """A slot for a request waiting in the middleware: one kept for a queued request (at once:
        this request left the scheduler before the slot was freed, it is older; a kept wait's error
        stays for the queued requests), else from this
        process's line for the stage (a slot freed here, or a grant to one of its waits in Redis);
        AcquireTimeout after ``timeout`` s (None: none), counted as ``<stage>/timeouts``."""
        kept = self.kept.take_slot(stage)
        if kept is not None:
            return kept
        return await self.lines.wait(stage, timeout)

    def _could_use_now(self, stage: str) -> int:
        """Slots in hand the queued requests of ``stage`` could use now: none while the scheduler
        stands down or the engine closes (a grant would go straight back)."""
        if self._could_use is None or self._standing_down or stage not in self.stages:
            return 0
        return 0 if engine_closing(self.crawler) else self._could_use(stage)

    # -- the hand-off: scheduler -> middleware -> next request -------------------------------------

    def hand(self, request: Request, outcome: SlotPermit | BaseException) -> None:
        """StageScheduler lets ``request`` go with this slot (or fails it with this error at the
        middleware). A slot the request still holds is freed first: it came back to the scheduler
        unseen by the middleware (one before it returned the request itself)."""
        self.finish(request)
        self.ledger.hand(request, outcome)

    def take(self, request: Request) -> SlotPermit | BaseException | None:
        """What ``request`` came with from the scheduler: its slot (held until :meth:`finish`), an
        error (given once), or None. A slot that is no longer usable is dropped and None returned:
        the request must wait for another rather than start without a valid lease. None once the
        locks closed (they freed every slot)."""
        if self.locks.closed:
            return None
        outcome = self.ledger.peek(request)
        if outcome is None:
            return None
        if isinstance(outcome, BaseException):
            self.ledger.forget(request)
        elif not self.locks.usable(outcome, self.clock()):
            self.ledger.forget(request)
            self.locks.release_soon(outcome)
            return None
        return outcome

    def hold(self, request: Request, permit: SlotPermit) -> None:
        """``request`` holds ``permit`` (it waited for it in the middleware) until :meth:`finish`."""
        self.ledger.hold(request, permit)

    def permit_of(self, request: Request) -> SlotPermit | None:
        """The slot ``request`` holds now, if any."""
        return self.ledger.permit_of(request)

    def holding(self) -> list[Request]:
        """The requests of this process that hold a slot now (handed out by the scheduler or waited
        for in the middleware, and not finished): StageScheduler counts their keys
        (REDISLOCK_STAGE_KEY) before a hand-out."""
        return self.ledger.holding()

    def finish(self, request: Request) -> None:
        """``request`` is done with its slot (download over, answered, dropped); nothing when it has
        none, or once the locks closed (they freed every slot)."""
        permit = self.ledger.finish(request)
        if permit is not None and not self.locks.closed:
            self.lines.free(permit)

    def sweep(self) -> None:
        """Free the slots of requests that left the downloader without finishing here (missing from
        ``downloader.active`` at two ticks in a row: the engine adds a request to it in the same
        call that takes it from the scheduler, so one tick would do; two cost nothing)."""
        for permit in self.ledger.sweep(downloader_active(self.crawler)):
            logger.debug(
                "Freeing slot %s, whose request left the downloader unseen", slot_id(permit)
            )
            self.lines.free(permit)

    async def tick(self) -> None:
        """At every renewal tick, before the renewals (a tick hook of the locks, after the adaptive
        limits' and before StageScheduler's): the sweep, then the lines' upkeep (kept slots no
        queued request can use go back; waits in Redis no longer wanted are withdrawn)."""
        self.sweep()
        self.lines.upkeep()

    # -- slots kept for StageScheduler's queued requests -------------------------------------------

    def stand_down(self, *, release: bool = True) -> None:
        """The scheduler closes, or the engine does: keep no slot from now on; the kept ones go back
        to Redis (``release``), or are left to :meth:`close` (which frees every slot at once)."""
        self._standing_down = True
        if release:
            self.kept.release_all()
        else:
            self.kept.clear()

    # -- close -------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Forget who holds what, then close the locks: every slot of this process is freed there,
        one call per lock."""
        self.ledger.clear()
        await self.locks.close()


__all__ = ["RequestSlots"]
