"""One crawler's stage locks: an AsyncCountingLock per capped stage (an AsyncQuorumCountingLock when
REDISLOCK_URL lists independent masters), acquire and release, the permit hand-off, renewal, and
release of everything on close. Composed of the slots that go with requests (:mod:`.requestslots`,
over the pure permit ledger of :mod:`.ledger`), start-up and shut-down (:mod:`.lifecycle`), why
requests wait (:mod:`.waitreports`), and the process's one renewal loop (:mod:`.renewer`).

Shared by :class:`~scrapy_redislock.StageLockMiddleware`, :class:`~scrapy_redislock.StageScheduler`
and the worker scheduler. API (all on the reactor thread, asyncio reactor)::

    locks = StageLocks.of(crawler, settings)          # the crawler's registry for request stages (created once)
    locks = StageLocks(crawler, settings, limits, lock_prefix="workers:", stats_prefix="redislock/workers")
    await locks.start_once()       # PING (+ the scripts on the way to a first grant, the waiting connections), write
                                   # the limits (newest process wins, a change is logged), join the renewal loop;
                                   # then, beside the first requests, say why a stage has no free slot. Redis
                                   # unreachable (down, or failing over): retried with back-off and a warning
                                   # each time, for up to REDISLOCK_CONNECT_TIMEOUT s. False if it stays
                                   # unreachable, or refuses the credentials (logged once, saying which: the
                                   # spider_opened signal then closes the spider, and the crawl exits with status 1)
                                   # ("redislock_redis_refused" when its ACL refuses this user a command)
    locks.is_capped(stage)         # True / False (None = unlimited); UnknownStage naming the known stages
    permit = await locks.acquire(stage, timeout)   # FIFO across processes; Redis errors are retried with back-off
    permit = await locks.slots.wait(stage, timeout)  # StageLockMiddleware: a slot from this process's line (a slot
                                   # freed here, or a grant to one of its waits in Redis; see crawl/stageline.py)
    locks.record_grant(stage, waited)              # stats: acquired, wait_time_total, wait_time_max
    await locks.slots.release(permit)    # never raises; a release Redis did not take is retried at every renewal tick
    locks.slots.release_soon(permit)     # the same from plain code, in a tracked task
    locks.slots.hand(request, permit_or_error)     # StageScheduler: the request leaves with this slot (or error)
    locks.slots.take(request)      # StageLockMiddleware: what came with it (an error only once), or None (also
                                   # when its slot is no longer usable: dropped, see below)
    locks.slots.usable(permit)     # may this slot go with a request now (counted and logged when not)
    locks.slots.hold(request, permit)    # StageLockMiddleware: a slot it waited for itself
    locks.slots.holding()          # the requests that hold a slot now (StageScheduler counts their keys)
    locks.slots.finish(request)    # the request is done with its slot: passed on locally (see below) or released
    locks.slots.add_taker(fn)      # fn(stage, permit) -> True when it takes a freed slot for a parked request
    locks.slots.add_lender(fn)     # fn(stage) -> a slot it keeps for a queued request, which a request arriving to
                                   # wait in the middleware takes instead (it is older)
    locks.add_waiting_source(fn)   # fn(stage) -> requests waiting for that stage (shown by the status CLI)
    locks.add_tick_hook(coro_fn)   # awaited at every renewal tick (leak sweeps)
    await locks.reports.stalled(stage, window)     # at close: why to give up waiting for the stage, or ""
    await locks.close()            # cancel waits, then free every permit and waiter: one aclose() per stage

The permit hand-off: a slot goes with its request object (never in ``meta``, which retries and
redirects copy) from the scheduler (``slots.hand``) or the middleware's own wait (``slots.hold``) until
``slots.finish``. The one sweep of requests that left the downloader without passing back through the
middleware (another middleware replaced or dropped them) runs at every renewal tick: a request
missing from ``downloader.active`` at two ticks in a row has its slot freed.

Local hand-off: when a request finishes and this process has a request of the same stage waiting
for a slot in the middleware (the oldest goes first: its wait in Redis's line stays, for the next
request, see :mod:`.stageline`) or queued in a taker (StageScheduler), the slot passes to it at
once, in the same call, with no Redis command: the grant stays
held, its lease goes on (renewed with the others), and the fencing token stays the grant's (two
requests of one process in a row may carry the same fence; it still grows with every grant Redis
makes). So that no other process starves, a slot passes on this way only while it is younger than
REDISLOCK_LOCAL_REUSE seconds (and half the lease) since Redis granted it; after that the next
finish releases it to Redis's first-come-first-served line (where this process's own waiters queue
too). A slot used locally is a slot held: its lease is valid, so the cap holds even while Redis is
unreachable (a held slot may then still pass on within that bound; nothing new is granted). Counted
as ``<stats_prefix>/<stage>/reused``.

A slot found lost, or past the end of its lease on this process's clock (``permit.usable``: renewals
failed for a lease, a stall, a partition), never goes with a request: ``slots.take``, the local
hand-off and StageScheduler's hand-out drop it (released, in case Redis still holds it), and its
request waits for another slot. A local check, no Redis command. Counted as
``<stats_prefix>/<stage>/unusable``.

Renewal: every StageLocks of the process joins one loop (:class:`.renewer.Renewer`, one per event
loop), which every ``ttl/3`` (at most 1 s) runs each member's tick at once: tick hooks, retried
releases, then ``maintain()`` of every stage lock concurrently (each renews all of this process's
permits of that stage and reaps expired leases of dead processes), after
``lock.annotate(waiting=..., spider=...)``. A lost lease is logged as a warning and counted as
``<stats_prefix>/<stage>/lost``. Redis errors are logged as warnings with back-off; nothing is given
up. Only a stage that holds or waits is maintained, so when a stage's waits end and it goes idle,
its last annotation (say ``waiting=3``) would stay in Redis, shown by ``status`` and ``/metrics``,
until the process exits: the tick after the waits end sends one more maintain with ``waiting=0``
(one EVALSHA per wait-end, none per request), so the waiters shown lag the truth by at most a
renewal interval.

Why a crawl waits: said by :mod:`.waitreports` at start and while waits see no grant.

Unclean shutdown (a second Ctrl-C): a reactor "before shutdown" trigger (or, without a Twisted
reactor, the renewal task being cancelled) frees this process's slots, one aclose() per stage at
once, before the process exits.

Quorum (REDISLOCK_URL a list of N masters, request front): each capped stage's lock is an
:class:`~scrapy_redislock.lock.quorum.AsyncQuorumCountingLock` (REDISLOCK_QUORUM, else the stage's
safe quorum), made by one :class:`~scrapy_redislock.lock.quorum.QuorumLockFactory` over one client
per master; that is all that differs. Its :class:`~scrapy_redislock.lock.quorum.QuorumPermit` goes
through hand/take/hold/finish and the local hand-off like a ``Permit``; the Renewer maintains it
(lost when fewer than q masters renew: the same lost-permit path). The start succeeds once q masters
answer (a warning names the others), why-a-stage-waits is said per master, and close frees every
grant on every master.

Reads no settings itself: it is given a checked
:class:`~scrapy_redislock.crawl.settings.RedisLockSettings`. Every touch of Scrapy's engine
internals is in :mod:`scrapy_redislock.crawl.engine`.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from scrapy_redislock._redis import AsyncRedisClient, Backoff
from scrapy_redislock.crawl.adaptive import Adaptation
from scrapy_redislock.crawl.deployment import deployment_of
from scrapy_redislock.crawl.engine import one_per_crawler
from scrapy_redislock.crawl.lifecycle import Lifecycle
from scrapy_redislock.crawl.limits import publish_limits
from scrapy_redislock.crawl.reach import REDIS_ERRORS
from scrapy_redislock.crawl.renewer import gather_bounded
from scrapy_redislock.crawl.requestslots import RequestSlots, SlotPermit
from scrapy_redislock.crawl.settings import group_of
from scrapy_redislock.crawl.waitreports import WaitReports
from scrapy_redislock.errors import AcquireTimeout, Paused, UnknownStage
from scrapy_redislock.lock.interface import AsyncLock
from scrapy_redislock.lock.permit import group_prefix

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler

    from scrapy_redislock.crawl.settings import RedisLockSettings

logger = logging.getLogger(__name__)

# What holds a stage's slots (one interface for one Redis and a quorum of masters), and what a slot
# is: a Permit, or a QuorumPermit on a quorum.
StageLock = AsyncLock[Any]


# -- one crawler's stage locks ---------------------------------------------------------------------


class StageLocks:
    """The capped stages of one crawler, their permits and waits; see the module docstring for the
    API."""

    # close() deletes the locks from Redis when unused (locks of keys met at run time)
    retire_on_close = False
    # Redis calls at once when renewing or freeing every lock (None: all at once)
    fan_out: int | None = None
    # the limit each renewal reports is seen (logged when it changed, read by the worker front)
    watch_limits = True

    def __init__(
        self,
        crawler: Crawler,
        settings: RedisLockSettings,
        limits: Mapping[str, int | None],
        *,
        lock_prefix: str = "",
        stats_prefix: str = "redislock",
    ) -> None:
        self.crawler = crawler
        self.settings = settings
        self.limits = dict(limits)
        self.lock_prefix = lock_prefix
        self.stats_prefix = stats_prefix
        # the cap group (REDISLOCK_GROUP) and the prefix of its locks' keys
        self.group = group_of(settings, self.spider_name)
        self.key_prefix = group_prefix(settings.key_prefix, self.group)
        # stage -> (its limit as a renewal last reported it, time.monotonic() then)
        self.limits_seen: dict[str, tuple[int, float]] = {}
        # stage -> the limit this process last knew Redis to hold (written at start, or logged)
        self.limits_known: dict[str, int] = {}
        # one Redis, or a quorum of masters: the clients (one, or one per master) and the locks
        self.deployment = deployment_of(settings, self.key_prefix)
        self.locks: dict[str, StageLock] = {
            stage: self._make_lock(f"{lock_prefix}{stage}", limit)
            for stage, limit in self.limits.items()
            if limit is not None
        }
        self._stage_by_lock = {lock.name: stage for stage, lock in self.locks.items()}
        self._waiting_sources: list[Callable[[str], int]] = []
        # StageScheduler's: whether a request left it, and the way back into its inner scheduler
        # for one that never went out (waiting for a slot in the middleware when the spider
        # closes); None without it
        self.left_scheduler: Callable[[Request], bool] | None = None
        self.give_back: Callable[[Request], bool] | None = None
        self._tick_hooks: list[Callable[[], Awaitable[None]]] = []
        self._retry_at = 0.0
        self._backoff = Backoff()  # after a failed tick
        self.reports = WaitReports(self)
        # stage -> the waiting count its last maintain told Redis
        self._sent_waiting: dict[str, int] = {}
        self.closed = False
        self._start_report: asyncio.Task[None] | None = None  # why a stage waits, said at start
        self.lifecycle = Lifecycle(self)
        self.slots = RequestSlots(self)
        # adaptive limits and Retry-After pauses (REDISLOCK_ADAPTIVE, REDISLOCK_RETRY_AFTER)
        self.adaptation: Adaptation | None = None
        if settings.adaptive.needed and not lock_prefix:  # request stages (not workers: stages)
            # an adaptive stage's configured cap is its controller's maximum
            ceiling = {
                s: cap for s, cap in self.limits.items() if settings.adaptive.adapts(stage=s)
            }
            self.adaptation = Adaptation(
                self.client, settings, ceiling.get, key_prefix=self.key_prefix, stats=self.stats
            )
            self.add_tick_hook(self.adaptation.tick)

    def _make_lock(self, name: str, limit: int) -> StageLock:
        """A stage's lock: the single-Redis lock, or the quorum lock over the masters of
        REDISLOCK_URL. On one Redis, the limit in each reply of its renewals goes to
        :meth:`limit_seen` (no command of its own)."""
        identity = {"spider": self.spider_name, "group": self.group, "waiting": 0, "limit": limit}
        return self.deployment.make_lock(name, limit, identity)

    def _limit_reported(self, stage: str, lock: StageLock) -> None:
        """The limit the lock's renewal reported (one Redis; a quorum lock reports none) is seen
        (:meth:`limit_seen`); the keys' locks (KeyLocks) keep their own."""
        limit = getattr(lock, "reported_limit", None)
        if self.watch_limits and limit is not None:
            self.limit_seen(stage, limit)

    @property
    def limits_setting(self) -> str:
        """The setting this process's limits come from."""
        return "REDISLOCK_WORKER_STAGES" if self.lock_prefix else "REDISLOCK_STAGES"

    def limit_seen(self, stage: str, limit: int) -> None:
        """A renewal reported the stage's limit in Redis: a change from what this process knew
        (another process's settings, an operator's ``set-limit``) is logged once, here too; an
        adaptive stage's controller moves its limit itself, unlogged."""
        self.limits_seen[stage] = (limit, time.monotonic())
        known = self.limits_known.get(stage)
        self.limits_known[stage] = limit
        adapts = self.adaptation is not None and self.settings.adaptive.adapts(stage=stage)
        if known is not None and known != limit and not adapts:
            configured = self.limits.get(stage)
            logger.log(
                logging.WARNING if limit != configured else logging.INFO,
                "Limit of stage %r (group %r) changed in Redis from %s to %s by another process or an operator; it holds for this process too (its %s says %s)",  # noqa: E501
                f"{self.lock_prefix}{stage}",
                self.group,
                known,
                limit,
                self.limits_setting,
                configured,
            )

    @classmethod
    def of(
        cls, crawler: Crawler, settings: RedisLockSettings, *, attr: str = "_redislock_stage_locks"
    ) -> StageLocks:
        """The crawler's shared instance for the request stages (REDISLOCK_STAGES), created on first
        use."""
        return one_per_crawler(crawler, attr, lambda: cls(crawler, settings, settings.stages))

    @property
    def clients(self) -> list[AsyncRedisClient]:
        """One, or one per master of a quorum."""
        return self.deployment.clients

    @property
    def spider_name(self) -> str | None:
        return getattr(self.crawler.spidercls, "name", None)

    @property
    def client(self) -> AsyncRedisClient:
        """The one Redis (a quorum: the first master)."""
        return self.clients[0]

    @property
    def stats(self) -> Any:
        return self.crawler.stats

    @property
    def renew_interval(self) -> float:
        return min((lock.renew_interval for lock in self.locks.values()), default=1.0)

    def is_capped(self, stage: str) -> bool:
        """True for a capped stage, False for an unlimited one; UnknownStage for a stage not
        configured."""
        if stage in self.locks:
            return True
        if stage in self.limits:
            return False
        close = difflib.get_close_matches(stage, list(self.limits), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UnknownStage(
            f"stage {stage!r} is not configured ({hint}REDISLOCK_STAGES has {sorted(self.limits)})"
        )

    def add_waiting_source(self, source: Callable[[str], int]) -> None:
        """Register ``source(stage) -> int``: requests waiting for a slot of that stage, summed for
        the status CLI."""
        self._waiting_sources.append(source)

    def add_tick_hook(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Register a coroutine function awaited at every renewal tick, before the renewals."""
        self._tick_hooks.append(hook)

    # -- start -------------------------------------------------------------------------------------

    async def start_once(self) -> bool:
        """:meth:`start`, once, however many components ask (see :class:`Lifecycle`); False when
        Redis cannot be reached or refuses us."""
        return await self.lifecycle.start_once()

    @property
    def started(self) -> bool:
        return self.lifecycle.started

    async def start(self) -> None:
        """PING (with the scripts on the way to a first grant, and the waiting connections opened
        beside it), publish this process's limits, join the renewal loop, then say why a stage has
        no free slot in a task of its own; redis errors when Redis is unreachable."""
        await self.deployment.reach(self.locks)
        await publish_limits(self)
        if self.locks:
            # One renewal now registers this process's identity, so that the reports below can name
            # it.
            await asyncio.gather(*(lock.maintain() for lock in self.locks.values()))
            for stage, lock in self.locks.items():
                self._limit_reported(stage, lock)
            self.lifecycle.join_renewal()
        self.lifecycle.started = True
        logger.info(
            "Stage slots in Redis at %s (prefix %r, group %r, ttl %s s): %s",
            self.settings.redis.safe_url,
            self.settings.key_prefix,
            self.group,
            self.settings.ttl,
            {stage: self.limits[stage] for stage in self.limits},
        )
        if self.locks:
            # beside the first requests, not in front of them (a read per stage)
            self._start_report = asyncio.ensure_future(self._say_why_at_start())

    async def _say_why_at_start(self) -> None:
        for stage in list(self.locks):
            try:
                await self.reports.say_why(stage, "at start")
            # started: a report that cannot be read must not close the crawl
            except REDIS_ERRORS as exc:
                logger.debug("Could not read why stage %r waits: %s", stage, exc)

    async def close_unclean(self) -> None:
        """The process is going away without closing the spider (a second Ctrl-C): free its slots
        now."""
        await self.lifecycle.close_unclean()

    # -- acquire and release -----------------------------------------------------------------------

    async def acquire(self, stage: str, timeout: float | None) -> SlotPermit:
        """Wait for a slot of ``stage`` (first come, first served across processes).

        AcquireTimeout after ``timeout`` seconds (None: forever), counted as ``<stage>/timeouts``.
        Redis errors are logged and retried with back-off: the wait goes on and the cap is never
        exceeded. Cancelled on close.
        """
        lock = self.locks[stage]
        task = asyncio.current_task()
        if task is not None:
            self.lifecycle.waits.add(task)
        self.reports.wait_began(task, stage)
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff = Backoff()
        try:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    permit = await lock.acquire(timeout=left)
                    self.reports.granted(stage)
                    return permit
                except AcquireTimeout:
                    self.stats.inc_value(f"{self.stats_prefix}/{stage}/timeouts")
                    raise
                except Paused as paused:  # a Retry-After paused a key's starts: wait it out
                    if deadline is not None and time.monotonic() + paused.wait > deadline:
                        self.stats.inc_value(f"{self.stats_prefix}/{stage}/timeouts")
                        raise AcquireTimeout(
                            f"stage {stage!r}: paused beyond the wait's {timeout} s"
                        ) from paused
                    await asyncio.sleep(paused.wait)
                except REDIS_ERRORS as exc:
                    if self.closed:
                        raise
                    delay = backoff.next()
                    if deadline is not None and time.monotonic() + delay > deadline:
                        self.stats.inc_value(f"{self.stats_prefix}/{stage}/timeouts")
                        raise AcquireTimeout(
                            f"stage {stage!r}: no slot within {timeout} s ({exc})"
                        ) from exc
                    logger.warning(
                        "Waiting for stage %r: Redis error (%s); retrying in %.1f s",
                        stage,
                        exc,
                        delay,
                    )
                    self.stats.inc_value(f"{self.stats_prefix}/redis_errors")
                    await asyncio.sleep(delay)
        finally:
            self.reports.wait_ended(task)
            if task is not None:
                self.lifecycle.waits.discard(task)

    def record_grant(self, stage: str, waited: float) -> None:
        """Count one request that got a slot of ``stage`` after waiting ``waited`` seconds."""
        self.stats.inc_value(f"{self.stats_prefix}/{stage}/acquired")
        self.stats.inc_value(f"{self.stats_prefix}/{stage}/wait_time_total", waited)
        self.stats.max_value(f"{self.stats_prefix}/{stage}/wait_time_max", waited)

    def released(self, permit: SlotPermit) -> None:
        """``permit`` went back to Redis (the locks of keys drop an idle lock object here)."""

    def lock_of(self, permit: SlotPermit) -> StageLock | None:
        return self.locks.get(self.stage_of(permit) or "")

    def stage_of(self, permit: SlotPermit) -> str | None:
        """The stage (or key) whose lock granted ``permit``; None for a lock this object does not
        have (any more)."""
        return self._stage_by_lock.get(permit.name)

    # -- renewal -----------------------------------------------------------------------------------

    def waiting(self, stage: str) -> int:
        return sum(source(stage) for source in self._waiting_sources)

    async def tick(self) -> None:
        """One renewal round: hooks, retried releases, then every stage's maintain() at once. Never
        raises."""
        if self.closed or time.monotonic() < self._retry_at:
            return
        self.slots.sweep()
        for hook in list(self._tick_hooks):
            try:
                await hook()
            except Exception:
                logger.exception("redislock tick hook %r failed", hook)
        try:
            await self.slots.retry_releases()
            await self.renew_once()
            await self.reports.report()
        except REDIS_ERRORS as exc:
            delay = self._backoff.next()
            logger.warning("Renewing stage slots failed (%s); retrying in %.1f s", exc, delay)
            self.stats.inc_value(f"{self.stats_prefix}/redis_errors")
            self._retry_at = time.monotonic() + delay
        else:
            self._backoff.reset()

    def renewal_due(self, stage: str, lock: StageLock) -> bool:
        """Whether this tick maintains the stage's lock: it holds or waits for something."""
        return lock.busy or bool(self.waiting(stage))

    def waiting_stale(self, stage: str, lock: StageLock) -> bool:
        """Whether Redis still shows this process waiting for the stage although its waits have
        ended: the last annotation sent said ``waiting > 0``. The lock is idle, so no renewal would
        correct it (it stayed until the process exited, or was forgotten 3 leases later); one
        maintain with ``waiting=0`` does, once per wait-end."""
        return self._sent_waiting.get(stage, 0) > 0

    async def renew_once(self) -> None:
        """Renew every permit of every stage (one maintain() per stage, concurrently); count lost
        leases.

        A stage whose waits ended since the last renewal that reported some (``waiting > 0``) gets
        one more maintain with ``waiting=0`` even when it holds nothing, so that status readers see
        the waits end within a renewal interval; a stage that stays idle costs nothing after
        that."""

        async def renew(stage: str, lock: StageLock) -> None:
            waiting = self.waiting(stage)
            lock.annotate(waiting=waiting, spider=self.spider_name)
            lost = await lock.maintain()  # logs each lost lease as a warning
            self._sent_waiting[stage] = waiting
            self._limit_reported(stage, lock)
            if lost:
                self.stats.inc_value(f"{self.stats_prefix}/{stage}/lost", len(lost))

        # a lock that holds nothing, waits for nothing, and that Redis knows so costs nothing (not
        # even a coroutine: a broad crawl has thousands of keys' locks between two retirements)
        due = [
            (stage, lock)
            for stage, lock in self.locks.items()
            if self.renewal_due(stage, lock) or self.waiting_stale(stage, lock)
        ]
        results = await gather_bounded([renew(s, lock) for s, lock in due], self.fan_out)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    # -- close -------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Cancel every wait, then free every permit and waiter of this process: one aclose() per
        stage (see :meth:`Lifecycle.close <scrapy_redislock.crawl.lifecycle.Lifecycle.close>`)."""
        if self.adaptation is not None:
            self.adaptation.close()
        if self._start_report is not None and not self._start_report.done():
            self._start_report.cancel()
        await self.lifecycle.close()
