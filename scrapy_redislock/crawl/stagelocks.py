"""One crawler's stage locks, the part both fronts share: an AsyncCountingLock per capped stage (an
AsyncQuorumCountingLock when REDISLOCK_URL lists independent masters), acquire, release (retried at
every renewal tick until Redis takes it), renewal, start once and close. Why requests wait is said
by :mod:`.waitreports` (given the locks it reads); the process's one renewal loop is
:mod:`.renewer`.

Used by the request front (:class:`~scrapy_redislock.requests.requestslots.RequestSlots`, which
owns the hand-off of slots between requests) and the worker front (lock prefix ``workers:``). API
(all on the reactor thread, asyncio reactor)::

    locks = StageLocks.of(crawler, settings)          # the crawler's registry for request stages (created once)
    locks = StageLocks(crawler, settings, limits, lock_prefix="workers:", stats_prefix="redislock/workers")
    await locks.start_once()       # PING (+ the scripts on the way to a first grant, the waiting connections), write
                                   # the limits (newest process wins, a change is logged), free the slots at shutdown;
                                   # then, beside the first requests, say why a stage has no free slot. Redis
                                   # unreachable (down, or failing over): retried with back-off and a warning
                                   # each time, for up to REDISLOCK_CONNECT_TIMEOUT s. False if it stays
                                   # unreachable, or refuses the credentials (logged once, saying which: the
                                   # spider_opened signal then closes the spider, and the crawl exits with status 1)
                                   # ("redislock_redis_refused" when its ACL refuses this user a command)
    locks.is_capped(stage)         # True / False (None = unlimited); UnknownStage naming the known stages
    permit = await locks.take(stage)               # a free slot now, or None: one script, no wait (no retry)
    permit = await locks.look(stage)               # the same, while one may well be free: a stage nobody else
                                                   # was seen at, which this process neither holds nor waits
                                                   # for, until a look finds it full (else None, no command)
    permit = await locks.acquire(stage, timeout)   # FIFO across processes; Redis errors are retried with back-off
    locks.record_grant(stage, waited)              # stats: acquired, wait_time_total, wait_time_max
    await locks.release(permit)    # never raises; a release Redis did not take is retried at every renewal tick
    locks.release_soon(permit)     # the same from plain code, in a tracked task
    locks.usable(permit)           # may this slot go with a request now (counted and logged when not)
    locks.join_renewal()           # the worker front: join the renewal loop (the request front runs its two)
    await locks.tick()             # one renewal round: adaptive limits, retried releases, renewals, reports
    await locks.tick(demand)       # the request front's round: ``demand`` (name -> its requests waiting here for
                                   # a slot, in the middleware and queued in its scheduler) is what the renewals
                                   # report as this process waiting
    await locks.reports.stalled(stage, window)     # at close: why to give up waiting for the stage, or ""
    await locks.close()            # cancel looks and waits, then free every permit and waiter: one aclose() per stage

The permit hand-off and the local hand-off of a finished request's slot (REDISLOCK_LOCAL_REUSE) are
the request front's: see :mod:`scrapy_redislock.requests.requestslots` and
:mod:`scrapy_redislock.requests.lines`. A slot used locally is a
slot held here: its lease goes on (renewed with the others), so the cap holds.

A slot found lost, or past the end of its lease on this process's clock (``permit.usable``: renewals
failed for a lease, a stall, a partition), never goes with a request: :meth:`StageLocks.usable` says
so (a local check, no Redis command), and the caller drops it (released, in case Redis still holds
it). Counted as ``<stats_prefix>/<stage>/unusable``.

Start: :meth:`StageLocks.start_once` runs ``start()`` once, however many components ask, retried
with back-off and a warning each time while Redis is unreachable (down, or failing over) for up to
REDISLOCK_CONNECT_TIMEOUT s; credentials or an ACL refused are not retried. When it stays
unreachable, or refuses us, the failure is logged once, saying which: the spider_opened signal then
closes the spider (a scheduler must not raise CloseSpider from open(): Scrapy would skip opening its
scraper and log a traceback at close), and the crawl exits with status 1.

Renewal: the process has one loop (:class:`.renewer.Renewer`, one per event loop), which every
``ttl/3`` (at most 1 s) runs each member's tick at once. The worker front's registry joins it
itself (:meth:`StageLocks.join_renewal`); the request front's two (stages and keys) are run by the
front, whose tick does its own upkeep first
(:class:`~scrapy_redislock.requests.requestslots.RequestSlots`). A registry's tick: the adaptive
limits, retried releases, then ``maintain()`` of every stage lock concurrently (each renews all of
this process's permits of that stage and reaps expired leases of dead processes), after
``lock.annotate(waiting=..., spider=...)``: the front's requests waiting here for the stage, which the
request front counts at each of its rounds and passes down (:meth:`StageLocks.tick`'s ``demand``;
nothing of the front's is read from here). A lost lease is logged as a warning and counted as
``<stats_prefix>/<stage>/lost``. Redis errors are logged as warnings with back-off; nothing is given
up. Only a stage that holds or waits is maintained, so when a stage's waits end and it goes idle,
its last annotation (say ``waiting=3``) would stay in Redis, shown by ``status`` and ``/metrics``,
until the process exits: the tick after the waits end sends one more maintain with ``waiting=0``
(one EVALSHA per wait-end, none per request), so the waiters shown lag the truth by at most a
renewal interval.

Why a crawl waits: said by :mod:`.waitreports` at start and while waits see no grant.

Shut-down: :meth:`StageLocks.close` cancels the waits in progress, then frees every permit and
waiter of this process, one ``aclose()`` per lock, and then any grant Redis handed a cancelled wait
late; no step waits on Redis for longer than CLOSE_TIMEOUT. Its clients are closed then, cut short
or not, by the last registry that shares them (the keys' :class:`~.keylocks.KeyLocks` borrows the
request stages'). Unclean shutdown (a second Ctrl-C): a
reactor "before shutdown" trigger (or, without a Twisted reactor, the renewal task being cancelled)
frees this process's slots, one aclose() per stage at once, before the process exits.

Quorum (REDISLOCK_URL a list of N masters, request front): each capped stage's lock is an
:class:`~scrapy_redislock.lock.quorum.AsyncQuorumCountingLock` (REDISLOCK_QUORUM, else the stage's
safe quorum), made by one :class:`~scrapy_redislock.lock.quorum.QuorumLockFactory` over one client
per master; that is all that differs. Its :class:`~scrapy_redislock.lock.quorum.QuorumPermit` goes
through the hand-off like a ``Permit``; the Renewer maintains it (lost when fewer than q masters
renew: the same lost-permit path). The start succeeds once q masters answer (a warning names the
others), why-a-stage-waits is said per master, and close frees every grant on every master.

Reads no settings itself: it is given a checked
:class:`~scrapy_redislock.crawl.settings.RedisLockSettings`. Every touch of Scrapy's engine
internals is in :mod:`scrapy_redislock.crawl.engine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

import redis.exceptions
from scrapy import signals
from scrapy.exceptions import CloseSpider, DownloadTimeoutError
from scrapy.utils.defer import deferred_from_coro
from scrapy.utils.reactor import is_reactor_installed

from scrapy_redislock._loop import start_now
from scrapy_redislock._redis import AsyncRedisClient, Backoff
from scrapy_redislock.crawl.adaptive import Adaptation
from scrapy_redislock.crawl.deployment import Deployment, deployment_of
from scrapy_redislock.crawl.engine import StartLogCount, count_start_logs, one_per_crawler
from scrapy_redislock.crawl.limits import publish_limits
from scrapy_redislock.crawl.reach import OUTAGE_ERRORS, REDIS_ERRORS, REFUSED
from scrapy_redislock.crawl.renewer import Renewer, gather_bounded
from scrapy_redislock.crawl.settings import group_of
from scrapy_redislock.crawl.waitreports import WaitReports
from scrapy_redislock.errors import AcquireTimeout, ConfigError, LockError, Paused, UnknownStage
from scrapy_redislock.lock.aio import AsyncCountingLock
from scrapy_redislock.lock.base import CommandRunner
from scrapy_redislock.lock.core import release_consumer
from scrapy_redislock.lock.interface import AsyncLock
from scrapy_redislock.lock.permit import Permit, group_prefix
from scrapy_redislock.lock.protocol import adrive
from scrapy_redislock.lock.quorum import QuorumPermit

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler

    from scrapy_redislock.crawl.settings import RedisLockSettings
    from scrapy_redislock.lock.core import Clock

logger = logging.getLogger(__name__)
# start and close say what they say under the logger name they always had (LOG settings name it)
lifecycle_logger = logging.getLogger("scrapy_redislock.crawl.lifecycle")

# What holds a stage's slots (one interface for one Redis and a quorum of masters), and what a slot
# is: a Permit, or a QuorumPermit on a quorum.
StageLock = AsyncLock[Any]
SlotPermit = Permit | QuorumPermit

START_BACKOFF = (0.25, 5.0)  # first and longest pause between tries to reach Redis at start
# a close never waits longer than this for Redis (a paused server must not hang the crawl)
CLOSE_TIMEOUT = 5.0
# seconds for Redis to see cancelled waits' connections close before the last sweep
LATE_GRANT_PAUSE = 0.02
# a forced shutdown waits at most this long for Redis to take the slots back
UNCLEAN_CLOSE_TIMEOUT = 3.0

# the meta keys that keep a request's own download timeout while a slot's lease bounds it, and the
# bound written (a copy of meta whose download_timeout is another was given one of its own)
OWN_TIMEOUT = "redislock_download_timeout"
BOUND_TIMEOUT = "redislock_bounded_timeout"


def within_lease(request: Request, left: float, default: float) -> bool:
    """Bound ``request``'s download to ``left`` seconds (what is left of its slot's lease as last
    confirmed, less a margin): Scrapy aborts it then (``download_timeout``: TimeoutError, retried
    like any). The request's own timeout (``download_timeout`` in meta, else ``default``, Scrapy's
    DOWNLOAD_TIMEOUT) is kept in ``meta["redislock_download_timeout"]``, so that a retry, which
    copies meta, starts from it again; a ``download_timeout`` other than the bound written (a copy
    of a response's meta given a timeout of its own) is the request's own. True when the lease is
    the shorter."""
    meta = request.meta
    timeout = meta.get("download_timeout", default)
    own = meta.get(OWN_TIMEOUT)
    if own is None or timeout != meta.get(BOUND_TIMEOUT):
        own = timeout
    own = meta[OWN_TIMEOUT] = float(own)
    # never 0: Scrapy reads a 0 timeout as none
    meta["download_timeout"] = meta[BOUND_TIMEOUT] = max(0.001, min(own, left))
    return left < own


def say_downloads_cut(ttl: float, download_timeout: float) -> None:
    """At start-up, on either front: a capped request's download is cut where its slot's lease
    would end (:func:`within_lease`), so a DOWNLOAD_TIMEOUT longer than REDISLOCK_TTL is said."""
    if download_timeout > ttl:
        lifecycle_logger.info(
            "A capped request's download is cut where its slot's lease (REDISLOCK_TTL %s s) would end, unrenewed, so that it never runs on past a slot Redis may have given away: DOWNLOAD_TIMEOUT %s s is longer; raise REDISLOCK_TTL above the longest download of a capped stage",  # noqa: E501
            ttl,
            download_timeout,
        )


def lease_end(permit: SlotPermit, renew_interval: float) -> float:
    """When a download under ``permit`` must end, as last confirmed (monotonic seconds): its lease
    less half a renewal interval; at once for a slot a renewal found lost, or released (another
    process may hold it now). Both fronts bound their downloads by it."""
    if permit.lost or permit.released:
        return -math.inf
    return permit.valid_until - renew_interval / 2


def out_of_lease(request: Request) -> None:
    """``request`` holds no slot: a bound written for another request whose meta it copied
    (``response.follow(url, meta=response.meta)``) gives way to that request's own timeout."""
    meta = request.meta
    if OWN_TIMEOUT not in meta:
        return
    own = meta.pop(OWN_TIMEOUT)
    if meta.get("download_timeout") == meta.pop(BOUND_TIMEOUT, None):
        meta["download_timeout"] = own


class LeaseRanOut(DownloadTimeoutError, LockError):
    """A capped request not sent: its slot's lease ran out while it waited in Scrapy's downloader
    (its process cut off from Redis). A DownloadTimeoutError, so retried as one; a LockError, so
    the adaptive limits do not count it against the site, which never saw it."""


def within_lease_at_start(request: Request, left: float, default: float) -> None:
    """As ``request``'s download starts (:func:`~scrapy_redislock.crawl.engine.at_download_start`):
    bounded by ``left`` again, what is left of its slot's lease as now confirmed. When nothing is
    left (the process was cut off from Redis while the request waited in its downloader slot) it
    is not sent: :class:`LeaseRanOut`, retried like a download timeout."""
    if left <= 0:
        raise LeaseRanOut(
            f"Getting {request.url} did not start: its slot's lease ran out while it waited in its downloader slot"
        )
    within_lease(request, left, default)


def slot_id(permit: SlotPermit) -> str:
    """How the log names a slot: its grant id (a quorum permit: its token, a grant per master)."""
    return permit.grant if isinstance(permit, Permit) else permit.token


class SystemEvents(Protocol):
    """The system event triggers of Twisted's IReactorCore, which every reactor provides. (Twisted's
    interfaces declare their methods without ``self``, for the mypy-zope plugin: without it mypy
    reads each argument one place off.)"""

    def addSystemEventTrigger(
        self,
        phase: str,
        eventType: str,
        callable: Callable[..., Any],
        *args: object,
        **kwargs: object,
    ) -> Any: ...

    def removeSystemEventTrigger(self, triggerID: Any) -> None: ...


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
        deployment: Deployment | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.crawler = crawler
        self.settings = settings
        # monotonic seconds: waits, back-offs, leases (its locks share it), the limits seen
        self.clock = clock
        self.limits = dict(limits)
        self.lock_prefix = lock_prefix
        self.stats_prefix = stats_prefix
        # the cap group (REDISLOCK_GROUP) and the prefix of its locks' keys
        self.group = group_of(settings, self.spider_name)
        self.key_prefix = group_prefix(settings.key_prefix, self.group)
        # stage -> (its limit as a renewal last reported it, self.clock() then)
        self.limits_seen: dict[str, tuple[int, float]] = {}
        # stage -> the limit this process last knew Redis to hold (written at start, or logged)
        self.limits_known: dict[str, int] = {}
        # one Redis, or a quorum of masters: the clients (one, or one per master) and the locks;
        # another registry's, shared (``deployment``, the keys': closed by the last to close)
        self.deployment = deployment or deployment_of(settings, self.key_prefix)
        self.locks: dict[str, StageLock] = {
            stage: self._make_lock(f"{lock_prefix}{stage}", limit)
            for stage, limit in self.limits.items()
            if limit is not None
        }
        self._stage_by_lock = {lock.name: stage for stage, lock in self.locks.items()}
        # name -> requests of this process waiting for a slot of it, as the front counted them for
        # the last round (:meth:`tick`); the renewals report it
        self.demand: Mapping[str, int] = {}
        self._retry_at = 0.0
        self._backoff = Backoff()  # after a failed tick
        self.reports = WaitReports(
            self.locks,
            self.deployment,
            settings,
            lock_prefix=lock_prefix,
            key_prefix=self.key_prefix,
            clock=clock,
        )
        # stage -> the waiting count its last maintain told Redis
        self._sent_waiting: dict[str, int] = {}
        self.closed = False
        self._start_report: asyncio.Task[None] | None = None  # why a stage waits, said at start
        # releases under way (release_soon), and those Redis did not take (outage): retried every
        # tick
        self.releasing: set[asyncio.Task[None]] = set()
        self._unreleased: list[SlotPermit] = []
        # start and close
        self.failure: CloseSpider | None = None
        self.started = False
        self._starting: asyncio.Future[None] | None = None
        self._renewer: Renewer | None = None
        self._shutdown_trigger: Any = None
        # acquire() calls in progress, cancelled on close
        self.waits: set[asyncio.Task[Any]] = set()
        # stages a look (:meth:`look`) found with no slot free: their waits join the line at once
        self.looked_full: set[str] = set()
        # what the start logs before Scrapy counts (it counts from spider_opened)
        self.start_logs: StartLogCount | None = None
        self.opened = False  # the spider_opened signal came
        crawler.signals.connect(self._spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(self._engine_stopped, signal=signals.engine_stopped)
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

    def _make_lock(self, name: str, limit: int) -> StageLock:
        """A stage's lock: the single-Redis lock, or the quorum lock over the masters of
        REDISLOCK_URL. On one Redis, the limit in each reply of its renewals goes to
        :meth:`limit_seen` (no command of its own)."""
        identity = {"spider": self.spider_name, "group": self.group, "waiting": 0, "limit": limit}
        return self.deployment.make_lock(name, limit, identity, self.clock)

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
        self.limits_seen[stage] = (limit, self.clock())
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
        cls,
        crawler: Crawler,
        settings: RedisLockSettings,
        *,
        attr: str = "_redislock_stage_locks",
        clock: Clock = time.monotonic,
    ) -> StageLocks:
        """The crawler's shared instance for the request stages (REDISLOCK_STAGES), created on first
        use (on the first caller's ``clock``)."""
        return one_per_crawler(
            crawler, attr, lambda: cls(crawler, settings, settings.stages, clock=clock)
        )

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

    # -- start -------------------------------------------------------------------------------------

    async def start_once(self) -> bool:
        """:meth:`start`, once, however many components ask; False when Redis cannot be reached or
        refuses us.

        The failure is logged once, saying which of the two it was. The spider_opened signal then
        closes the spider (a scheduler must not raise CloseSpider from open(): Scrapy would skip
        opening its scraper and log a traceback at close), and the crawl exits with status 1.
        """
        if self._starting is None:
            if not self.opened:
                self.start_logs = count_start_logs(self.crawler, clock=self.clock)
            self._starting = asyncio.ensure_future(self._start_retrying())
        try:
            await asyncio.shield(self._starting)
        except (*REDIS_ERRORS, ConfigError) as exc:
            self._start_failed(exc)
        return self.failure is None

    async def start(self) -> None:
        """PING (with the scripts on the way to a first grant, and the waiting connections opened
        beside it), publish this process's limits, free the slots if the reactor shuts down first
        (:meth:`join_renewal` is the owner's), then say why a stage has
        no free slot in a task of its own; redis errors when Redis is unreachable."""
        await self.deployment.reach(self.locks)
        await publish_limits(self)
        if self.locks:
            # One renewal now registers this process's identity, so that the reports below can name
            # it.
            await asyncio.gather(*(lock.maintain() for lock in self.locks.values()))
            for stage, lock in self.locks.items():
                self._limit_reported(stage, lock)
        if self.renews:
            self._watch_shutdown()
        self.started = True
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

    async def _start_retrying(self) -> None:
        """start(), tried again with back-off while Redis is unreachable, up to
        REDISLOCK_CONNECT_TIMEOUT seconds.

        A process started during a failover, or just before Redis, waits instead of closing at once;
        credentials or an ACL refused are not retried.
        """
        timeout = self.settings.redis.connect_timeout
        deadline = self.clock() + timeout
        backoff = Backoff(*START_BACKOFF)
        while True:
            try:
                await self.start()
                return
            except REDIS_ERRORS as exc:
                left = deadline - self.clock()
                if (
                    not isinstance(exc, OUTAGE_ERRORS)
                    or isinstance(exc, REFUSED)
                    or self.closed
                    or left <= 0
                ):
                    raise
                delay = min(backoff.next(), left)
                lifecycle_logger.warning(
                    "Redis at %s (%s) is not reachable yet (%s); trying again in %.1f s, for %.0f s more (REDISLOCK_CONNECT_TIMEOUT = %g)",  # noqa: E501
                    self.settings.redis.safe_url,
                    self.settings.redis.url_setting,
                    exc,
                    delay,
                    left,
                    timeout,
                )
                self.stats.inc_value(f"{self.stats_prefix}/redis_errors")
                await asyncio.sleep(delay)

    def _start_failed(self, exc: BaseException) -> None:
        if self.failure is not None:
            return
        source = self.settings.redis.url_setting
        if isinstance(exc, ConfigError):
            lifecycle_logger.error("%s; closing the spider rather than crawl unthrottled", exc)
            self.failure = CloseSpider("redislock_config_error")
        elif isinstance(exc, redis.exceptions.NoPermissionError):
            lifecycle_logger.error(
                "Redis at %s (%s) refused a command to this user (ACL): %s; the crawl needs the crawler role (python -m scrapy_redislock.cli.acl crawler); closing the spider rather than crawl unthrottled",  # noqa: E501
                self.settings.redis.safe_url,
                source,
                exc,
            )
            self.failure = CloseSpider("redislock_redis_refused")
        elif isinstance(exc, redis.exceptions.AuthenticationError):
            lifecycle_logger.error(
                "Redis at %s (%s) refused the credentials: %s Check the password or ACL user in the URL or in REDISLOCK_PARAMS; closing the spider rather than crawl unthrottled",  # noqa: E501
                self.settings.redis.safe_url,
                source,
                exc,
            )
            self.failure = CloseSpider("redislock_redis_auth_failed")
        else:
            lifecycle_logger.error(
                "Cannot reach Redis at %s (%s): %s; waited %g s (REDISLOCK_CONNECT_TIMEOUT); closing the spider rather than crawl unthrottled",  # noqa: E501
                self.settings.redis.safe_url,
                source,
                exc,
                self.settings.redis.connect_timeout,
            )
            self.failure = CloseSpider("redislock_redis_unavailable")
        # Connected now, so that it runs after every other spider_closed handler: the crawl did not
        # really start, and Scrapy's commands exit with status 1 only for a crawler without a spider
        # ("bootstrap failed").
        self.crawler.signals.connect(self._mark_failed, signal=signals.spider_closed)

    async def _spider_opened(self, spider: Any) -> None:
        self.opened = True
        if self.start_logs is not None:
            self.start_logs.hand_over()
        if not await self.start_once():
            assert self.failure is not None
            raise self.failure

    def _engine_stopped(self) -> None:
        if self.start_logs is not None:  # a crawl that never opened its spider: stop counting
            self.start_logs.hand_over()

    def _mark_failed(self, spider: Any) -> None:
        # the stats of a start that failed span its wait for Redis (CoreStats timed them from
        # spider_opened) and count its warnings and error (see crawl/engine.py: StartLogCount)
        if self.start_logs is not None:
            self.start_logs.timed_from_start()
        self.crawler.spider = None

    @property
    def renews(self) -> bool:
        """Whether this registry has anything to renew: a capped stage (the keys' always may)."""
        return bool(self.locks)

    def join_renewal(self) -> None:
        """Join the process's renewal loop as a member of its own, when it has anything to renew (the
        worker front's registry; the request front runs its registries' ticks itself)."""
        if self.renews and not self.closed:
            self._renewer = Renewer.current()
            self._renewer.join(self)

    def _watch_shutdown(self) -> None:
        """Free the slots if the reactor shuts down before the spider closes."""
        if is_reactor_installed() and self._shutdown_trigger is None:
            from twisted.internet import reactor

            self._shutdown_trigger = cast(SystemEvents, reactor).addSystemEventTrigger(
                "before", "shutdown", self._reactor_stopping
            )

    def leave_renewal(self) -> None:
        if self._shutdown_trigger is not None:
            from twisted.internet import reactor

            with contextlib.suppress(ValueError, KeyError):
                cast(SystemEvents, reactor).removeSystemEventTrigger(self._shutdown_trigger)
            self._shutdown_trigger = None
        if self._renewer is not None:
            self._renewer.leave(self)
            self._renewer = None

    def _reactor_stopping(self) -> Any:
        self._shutdown_trigger = None
        if self.closed:
            return None
        return deferred_from_coro(self.close_unclean())

    # -- acquire and release -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _using(self, name: str) -> Iterator[None]:
        """A take or wait of ``name`` goes on (KeyLocks makes a key's lock, and keeps it, meanwhile)."""
        yield

    async def take(self, name: str) -> SlotPermit | None:
        """A slot of ``name`` if one is free now and nobody queues for it in Redis, else None: one
        script, no wait (a key's on its light path: lock/light.py). The first take of a stage's line
        (:meth:`look`) and of a request's key or scope alike. None once closed: a take then would
        make a grant that nothing renews or frees."""
        if self.closed:
            return None
        with self._using(name):
            return await self.locks[name].try_acquire()

    def may_be_free(self, name: str) -> bool:
        """Whether a slot of the stage ``name`` may well be free, so a take is worth a round trip
        before a wait: this process neither holds nor waits for it, its last renewal of it (the
        start's, at least) saw no other process alive there (one Redis: a quorum lock reports none),
        and no look found it full since.

        A grant handed to a blocked wait counts once its owner confirms it (``hold_again``, a round
        trip after the read's; a waiting connection's first read is guarded first, one more), so
        that a silent process's waits cost the others little; a slot taken free is confirmed by the
        take's own reply. Keys say False: their first take is the request's, not the line's."""
        lock = self.locks.get(name)
        return (
            lock is not None
            and name not in self.looked_full
            and not lock.busy
            and getattr(lock, "owners_seen", None) == [lock.owner]
        )

    async def look(self, name: str) -> SlotPermit | None:
        """A slot of ``name`` taken at once while one :meth:`may_be_free`, else None (the wait joins
        the line in Redis). A look that finds no slot free (the others came since) costs a round trip
        and a take more, once: from then on the stage's waits join the line at once."""
        if not self.may_be_free(name):
            return None
        task = asyncio.current_task()  # cancelled on close, as a wait is
        if task is not None:
            self.waits.add(task)
        try:
            permit = await self.take(name)
        finally:
            if task is not None:
                self.waits.discard(task)
        if permit is None:
            self.looked_full.add(name)
        else:
            self.reports.granted(name)
        return permit

    async def acquire(self, stage: str, timeout: float | None) -> SlotPermit:
        """Wait for a slot of ``stage`` (first come, first served across processes).

        AcquireTimeout after ``timeout`` seconds (None: forever; counted as ``<stage>/timeouts`` by
        whoever fails a request with it: a wait may serve the next request of its stage). Redis
        errors are logged and retried with back-off: the wait goes on and the cap is never
        exceeded. Paused when a Retry-After paused a key's starts (the caller waits it out).
        Cancelled on close (and at once once closed: nothing would cancel it).
        """
        if self.closed:
            raise asyncio.CancelledError
        with self._using(stage):
            return await self._acquire(stage, self.locks[stage], timeout)

    async def _acquire(self, stage: str, lock: StageLock, timeout: float | None) -> SlotPermit:
        task = asyncio.current_task()
        if task is not None:
            self.waits.add(task)
        self.reports.wait_began(task, stage)
        deadline = None if timeout is None else self.clock() + timeout
        backoff = Backoff()
        try:
            while True:
                try:
                    left = None if deadline is None else max(0.0, deadline - self.clock())
                    permit = await lock.acquire(timeout=left)
                    self.reports.granted(stage)
                    return permit
                # Paused (a key's Retry-After) is the caller's to wait out; AcquireTimeout is an
                # OSError, as every TimeoutError: neither is a Redis error
                except (Paused, AcquireTimeout):
                    raise
                except REDIS_ERRORS as exc:
                    if self.closed:
                        raise
                    delay = backoff.next()
                    if deadline is not None and self.clock() + delay > deadline:
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
                self.waits.discard(task)

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

    def count(self, stage: str, what: str) -> None:
        self.stats.inc_value(f"{self.stats_prefix}/{stage}/{what}")

    async def release(self, permit: SlotPermit) -> None:
        """Give a slot back; a Redis error leaves it for the next tick to retry (it stays renewed
        until then)."""
        lock = self.lock_of(permit)
        if lock is None or permit.lost:
            return
        try:
            await lock.release(permit)
        except REDIS_ERRORS as exc:
            if self.closed:
                return  # close() frees every grant of this process in one call anyway
            logger.warning(
                "Could not release a slot of %r (%s); retrying at the next renewal",
                permit.name,
                exc,
            )
            self._unreleased.append(permit)
        else:
            self.released(permit)

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
            lock = self.lock_of(permit)
            if lock is None or permit.lost:
                continue
            try:
                await lock.release(permit)
            except REDIS_ERRORS:
                self._unreleased.extend(pending[index:])
                raise

    def usable(self, permit: SlotPermit, now: float | None = None) -> bool:
        """Whether ``permit`` may go with a request now: held under a valid lease as far as this
        process knows (``permit.usable`` on this registry's clock, which its locks share, unless
        ``now`` is given).
        When not, it is counted and logged; the caller drops it.

        A local check: a slot waiting for a request (StageScheduler's kept slots, a finished
        request's slot) may have been lost, or its lease may have run out while Redis was out of
        reach, and another process may hold it by now."""
        now = self.clock() if now is None else now
        if permit.usable(now):
            return True
        stage = self.stage_of(permit) or permit.name
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

    # -- renewal -----------------------------------------------------------------------------------

    def waiting(self, stage: str) -> int:
        """Requests of this process waiting for a slot of ``stage`` at the last round (reported
        with its renewals)."""
        return self.demand.get(stage, 0)

    async def tick(self, demand: Mapping[str, int] | None = None) -> None:
        """One renewal round: every stage's maintain() at once, retried releases, then the
        adaptive limits' reports (one script per lock used since the last round, which must not put
        the renewals off). ``demand``: the front's requests waiting here per name now, passed down
        at each round (None: none, the worker front's). Never raises."""
        self.demand = demand or {}
        if self.closed or self.clock() < self._retry_at:
            return
        try:
            await self.renew_once()
            await self.retry_releases()
            await self.reports.report()
        except REDIS_ERRORS as exc:
            delay = self._backoff.next()
            logger.warning("Renewing stage slots failed (%s); retrying in %.1f s", exc, delay)
            self.stats.inc_value(f"{self.stats_prefix}/redis_errors")
            self._retry_at = self.clock() + delay
        else:
            self._backoff.reset()
        if self.adaptation is not None:
            try:
                await self.adaptation.tick()
            except Exception:
                logger.exception("Adapting the limits of %r failed", self.stats_prefix)

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

    async def close_unclean(self) -> None:
        """The process is going away without closing the spider (a second Ctrl-C): free its slots
        now."""
        if self.closed:
            return
        lifecycle_logger.warning(
            "Forced shutdown: freeing this process's stage slots in Redis before exiting"
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.close(), UNCLEAN_CLOSE_TIMEOUT)

    async def close(self) -> None:
        """Cancel every wait, then free every permit and waiter of this process: one aclose() per
        stage."""
        if self.closed:
            return
        self.closed = True
        if self.adaptation is not None:
            self.adaptation.close()
        if self._start_report is not None and not self._start_report.done():
            self._start_report.cancel()
        self.leave_renewal()
        waits = [task for task in self.waits if task is not asyncio.current_task()]
        for task in waits:
            task.cancel()
        try:
            await self._free_all(set(waits) | set(self.releasing))
        finally:  # cut short too (a forced shutdown's own timeout): the clients go
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.deployment.aclose(), CLOSE_TIMEOUT)

    async def _free_all(self, pending: set[asyncio.Task[Any]]) -> None:
        """Let the waits cancelled and the releases under way end, then free every slot."""
        if pending:
            await asyncio.wait(pending, timeout=CLOSE_TIMEOUT)

        async def free(stage: str, lock: StageLock) -> None:
            closing = lock.aclose(retire=self.retire_on_close)
            try:
                await asyncio.wait_for(closing, CLOSE_TIMEOUT)
            except (TimeoutError, *REDIS_ERRORS) as exc:
                lifecycle_logger.warning(
                    "Could not free the slots of stage %r on close (%s); they come back after the TTL (%s s)",
                    stage,
                    exc or "timeout",
                    lock.ttl,
                )

        if self.started:  # else nothing was ever acquired (Redis unreachable at start)
            await gather_bounded([free(s, lock) for s, lock in self.locks.items()], self.fan_out)
            with contextlib.suppress(TimeoutError, *REDIS_ERRORS):
                await asyncio.wait_for(self._free_late_grants(), CLOSE_TIMEOUT)

    async def _free_late_grants(self) -> None:
        """Free a grant Redis handed to a cancelled wait after aclose() (it may see the wait's
        connection close only after serving it a slot freed by aclose() itself); without this it
        would wait for the TTL. On every master of a quorum (one owner name on all). A lock retired
        on close (a key's) that had one is retired again: its retire found it held, and kept it."""
        if not self.locks:
            return
        await asyncio.sleep(LATE_GRANT_PAUSE)

        async def on(client: AsyncRedisClient) -> None:
            runner = CommandRunner(client)
            for lock in list(self.locks.values()):  # a copy: the loop awaits
                if not lock.queued:
                    continue  # only light grants (released above): no wait, nothing in its stream
                freed = await adrive(release_consumer(lock.keys, lock.owner), runner, lock.name)
                if freed:
                    lifecycle_logger.debug(
                        "Freed %d late grant(s) of %r on close", freed, lock.name
                    )
                    if self.retire_on_close and isinstance(lock, AsyncCountingLock):
                        await adrive(lock.core.retire(), runner, lock.name)  # gone if unused

        results = await asyncio.gather(
            *(on(client) for client in self.clients), return_exceptions=True
        )
        errors = [result for result in results if isinstance(result, BaseException)]
        if len(errors) == len(results):
            raise errors[0]


__all__ = [
    "BOUND_TIMEOUT",
    "OWN_TIMEOUT",
    "LeaseRanOut",
    "SlotPermit",
    "StageLock",
    "StageLocks",
    "SystemEvents",
    "lease_end",
    "out_of_lease",
    "slot_id",
    "within_lease",
    "within_lease_at_start",
]
