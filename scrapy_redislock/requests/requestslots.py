"""The request front's slots: which request goes with which slots (of its stage, key and scopes:
one record per request), from the scheduler or the middleware's own waits until the request is
done; the local hand-off of a finished request's slot;
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
    slots.hand(request, permit_or_error)           # StageScheduler: the request leaves with this slot (or error),
    slots.hand(request, [(lines, permit), ...])    # or with these (its stage's first, each with its line)
    slots.take(request)            # StageLockMiddleware: its stage's slot that came with it (an error only once),
                                   # or None (also when that slot is no longer usable: dropped with the others)
    slots.hold(request, permit[, lines])           # StageLockMiddleware, ScopeThrottle: a slot it waited for itself
    slots.held(request)            # [(lines, permit), ...]: what it holds, in the order taken
    slots.drop_scopes(request)     # ScopeThrottle: forget its key's and scopes' slots (returned), keep its stage's
    slots.free_scopes(request)     # ScopeThrottle: the same, each freed through its line
    slots.holding()                # the requests that hold a slot now (StageScheduler counts their keys)
    slots.finish(request)          # the request is done with its slots: each passed on locally (see below) or
                                   # released, its key's and scopes' before its stage's
    await slots.start()            # start the registries, then join the renewal loop (StageScheduler, spider_opened)
    await slots.tick()             # a renewal round: the sweep, the lines' upkeep, the scheduler's tick, then
                                   # the registries' renewals (the process's one renewal loop runs it)
    slots.serve_scheduler(queued=, could_use=, tick=)  # StageScheduler, once: what it has queued, its tick
    slots.serve_keys(locks, lines) # ScopeThrottle, once: the keys' registry and lines, run with the stages'
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

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scrapy import signals

from scrapy_redislock.crawl.engine import (
    downloader_active,
    engine_closing,
    one_per_crawler,
)
from scrapy_redislock.crawl.renewer import Renewer
from scrapy_redislock.crawl.stagelocks import SlotPermit, StageLocks, slot_id
from scrapy_redislock.requests.closewaits import CloseWaits
from scrapy_redislock.requests.kept import KeptSlots
from scrapy_redislock.requests.ledger import PermitLedger
from scrapy_redislock.requests.lines import SlotLines

# a slot a request holds, with the line it goes back through (its stage's, or its key's or scope's)
HeldSlot = tuple[SlotLines, SlotPermit]

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler

    from scrapy_redislock.crawl.settings import RedisLockSettings
    from scrapy_redislock.lock.core import Clock

logger = logging.getLogger("scrapy_redislock.crawl.stagelocks")


@dataclass
class Holds:
    """The slots one request holds, in the order taken (docs/scopes.md: its stage's, its key's,
    then its other scopes' by name), each with the line it goes back through."""

    slots: list[HeldSlot]
    # a light slot among them that the request did not take itself (passed on by a finished
    # request, or granted to its line's wait): a light take checks a pause for its own request
    # only, so the key's pause is checked again (ScopeThrottle._queued_key)
    recheck: bool = False


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
        # request -> the slots it goes with, of its stage, key and scopes (or its error): the one
        # record of what each request holds
        self.ledger: PermitLedger[Request, Holds] = PermitLedger()
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
        self._scheduler_tick: Callable[[], None] | None = None
        # StageScheduler's: the requests it holds with their slots (none without it)
        self._ready: Callable[[], Collection[Request]] = tuple
        self._standing_down = False  # the scheduler closes, or the engine does: keep nothing
        # the registries this front runs at each renewal round, each with its lines: the stages',
        # and the keys' and scopes' (ScopeThrottle's: serve_keys)
        self.registries: list[tuple[StageLocks, SlotLines]] = [(locks, self.lines)]
        self._renewer: Renewer | None = None  # the process's renewal loop, once joined
        crawler.signals.connect(self.start, signal=signals.spider_opened)

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
        self,
        *,
        queued: Callable[[str], int],
        could_use: Callable[[str], int],
        tick: Callable[[], None] | None = None,
        ready: Callable[[], Collection[Request]] = tuple,
    ) -> None:
        """StageScheduler, once: ``queued(stage)``, its requests of the stage (for the status CLI);
        ``could_use(stage)``, how many slots they could use now; ``tick()``, its part of this
        front's upkeep at every renewal round; ``ready()``, the requests it still holds with
        their slots, for the engine's next asks (not in the downloader yet: not swept)."""
        self._queued, self._could_use, self._scheduler_tick = queued, could_use, tick
        self._ready = ready

    def serve_keys(self, locks: StageLocks, lines: SlotLines) -> None:
        """ScopeThrottle, once: the keys' and scopes' registry and lines, run with the stages'."""
        self.registries.append((locks, lines))

    # -- the renewal rounds ------------------------------------------------------------------------

    async def start(self, spider: object = None) -> bool:
        """Start the registries (once, however many ask: StageScheduler's open, spider_opened),
        then join the process's renewal loop when one has anything to renew. False when Redis
        cannot be reached or refuses us (the registry logs which; spider_opened closes the
        spider)."""
        started = await asyncio.gather(*(locks.start_once() for locks, _ in self.registries))
        registries = [locks for locks, _ in self.registries]
        if (
            all(started)
            and any(locks.renews for locks in registries)
            and not any(locks.closed for locks in registries)
            and self._renewer is None
        ):
            self._renewer = Renewer.current()
            self._renewer.join(self)
        return all(started)

    @property
    def renew_interval(self) -> float:
        return min(locks.renew_interval for locks, _ in self.registries)

    async def tick(self) -> None:
        """One renewal round (the process's renewal loop runs it): this front's upkeep, then its
        registries' ticks at once (renewals, retried releases, adaptive limits).

        The upkeep: the sweep; each line's (kept slots no queued request can use go back; waits in
        Redis no longer wanted are withdrawn); StageScheduler's tick. Each registry is then given
        this front's requests waiting for its names (:meth:`demand`), which its renewals report as
        waiting here. Once every registry closed, this front leaves the loop."""
        live = [(locks, lines) for locks, lines in self.registries if not locks.closed]
        if not live:
            self._leave_renewal()
            return
        steps = [self.sweep, *(lines.upkeep for _, lines in live)]
        if self._scheduler_tick is not None:
            steps.append(self._scheduler_tick)
        for step in steps:
            try:  # each on its own: one that fails skips none of the others
                step()
            except Exception:
                logger.exception("The request front's upkeep failed in %r", step)
        await asyncio.gather(*(locks.tick(self.demand(locks, lines)) for locks, lines in live))

    def demand(self, locks: StageLocks, lines: SlotLines) -> dict[str, int]:
        """The requests of this process waiting for a slot of each of ``locks``' names now: in the
        middleware (``lines``), and for the stages, queued in StageScheduler. The front counts it;
        the registry only reports it."""
        demand = Counter({name: lines.waiting(name) for name in lines.lines})
        if locks is self.locks and self._queued is not None:
            try:
                demand.update({stage: self._queued(stage) for stage in self.stages})
            except Exception:
                logger.exception("Counting the requests StageScheduler has queued failed")
        return {name: count for name, count in demand.items() if count}

    async def close_unclean(self) -> None:
        """The loop is torn down with this front still in it (a forced shutdown): its registries
        free their slots."""
        await asyncio.gather(*(locks.close_unclean() for locks, _ in self.registries))

    def _leave_renewal(self) -> None:
        if self._renewer is not None:
            self._renewer.leave(self)
            self._renewer = None

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

    def hand(
        self,
        request: Request,
        outcome: SlotPermit | list[HeldSlot] | BaseException,
        *,
        recheck: bool = False,
    ) -> None:
        """StageScheduler lets ``request`` go with a slot of its stage, or with its slots (each with
        its line, in the one order: its stage's first, then its key's and scopes'), or fails it with
        this error at the middleware. ``recheck``: a light slot among them was passed on to it
        (:attr:`Holds.recheck`). Slots the request still holds are freed first: it came back to the
        scheduler unseen by the middleware (one before it returned the request itself)."""
        self.finish(request)
        if isinstance(outcome, BaseException):
            self.ledger.hand(request, outcome)
        else:
            held = [(self.lines, outcome)] if not isinstance(outcome, list) else outcome
            self.ledger.hand(request, Holds(held, recheck))

    def take(self, request: Request) -> SlotPermit | BaseException | None:
        """What ``request`` came with from the scheduler: its stage's slot (held until
        :meth:`finish`), an error (given once), or None (its key's and scopes' slots, if any, stay
        in :meth:`held`). A stage's slot that is no longer usable is dropped with the slots taken
        after it, and None returned: the request waits for its stage's slot again rather than start
        without a valid lease, holding none of its key's meanwhile (the one order). None once the
        locks closed (they freed every slot)."""
        if self.locks.closed:
            return None
        outcome = self.ledger.peek(request)
        if isinstance(outcome, BaseException):
            self.ledger.forget(request)
            return outcome
        if outcome is None or not outcome.slots or outcome.slots[0][0] is not self.lines:
            return None
        permit = outcome.slots[0][1]
        if not self.locks.usable(permit, self.clock()):
            self.ledger.forget(request)
            self._free(reversed(outcome.slots[1:]))  # before the stage's, as finish() frees them
            self.locks.release_soon(permit)
            return None
        return permit

    def hold(
        self,
        request: Request,
        permit: SlotPermit,
        lines: SlotLines | None = None,
        *,
        recheck: bool = False,
    ) -> None:
        """``request`` holds ``permit`` too (it waited for it in the middleware) until
        :meth:`finish`: a slot of its stage (it then holds no other: the middleware's
        ``_wait_here``), or of its key or a scope (``lines``: their line, the throttle's).
        ``recheck``: see :attr:`Holds.recheck`."""
        slot = (self.lines if lines is None else lines, permit)
        holds = self.ledger.permit_of(request)
        if holds is None:
            self.ledger.hold(request, Holds([slot], recheck))
        else:
            holds.slots.append(slot)
            holds.recheck = holds.recheck or recheck

    def holds(self, request: Request) -> Holds | None:
        """The slots ``request`` holds now, if any."""
        return self.ledger.permit_of(request)

    def held(self, request: Request) -> list[HeldSlot]:
        """The slots ``request`` holds now, each with its line, in the order taken."""
        holds = self.ledger.permit_of(request)
        return [] if holds is None else holds.slots

    def permit_of(self, request: Request) -> SlotPermit | None:
        """The slot of its stage ``request`` holds now, if any."""
        held = self.held(request)
        return held[0][1] if held and held[0][0] is self.lines else None

    def holding(self) -> list[Request]:
        """The requests of this process that hold a slot now (handed out by the scheduler or waited
        for in the middleware, and not finished): StageScheduler counts their keys
        (REDISLOCK_STAGE_KEY) before a hand-out."""
        return self.ledger.holding()

    def drop_scopes(self, request: Request) -> list[HeldSlot]:
        """Forget the slots ``request`` holds of its key and scopes (its stage's stays): the caller
        frees them, or releases them."""
        holds = self.ledger.permit_of(request)
        if holds is None:
            return []
        dropped = [slot for slot in holds.slots if slot[0] is not self.lines]
        holds.slots[:] = [slot for slot in holds.slots if slot[0] is self.lines]
        holds.recheck = False
        if not holds.slots:
            self.ledger.forget(request)
        return dropped

    def free_scopes(self, request: Request) -> None:
        """Free the slots ``request`` holds of its key and scopes (its stage's stays), each on
        through its line."""
        self._free(reversed(self.drop_scopes(request)))

    def finish(self, request: Request) -> None:
        """``request`` is done with its slots (download over, answered, dropped): its key's and
        scopes' go first, then its stage's, each on through its line (:meth:`SlotLines.free
        <scrapy_redislock.requests.lines.SlotLines.free>`); nothing when it has none."""
        holds = self.ledger.finish(request)
        if holds is not None:
            self._free(reversed(holds.slots))

    @staticmethod
    def _free(slots: Iterable[HeldSlot]) -> None:
        """Each slot on through its line (none once its locks closed: they freed every slot)."""
        for lines, permit in slots:
            if not lines.locks.closed:
                lines.free(permit)

    def sweep(self) -> None:
        """Free the slots of requests that left the downloader without finishing here (missing from
        ``downloader.active`` at two ticks in a row: the engine adds a request to it in the same
        call that takes it from the scheduler, so one tick would do; two cost nothing). Requests
        StageScheduler still holds with their slots (``ready``) are not swept: the engine may back
        off for longer than two ticks before it asks for them."""
        active = downloader_active(self.crawler)
        ready = self._ready()
        if active is not None and ready:  # handed out, but the engine has not asked for them yet
            active = {*active, *ready}
        for holds in self.ledger.sweep(active):
            for _, permit in holds.slots:
                logger.debug(
                    "Freeing slot %s, whose request left the downloader unseen", slot_id(permit)
                )
            self._free(reversed(holds.slots))

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
        one call per lock. The renewal rounds end with the last registry (the keys' closes with
        ScopeThrottle)."""
        self.ledger.clear()
        await self.locks.close()
        if all(locks.closed for locks, _ in self.registries):
            self._leave_renewal()


__all__ = ["HeldSlot", "Holds", "RequestSlots"]
