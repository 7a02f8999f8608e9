"""KeyLine: StageScheduler gets a request's key and scope slots before the request leaves it, so
that a key or scope at its cap waits in the scheduler, not in the downloader.

For requests whose key or other scopes are capped (REDISLOCK_STAGE_KEY with REDISLOCK_KEY_LIMIT or
REDISLOCK_KEY_LIMITS; REDISLOCK_SCOPES entries with a ``limit``), over Scrapy's scheduler. A
request's capped names are its key, then its other scopes by name, after its stage (the order slots
are taken in everywhere: docs/scopes.md).

**Requests of no capped stage** (a broad crawl: domains, proxies, no stages):

- A request none of whose names is blocked here (no wait for it in progress, fewer than the
  name's limit of this process's requests holding or taking it) leaves the inner scheduler and is
  held back for one look in Redis per name it has no kept slot of (a take: lock/light.py). All
  granted, it goes on with its slots
  (:meth:`RequestSlots.hand <scrapy_redislock.requests.requestslots.RequestSlots.hand>`), and the
  engine is woken.
- One refused (every slot of it is held, here or elsewhere, or others queue for it), the slots
  it got go back (a kept one is kept again, a fresh one returns to Redis: a request holds no slot
  while it waits), the request goes back into the inner scheduler, into a sub-queue of the refused
  name (on disk with JOBDIR), and one wait for a slot of that name starts here (first come, first
  served in Redis): the name's wanted wait in this process's line for it, the line requests waiting
  in the middleware use too (:meth:`SlotLines.ask <scrapy_redislock.requests.lines.SlotLines.ask>`,
  as a stage's). Those requests stay queued and take none of CONCURRENT_REQUESTS, while other
  names' requests go past them. A slot the wait gets is kept for the name's next request, which the
  sub-queue then lets go (the line's :class:`~scrapy_redislock.requests.kept.KeptSlots`, as a
  stage's); the wait is opened again while the name has more requests queued than slots kept.
  So is a slot of the name that a finished request of this process frees while its queued requests
  outnumber the slots kept (the local hand-off, within REDISLOCK_LOCAL_REUSE of Redis's grant, as a
  stage's: :meth:`SlotLines.pass_on <scrapy_redislock.requests.lines.SlotLines.pass_on>`).
- A name whose starts a site's Retry-After paused (the take says so: lock/delay.py's pause_starts)
  keeps its requests queued until the pause ends, then takes again.
- A slot kept for a name whose requests are gone, or that is no longer usable, goes back to Redis
  at the next renewal tick; a wait that runs out of REDISLOCK_WAIT_TIMEOUT fails the name's next
  request with AcquireTimeout, as a wait in the middleware would (forgotten at the next renewal
  tick if no request of the name is queued any more).

**Requests of a capped stage** that leave with a slot of their stage in hand (one kept for it: a
finished request's, passed on), while their key has room in this process: one look in Redis per
name, as above; a name refused, the request waits here for it, in this process's line for the name
(:meth:`SlotLines.wait <scrapy_redislock.requests.lines.SlotLines.wait>`, served first, and by a
slot a finished request frees), with its stage's slot (a slot of a name is never held waiting for a
stage's: that order could deadlock with the requests that wait for their key in the middleware
holding their stage's), but with none of CONCURRENT_REQUESTS. A wait that runs out fails the request
with AcquireTimeout; a pause (a Retry-After) sends the request back to its sub-queue, its stage's
slot back to Redis.

Looks in Redis under way are bounded by the downloader's free room (CONCURRENT_REQUESTS less what it
has and what is ready, and the looks not waiting); the waits for queued requests by
CONCURRENT_REQUESTS (each blocks one connection: the line's bound, ScopeThrottle's; a request
waiting with its stage's slot is bounded by that slot). Requests over scrapy-redis's scheduler,
whose queue is shared in Redis and not split by key, take their key and scope slots in the
middleware, after their stage's.

Reads CONCURRENT_REQUESTS and, through the checked settings, REDISLOCK_WAIT_TIMEOUT and the key and
scope settings.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Coroutine
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

from scrapy_redislock.crawl.engine import downloader_active, wake_engine
from scrapy_redislock.crawl.reach import REDIS_ERRORS
from scrapy_redislock.errors import AcquireTimeout, Paused
from scrapy_redislock.requests.kept import KeptSlots
from scrapy_redislock.requests.stagequeue import push_back, split_queues

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler

    from scrapy_redislock.crawl.settings import RedisLockSettings
    from scrapy_redislock.crawl.stagelocks import SlotPermit
    from scrapy_redislock.requests.requestslots import HeldSlot, RequestSlots
    from scrapy_redislock.requests.stagequeue import Route
    from scrapy_redislock.requests.throttle import ScopeThrottle

logger = logging.getLogger(__name__)

# Seconds a name's requests of a capped stage stay queued after Redis failed a take of it.
REDIS_RETRY = 1.0


@dataclass(frozen=True)
class Taken:
    """A slot got for a request still here: of which name, whether it was a kept one, and whether
    a wait in the name's line got it (a finished request's light slot may come that way)."""

    name: str
    permit: SlotPermit
    kept: bool
    from_line: bool = False


@dataclass(frozen=True)
class InHand:
    """A request of a capped stage leaving with a slot of it: the stage, the slot, and the
    request's sub-queue (to go back to)."""

    stage: str
    permit: SlotPermit
    route: Route
    waited: float = 0.0  # seconds its stage's queued requests waited for that slot


class KeyLine:
    """The key and scope slots StageScheduler gets before letting requests go (see the module
    docstring)."""

    def __init__(
        self,
        crawler: Crawler,
        settings: RedisLockSettings,
        throttle: ScopeThrottle,
        inner: Any,
        slots: RequestSlots,
    ) -> None:
        self.crawler = crawler
        self.settings = settings
        self.throttle = throttle
        self.slots = slots  # the records of what each request holds: it goes with its slots
        # monotonic seconds: the throttle's, whose records this line adds to
        self.clock = throttle.clock
        self.locks = throttle.locks  # the KeyLocks
        self.inner = inner  # Scrapy's scheduler, its queues split by StagePriorityQueues
        self.room = crawler.settings.getint("CONCURRENT_REQUESTS")
        self.looking: dict[Request, tuple[str, ...]] = {}  # held back for takes in Redis
        # of those, requests of a capped stage with their stage's slot in hand; and those of them
        # waiting in a name's line
        self.in_hand: dict[Request, InHand] = {}
        self.waiting: dict[Request, tuple[str, asyncio.Task[Any]]] = {}  # -> (name, its look)
        self.ready: deque[Request] = deque()  # got their slot meanwhile: the engine's next
        # per name: slots (or a wait's error) for its next requests, in the throttle's line
        self.kept: KeptSlots = throttle.lines.kept
        # keys whose starts a Retry-After paused: until the timer ends it
        self.paused: dict[str, asyncio.TimerHandle] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.closed = False
        self._load: Counter[str] | None = None
        throttle.serve_scheduler(self.could_use)
        throttle.lines.on_pause = self._paused

    def could_use(self, key: str) -> int:
        """Slots the queued requests of ``key`` could use now (the throttle's line keeps that many,
        and waits for them): none while the key is paused or the scheduler closed."""
        return 0 if self.closed or key in self.paused else self.queued(key)

    def _asking(self, key: str) -> bool:
        """A wait for the key's queued requests is under way here (one in its line beyond those of
        the requests waiting there)."""
        lines = self.throttle.lines
        return lines.asking(key) > lines.waiting(key)

    # -- the keys' sub-queues in the inner scheduler ------------------------------------------------

    def queued(self, key: str) -> int:
        """Requests of ``key`` in its sub-queue of the inner scheduler."""
        return sum(queue.count_route((None, key)) for queue in split_queues(self.inner))

    def requeue(self, request: Request, key: str) -> None:
        """Put ``request`` back into its key's sub-queue of the inner scheduler (its own, for a
        request of a capped stage; on disk with JOBDIR, as Scrapy's scheduler would; in memory if it
        cannot be serialized); no dupefilter: it was queued once already (counted as queued again,
        as its next pop counts: :func:`push_back`); queued, it waits for no start of its delayed
        names any more (StartWaits)."""
        if self.throttle.start_waits is not None:
            self.throttle.start_waits.went_out(request)
        in_hand = self.in_hand.pop(request, None)
        push_back(self.inner, request, (None, key) if in_hand is None else in_hand.route)

    # -- what the throttle and the queues ask ----------------------------------------------------------

    def blocked_name(self, request: Request) -> str | None:
        """The first of the request's capped names that is blocked here, if any: the request
        waits in that name's sub-queue."""
        for name in self.throttle.names_of(request):
            if self.blocked(name):
                return name
        return None

    def blocked(self, key: str) -> bool:
        """No request of ``key`` may leave for a take now: a wait for it is under way here and
        keeps nothing yet, or this process already holds, takes or waits for the key's limit of
        it."""
        if self.kept.count(key) and key not in self.paused:
            return False
        return not self.has_room(key)

    def has_room(self, key: str) -> bool:
        """A request of ``key`` that uses no kept slot of it (one of a capped stage, whose stage's
        slot comes first) may leave for a take: the key is not paused, no wait for it is under way
        here, and fewer than its limit of this process's requests hold, take or wait for it. Other
        processes' are not seen (that would cost a read per request): their share shows in the
        take."""
        if key in self.paused or self.closed or self._asking(key):
            return False
        limit = self.settings.policy_of(key).limit
        return limit is None or self.load()[key] + self.kept.count(key) < limit

    def may_go(self, key: str) -> bool:
        """The key's sub-queue may let a request go: a slot (or the wait's error) is kept for it,
        or the key is free again (its request then takes a look)."""
        return not self.blocked(key) and not self.closed

    def new_pass(self) -> None:
        """The engine asks for the next request: the loads are counted again."""
        self._load = None

    def load(self) -> Counter[str]:
        """Requests of this process per name that hold a slot of it, take one, or wait in the
        middleware to take one (those holding their stage's slot): counted once per pass of the
        engine (the slots kept for it are added where it is read)."""
        if self._load is None:
            # every name of every looking (its names kept with it) and holding request, counted in
            # one go: this runs for nearly every request a broad crawl schedules
            named = list(chain.from_iterable(self.looking.values()))
            names_of = self.throttle.names_of
            for request in self.slots.holding():
                named.extend(names_of(request))
            self._load = Counter(named)
        return self._load

    def full(self) -> bool:
        """Enough is under way: the downloader has no room for more than what is ready or being
        looked for."""
        active = downloader_active(self.crawler)
        looking = len(self.looking) - len(self.waiting)
        busy = (0 if active is None else len(active)) + len(self.ready) + looking
        return busy >= self.room

    def pending(self) -> int:
        """Requests out of the inner scheduler here (held for a take, or ready)."""
        return len(self.looking) + len(self.ready)

    # -- a request leaving the scheduler -----------------------------------------------------------

    def next_ready(self) -> Request | None:
        return self.ready.popleft() if self.ready else None

    def holds_back(self, request: Request, in_hand: InHand | None = None) -> bool:
        """Whether ``request`` (just out of the inner scheduler; of a capped stage, with a slot of
        it ``in_hand``) waits here for its slots; False when it goes now, with them all: no capped
        name, or a slot (or an error) kept for each of its names (none is used for a request of a
        capped stage: a kept slot of a name was got without a stage's)."""
        names = self.throttle.names_of(request)
        if not names:
            self._hand_stage(request, in_hand)
            return False
        got: list[Taken] = []
        for name in names if in_hand is None else ():
            outcome = self.kept.take(name)
            if outcome is None:
                continue
            if isinstance(outcome, BaseException):  # a wait that ran out: the request fails with it
                self._give_back(got)
                self.slots.hand(request, outcome)  # what it still holds goes back first
                return False
            got.append(Taken(name, outcome, kept=True))
        if len(got) == len(names):
            self._hand(request, got)
            return False
        self.looking[request] = names
        if in_hand is not None:
            self.in_hand[request] = in_hand
        if self._load is not None:
            self._load.update(names)
        self._start(self._look(request, names, got))
        return True

    def _hand_stage(self, request: Request, in_hand: InHand | None) -> None:
        """The request goes with its stage's slot (the middleware takes it)."""
        if in_hand is not None:
            self.slots.hand(request, in_hand.permit)
            self.slots.locks.record_grant(in_hand.stage, in_hand.waited)

    def _drop_stage(self, request: Request) -> None:
        """The stage's slot of a request that does not go now goes back to Redis, whose line hands
        it to the next waiter anywhere."""
        in_hand = self.in_hand.get(request)
        if in_hand is not None:
            self.slots.locks.release_soon(in_hand.permit)

    def _give_back(self, got: list[Taken]) -> None:
        """Slots taken for a request that does not go now: a kept one is kept again (first), a
        fresh one goes back to Redis (its other holders' waiters get it at once)."""
        for taken in reversed(got):
            if taken.kept and not self.closed:
                self.kept.keep(taken.name, taken.permit, first=True)
            else:
                self.locks.release_soon(taken.permit)

    def _hand(self, request: Request, got: list[Taken]) -> None:
        """The request goes with a slot of each of its capped names, after its stage's if it came
        with one (the middleware takes them). Slots it still holds go back first: it came back to
        the scheduler unseen by the middleware (one before it returned the request itself)."""
        held: list[HeldSlot] = []
        in_hand = self.in_hand.pop(request, None)
        if in_hand is not None:
            held.append((self.slots.lines, in_hand.permit))
            self.slots.locks.record_grant(in_hand.stage, in_hand.waited)
        for taken in got:
            if taken.kept:  # counted once it goes with it: how long its name's requests waited
                self.throttle.locks.record_grant(taken.name, self.kept.waited(taken.name))
                if self._load is not None:
                    self._load[taken.name] += 1
        order = self.throttle.names_of(request)
        lines = self.throttle.lines
        held.extend((lines, t.permit) for t in sorted(got, key=lambda t: order.index(t.name)))
        self.slots.hand(
            request,
            held,
            # a light slot kept, or got by a wait in the line, may be a finished request's (passed
            # on): its take checked a pause for that request only
            recheck=any((t.kept or t.from_line) and getattr(t.permit, "light", False) for t in got),
        )

    async def _look(self, request: Request, names: tuple[str, ...], got: list[Taken]) -> None:
        """One take in Redis for each name the request has no kept slot of, in order: it goes
        with them all, or back to the queue of the first name refused (its other slots given back:
        it holds none while it waits) while a wait for that name starts. A request of a capped
        stage waits here for a refused name instead, with its stage's slot."""
        started = self.clock()
        paused: Paused | None = None
        refused: str | None = None
        failed: AcquireTimeout | None = None
        with_stage = request in self.in_hand
        try:
            have = {taken.name for taken in got}
            for name in (name for name in names if name not in have):
                try:
                    permit = await self.locks.take(name)
                    from_line = permit is None and with_stage
                    if from_line:
                        permit = await self._wait_with_stage(request, name)
                except Paused as exc:
                    permit, paused = None, exc
                # counted by the line; before REDIS_ERRORS, which has OSError, as TimeoutError
                except AcquireTimeout as exc:
                    permit, failed = None, exc
                except REDIS_ERRORS as exc:
                    logger.warning("Taking a slot of key %r: Redis error (%s); it waits", name, exc)
                    permit = None
                if permit is None:
                    refused = name
                    break
                got.append(Taken(name, permit, kept=False, from_line=from_line))
        except BaseException:
            self._give_back(got)
            self._drop_stage(request)
            # cancelled (the engine closes: stand_down) or failed otherwise: back to its first
            # name's queue, unless close() put it back already
            if self.looking.pop(request, None) is not None:
                self.requeue(request, names[0])
            self.in_hand.pop(request, None)
            raise
        finally:
            self.looking.pop(request, None)
            self._load = None
        if self.closed:
            self._give_back(got)
            self._drop_stage(request)
            self.requeue(request, names[0])
            return
        if failed is not None:
            # its wait ran out: it fails with the error in the middleware, as a wait there would
            # have; its stage's slot goes back to Redis now
            self._give_back(got)
            self._drop_stage(request)
            self.in_hand.pop(request, None)
            self.slots.hand(request, failed)
            self.ready.append(request)
        elif refused is None:
            self.throttle.locks.record_grant(names[0], self.clock() - started)
            self._hand(request, got)
            for name in names:  # its names' queued requests, if any, wait from now
                self.kept.waited(name)
            self.ready.append(request)
        else:
            self._give_back(got)
            self._drop_stage(request)
            self.requeue(request, refused)
            if paused is not None:
                self._paused(refused, paused.wait)
            elif with_stage:
                self._pause(refused, REDIS_RETRY)  # Redis failed it: not again at once
            else:
                self.throttle.lines.ask(refused)
        wake_engine(self.crawler)

    async def _wait_with_stage(self, request: Request, name: str) -> SlotPermit:
        """A request of a capped stage waits for a slot of ``name`` in this process's line for it,
        with its stage's slot in hand (not one of CONCURRENT_REQUESTS: it is not counted as
        looking)."""
        task = asyncio.current_task()
        assert task is not None
        self.waiting[request] = (name, task)
        try:
            return await self.throttle.lines.wait(name, self.settings.wait_timeout)
        finally:
            self.waiting.pop(request, None)

    def _paused(self, key: str, seconds: float) -> None:
        """A take or a wait in the key's line met a Retry-After's pause: the key's queued requests
        stay queued until it ends, and a request waiting here for it with its stage's slot goes
        back to its queue, the slot back to Redis (no stage's slot is held through a key's
        pause)."""
        self._pause(key, seconds)
        for name, look in list(self.waiting.values()):
            if name == key:
                look.cancel()  # its look gives back what it holds and queues it again

    def _pause(self, key: str, seconds: float) -> None:
        """A Retry-After paused the key's starts: its requests stay queued until then."""
        if key in self.paused:
            return
        loop = asyncio.get_running_loop()
        self.paused[key] = loop.call_later(seconds, self._unpause, key)

    def _unpause(self, key: str) -> None:
        self.paused.pop(key, None)
        self._load = None
        wake_engine(self.crawler)

    def _start(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    # -- upkeep ------------------------------------------------------------------------------------

    def tick(self) -> None:
        """At every renewal round: the load is read again (the lines' upkeep is the front's)."""
        self._load = None

    def stand_down(self) -> None:
        """The engine closes: no more takes or waits (a request whose takes are cancelled goes
        back to its queue); what is kept goes back to Redis."""
        self.closed = True
        for task in list(self.tasks):
            task.cancel()
        for timer in self.paused.values():
            timer.cancel()
        self.paused.clear()
        self.kept.release_all()
        self.throttle.lines.trim()  # the queued requests' waits (none wanted now)

    def close(self) -> None:
        """Stand down and queue back the requests out of the inner scheduler here, before it
        closes (JOBDIR keeps them)."""
        self.stand_down()
        looking = dict(self.looking)  # request -> its capped names, as held back
        for request in self.ready:
            self.slots.finish(request)
            # to the sub-queue its stage and key give (its stage's slot is no longer in hand)
            push_back(self.inner, request)
        for request in looking:
            self._drop_stage(request)
        self.ready.clear()
        self.looking.clear()
        for request, names in looking.items():
            self.requeue(request, names[0])
