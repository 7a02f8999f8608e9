"""StageScheduler: a capped request leaves the scheduler only when it can go, in the inner
scheduler's order.

Scrapy counts a request as active in the downloader before the middleware chain runs, and stops
pulling from the scheduler once CONCURRENT_REQUESTS are active: requests waiting in a middleware for
a full stage would starve every other stage (head-of-line blocking). This scheduler wraps the real
one (Scrapy's by default, or scrapy-redis's) and gives it sub-queues per capped stage
(:mod:`~scrapy_redislock.requests.stagequeue`): the requests of a stage that cannot take one more
stay in the inner scheduler, in its order, and the other stages' requests go past them.

- A capped stage can take a request when this process has a slot of it in hand: one passed on by a
  finished request of this process, or a grant to one of the waits its line keeps in Redis's
  first-come-first-served line across processes for the stage's queued requests (up to
  REDISLOCK_WAITERS_PER_STAGE; woken the moment a slot is freed anywhere; the engine is woken to
  take it). Until then the stage's requests wait in the inner scheduler and take none of
  CONCURRENT_REQUESTS. What a process holds out of the inner scheduler is its requests in flight
  (and over scrapy-redis the one fetched ahead); a shared scrapy-redis queue stays shared (the rest
  stays in Redis).
- Order: within a stage, the inner queue's own (priority, DEPTH_PRIORITY, callback requests before
  start requests, LIFO/FIFO); across the stages that can go, the highest priority first. With capped
  keys (REDISLOCK_STAGE_KEY with a key limit) the sub-queues are per stage and key, and a key at its
  limit in this process waits in the scheduler too (Scrapy's scheduler; over scrapy-redis keys wait
  in the middleware).
- A slot freed by a finished request of this process goes straight to the oldest request of its
  stage waiting in the middleware (one that bypassed this scheduler; its wait in Redis's line stays,
  for the next), else to the next queued request of its stage (kept for it by
  :class:`~scrapy_redislock.requests.requestslots.RequestSlots`):
  no Redis round trip; within REDISLOCK_LOCAL_REUSE seconds of Redis's grant, so that other
  processes waiting in Redis's line get their turn.
- A slot in hand that is lost or outlived its lease on this process's clock is dropped, never handed
  out (``StageLocks.usable``); a capped request that a middleware before StageLockMiddleware settles
  without a download (a fresh HTTPCACHE hit, a URL robots.txt forbids) is queued as uncapped, and
  goes without a slot.
- ``has_pending_requests()``, ``len()`` and the scheduler's stats are the inner scheduler's: a
  request waiting for a slot is pending, and is counted once.
- Over scrapy-redis's scheduler nothing blocks the reactor thread: its queue, dupefilter, open() and
  close() (redis-py's blocking client) run in one queue thread, in order
  (:class:`~scrapy_redislock.requests.stagequeue.QueueThread`); next_request() answers from one
  request fetched ahead, given back to its place in Redis at close; a request the dupefilter
  refuses gets Scrapy's request_dropped signal when the queue thread says so.

Another inner scheduler (not Scrapy's, not scrapy-redis's, nor a subclass: its queues cannot be
reached) is used as it is, said at INFO: each request leaves it in its order, and a capped one waits
for its slot in the downloader.

On close, unused slots are freed; the queued requests are the inner scheduler's (JOBDIR or
SCHEDULER_PERSIST keep them, unchanged), and so is every request that left it but never went out:
those held back for their key slot (:meth:`KeyLine.close
<scrapy_redislock.requests.keyline.KeyLine.close>`) and those waiting in the middleware when the
spider closes (for a key's slot over scrapy-redis; given back by :meth:`StageScheduler._give_back`,
before the inner scheduler closes). With REDISLOCK_ENABLED = False it is the inner scheduler
and nothing more; enabled with no stage in REDISLOCK_STAGES it is a ConfigError (nothing would be
capped).

Settings read (via :func:`scrapy_redislock.crawl.settings.read_settings`):
REDISLOCK_SCHEDULER_INNER, REDISLOCK_WAITERS_PER_STAGE, REDISLOCK_LOCAL_REUSE, REDISLOCK_ENABLED,
REDISLOCK_STAGES and the stage and key settings. Stats: those of the middleware, plus
redislock/<stage>/reused (slots passed on locally) and redislock/<stage>/unusable (slots dropped
before a request could start with them).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from scrapy import signals
from scrapy.core.scheduler import Scheduler as ScrapyScheduler
from scrapy.settings import SETTINGS_PRIORITIES
from scrapy.utils.defer import deferred_from_coro, maybe_deferred_to_future
from scrapy.utils.misc import build_from_crawler, load_object

from scrapy_redislock.crawl.early import MIDDLEWARE_PATH, middleware_configured
from scrapy_redislock.crawl.engine import (
    check_reactor,
    engine_closing,
    engine_of,
    one_line_config_errors,
    wake_engine,
)
from scrapy_redislock.crawl.inner import inner_name, load_inner_scheduler
from scrapy_redislock.crawl.reach import OUTAGE_ERRORS, REFUSED
from scrapy_redislock.crawl.settings import read_settings
from scrapy_redislock.crawl.stagelocks import StageLocks
from scrapy_redislock.errors import ConfigError
from scrapy_redislock.requests.admission import StageAdmission
from scrapy_redislock.requests.closewaits import CloseWaits
from scrapy_redislock.requests.keyline import InHand, KeyLine
from scrapy_redislock.requests.queueloss import WATCH_EVERY, QueueWatch, unqueued_at_close
from scrapy_redislock.requests.requestslots import RequestSlots
from scrapy_redislock.requests.stagequeue import (
    QueueThread,
    SharedStageQueues,
    StageQueueFactory,
    push_back,
    split_queues,
)
from scrapy_redislock.requests.throttle import ScopeThrottle

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from scrapy.settings import Settings
    from twisted.internet.defer import Deferred

    from scrapy_redislock.lock.core import Clock

logger = logging.getLogger(__name__)

SCRAPY_DUPEFILTER = "scrapy.dupefilters.RFPDupeFilter"
SCRAPY_REDIS_DUPEFILTER = "scrapy_redis.dupefilter.RFPDupeFilter"

__all__ = ["StageScheduler"]


def _build_inner(inner_cls: type, crawler: Crawler) -> Any:
    """The inner scheduler, built from the crawler; over scrapy-redis's scheduler, with
    scrapy-redis's dupefilter when DUPEFILTER_CLASS was left at Scrapy's default (see
    :func:`_scrapy_redis_settings`)."""
    settings = _scrapy_redis_settings(inner_cls, crawler.settings)
    if settings is None:
        return build_from_crawler(inner_cls, crawler)
    original = crawler.settings
    crawler.settings = settings  # only while scrapy-redis's from_crawler reads it
    try:
        return build_from_crawler(inner_cls, crawler)
    finally:
        crawler.settings = original


def _scrapy_redis_settings(inner_cls: type, settings: Settings) -> Settings | None:
    """Settings for scrapy-redis's scheduler as inner scheduler, None when they need no change.

    scrapy-redis's documented settings are ``SCHEDULER = "scrapy_redis.scheduler.Scheduler"`` and
    ``DUPEFILTER_CLASS = "scrapy_redis.dupefilter.RFPDupeFilter"``. With SCHEDULER being ours, a
    user who left DUPEFILTER_CLASS at Scrapy's default got ``AttributeError: type object
    'RFPDupeFilter' has no attribute 'from_settings'`` (Scrapy 2.19's filter has none), then
    ``RuntimeError: Engine slot not assigned``. Left at Scrapy's default (not set by the project,
    the spider or the command line), it is scrapy-redis's own, as its documentation says (a filter
    per process over a queue shared in Redis would let every process queue the same pages again);
    logged at INFO. Set to a class scrapy-redis cannot build (neither ``from_spider`` nor
    ``from_settings``): a ConfigError naming DUPEFILTER_CLASS and the value to use.
    """
    try:
        from scrapy_redis.scheduler import Scheduler as RedisScheduler
    except ImportError:
        return None
    if not (isinstance(inner_cls, type) and issubclass(inner_cls, RedisScheduler)):
        return None
    value = settings.get("DUPEFILTER_CLASS")
    try:
        dupefilter = load_object(value) if isinstance(value, str) else value
    except (ImportError, ValueError, NameError, AttributeError) as exc:
        raise ConfigError(f"DUPEFILTER_CLASS cannot be loaded: {value!r} ({exc})") from None
    left_default = (settings.getpriority("DUPEFILTER_CLASS") or 0) <= SETTINGS_PRIORITIES["default"]
    if dupefilter is load_object(SCRAPY_DUPEFILTER) and left_default:
        patched = settings.copy()
        patched.frozen = False  # a copy of the crawler's frozen settings is frozen too
        patched.set("DUPEFILTER_CLASS", SCRAPY_REDIS_DUPEFILTER, priority="default")
        patched.freeze()
        logger.info(
            "REDISLOCK_SCHEDULER_INNER is scrapy-redis's scheduler and DUPEFILTER_CLASS is Scrapy's default: it uses scrapy-redis's dupefilter (%s), as scrapy-redis's settings say (set DUPEFILTER_CLASS to choose another)",  # noqa: E501
            SCRAPY_REDIS_DUPEFILTER,
        )
        return patched
    if not (hasattr(dupefilter, "from_spider") or hasattr(dupefilter, "from_settings")):
        raise ConfigError(
            f"DUPEFILTER_CLASS = {value!r} cannot be used by scrapy-redis's scheduler (REDISLOCK_SCHEDULER_INNER = {settings.get('REDISLOCK_SCHEDULER_INNER')!r}): it builds its dupefilter with from_spider() or from_settings(), which this class lacks; use DUPEFILTER_CLASS = {SCRAPY_REDIS_DUPEFILTER!r}, as scrapy-redis's documentation says"  # noqa: E501
        )
    return None


class StageScheduler:
    """A scheduler whose capped requests leave it only when they can go, in the inner scheduler's
    order."""

    def __init__(self, crawler: Crawler, clock: Clock = time.monotonic) -> None:
        one_line_config_errors()  # a ConfigError below ends the crawl as one line, exit status 1
        self.crawler = crawler
        self.clock = clock  # monotonic seconds, for the parts it makes too (tests pass theirs)
        self.settings = read_settings(crawler.settings)
        inner_cls = load_inner_scheduler(self.settings.scheduler_inner, outer=StageScheduler)
        self.enabled = self.settings.enabled
        if self.enabled and not self.settings.stages and not self.settings.keyed:
            raise ConfigError(
                "StageScheduler is enabled but REDISLOCK_STAGES is empty, so no request would be capped; set REDISLOCK_STAGES = {stage: limit, ...}, or REDISLOCK_ENABLED = False to switch it off on purpose"  # noqa: E501
            )
        if self.enabled:
            check_reactor(crawler, "StageScheduler")
            if not middleware_configured(crawler):
                raise ConfigError(
                    f"SCHEDULER = 'scrapy_redislock.StageScheduler' needs the middleware too: DOWNLOADER_MIDDLEWARES = {{{MIDDLEWARE_PATH!r}: 950}}"  # noqa: E501
                )
        self.inner = _build_inner(inner_cls, crawler)
        # the request front's slots (and the kept ones for queued requests), over the crawler's locks
        self.slots = RequestSlots.of(crawler, self.settings, clock=clock) if self.enabled else None
        self.locks: StageLocks | None = self.slots.locks if self.slots is not None else None
        self.admission: StageAdmission | None = None
        # key slots got here for requests of no capped stage (over Scrapy's scheduler)
        self.keyline: KeyLine | None = None
        self.shared: SharedStageQueues | None = None  # over scrapy-redis's scheduler, from open()
        # over scrapy-redis's scheduler: where its blocking calls run while the reactor does
        self.queue_thread: QueueThread | None = None
        self.watch: QueueWatch | None = None  # notices a shared queue that Redis lost
        self.closing = False
        self.inner_closed = False  # requests can no longer be given back to it
        # gives scrapy-redis's dupefilter client its retries back (for its close; None: they are
        # its own): see _one_try
        self._every_try: Callable[[], None] | None = None
        # requests that left this scheduler (not those that bypassed it: media downloads)
        self.sent: weakref.WeakSet[Request] = weakref.WeakSet()
        self._wake_handle: asyncio.TimerHandle | None = None
        if self.slots is not None:
            self.admission = StageAdmission(crawler, self.settings, self.slots)
            # Scrapy's BaseScheduler makes isinstance() duck-typed: look for the class itself.
            if ScrapyScheduler in type(self.inner).__mro__ and not _is_scrapy_redis(self.inner):
                self.inner.pqclass = StageQueueFactory(self.inner.pqclass, self.admission)
                if self.settings.keys.capped:
                    self.keyline = self.admission.keyline = KeyLine(
                        crawler,
                        self.settings,
                        ScopeThrottle.of(crawler, self.settings, clock=clock),
                        self.inner,
                        self.slots,
                    )
                if self.settings.paced:
                    throttle = ScopeThrottle.of(crawler, self.settings, clock=clock)
                    self.admission.start_waits = throttle.start_waits
            elif not _is_scrapy_redis(self.inner):
                self.admission.queues_split = False
                logger.info(
                    "REDISLOCK_SCHEDULER_INNER = %r is neither Scrapy's scheduler nor scrapy-redis's (nor a subclass): StageScheduler cannot give it a queue per stage, so a capped request goes in its order and waits for its slot in the downloader (a full stage can then hold up the others)",  # noqa: E501
                    inner_name(self.settings.scheduler_inner),
                )
            self.slots.serve_scheduler(
                queued=self._queued, could_use=self._could_use, tick=self.tick, ready=self._ready
            )
            if ScrapyScheduler in type(self.inner).__mro__ or _is_scrapy_redis(self.inner):
                CloseWaits.of(crawler, self.settings).serve_scheduler(
                    self.sent.__contains__, self._give_back
                )
            if _is_scrapy_redis(self.inner):
                self.queue_thread = QueueThread()

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> StageScheduler:
        return cls(crawler)

    def __getattr__(self, name: str) -> Any:
        """Anything else is the inner scheduler's (scrapy-redis's ``queue``, ``df``, ``flush``,
        ...)."""
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """And so is setting it (scrapy-redis's ``persist``, ...), where the inner scheduler has it
        and we do not."""
        inner = self.__dict__.get("inner")
        if (
            inner is not None
            and name not in self.__dict__
            and not hasattr(type(self), name)
            and hasattr(inner, name)
        ):
            setattr(inner, name, value)
        else:
            super().__setattr__(name, value)

    # -- the scheduler interface -------------------------------------------------------------------

    def open(self, spider: Spider) -> Deferred[None] | None:
        if self.queue_thread is not None:
            # an engine's scheduler (a test may drive one synchronously, with a reactor running)
            self.queue_thread.engine = engine_of(self.crawler) is not None
        if self.queue_thread is not None and self.queue_thread.on_reactor():
            # scrapy-redis's open() reads the queue's length (and flushes it on
            # SCHEDULER_FLUSH_ON_START): in the queue thread
            return deferred_from_coro(self._open(self.queue_thread.run(self.inner.open, spider)))
        result = self.inner.open(spider) if hasattr(self.inner, "open") else None
        if self.locks is None:
            return result
        if result is None:
            self._share_queue()  # at once, as scrapy-redis's own open() does its work
            if self.shared is not None:
                self._resume()
        return deferred_from_coro(self._open(result))

    async def _open(self, inner_result: Any) -> None:
        if isinstance(inner_result, asyncio.Future):  # scrapy-redis's open() in the queue thread
            await inner_result
            self._share_queue()
            assert self.queue_thread is not None and self.shared is not None
            await self.queue_thread.run(self._resume)
        elif inner_result is not None:
            await maybe_deferred_to_future(inner_result)
            self._share_queue()
        assert self.slots is not None
        if self.watch is not None:
            await self.watch.look()  # the queue's epoch, to tell a loss from now on
        await self.slots.start()

    def _share_queue(self) -> None:
        """scrapy-redis's queue (made anew at each of its open()), split by capped stage in Redis
        (see
        :class:`SharedStageQueues`); nothing for other inner schedulers."""
        if not _is_scrapy_redis(self.inner) or self.inner.queue is self.shared:
            return
        base = self.inner.queue
        if self._every_try is None:  # once per open: a second would keep none of the retries
            self._every_try = _one_try(getattr(self.inner, "df", None))
        assert self.admission is not None
        capped = self.slots.stages if self.slots is not None else []
        self.shared = SharedStageQueues(
            base,
            capped,
            self.admission,
            prefix=self.settings.key_prefix,
            asked_while_paused=self._wake_later,
            thread=self.queue_thread,
            wake=self._wake,
            clock=self.clock,
            leftover=[stage for stage in self.settings.stages if stage not in capped],
        )
        self.inner.queue = self.shared
        self.shared.enqueue = self.inner.enqueue_request
        self.shared.on_held = self._hold
        self.shared.dropped = self._dropped
        self.shared.seen_again = self._seen_again
        self.watch = QueueWatch(
            self.crawler, self.shared, self.settings.key_prefix, clock=self.clock
        )
        self.shared.check = self.watch.look_now
        self.shared.lost = self.watch.unqueueable
        self.shared.unreadable = self.watch.unreadable
        self.shared.look = self.watch.look

    def _resume(self) -> None:
        """After scrapy-redis's open(), at once: the sub-queues flushed on SCHEDULER_FLUSH_ON_START,
        else the requests of capped stages said as scrapy-redis says its own."""
        assert self.shared is not None
        if getattr(self.inner, "flush_on_start", False):
            self.shared.clear()
        elif not len(self.shared.base):
            self._resuming(len(self.shared))

    def _resuming(self, queued: int) -> None:
        if queued:
            # scrapy-redis said so only for its own key: the requests of capped stages are in theirs
            # as scrapy-redis says it (its own tests expect spider.log, deprecated since Scrapy 2.13)
            self.inner.spider.log(f"Resuming crawl ({queued} requests scheduled)")

    def close(self, reason: str) -> Deferred[None] | None:
        """The inner scheduler closes at once (as it would alone: scrapy-redis flushes its queue
        here unless SCHEDULER_PERSIST); the slots are freed after."""
        if self.keyline is not None:
            self.keyline.close()  # requests held back for their key slot go back first (JOBDIR)
        self.inner_closed = True
        threaded = self.queue_thread is not None and self.queue_thread.on_reactor()
        result = None
        if self.shared is not None and not threaded:
            # before scrapy-redis's close (its flush): a request whose pop got no reply goes back
            unqueued_at_close(self.crawler, self.shared.close())
        if threaded:
            result = self._close_shared(reason)  # scrapy-redis's close() in the queue thread
        elif hasattr(self.inner, "close"):
            result = self._close_inner(reason)
        if self.locks is None:  # no shared queue either
            return None if asyncio.iscoroutine(result) else result
        self.closing = True
        if self._wake_handle is not None:
            self._wake_handle.cancel()
        if self.slots is not None:  # kept slots: freed with everything else by slots.close()
            self.slots.stand_down(release=False)
        return deferred_from_coro(self._close(result))

    async def _close_shared(self, reason: str) -> None:
        """The shared queue settles (the request fetched ahead back to its place in Redis, every
        request given to the queue thread pushed), then scrapy-redis's close() (its flush unless
        SCHEDULER_PERSIST), in the queue thread."""
        assert self.queue_thread is not None
        try:
            if self.shared is not None:
                await self.shared.settle()
            await self.queue_thread.run(self._close_inner, reason)
        finally:
            if self.shared is not None:
                unqueued_at_close(self.crawler, self.shared.close())
            self.queue_thread.close()

    def _close_inner(self, reason: str) -> Any:
        """scrapy-redis's close() (its flush unless SCHEDULER_PERSIST), with the dupefilter's client
        given its retries back; another inner scheduler's as it is."""
        if self._every_try is not None:
            self._every_try()
            self._every_try = None
        return self.inner.close(reason)

    async def _close(self, inner_result: Any) -> None:
        if asyncio.iscoroutine(inner_result):
            await inner_result
        elif inner_result is not None:
            await maybe_deferred_to_future(inner_result)
        assert self.slots is not None
        # unused slots, waits, anything a request left behind: one call per stage
        await self.slots.close()

    def _give_back(self, request: Request) -> bool:
        """A request that left but never went out (it waited for its slot in the middleware when the
        spider closed): back into the inner scheduler's queue, without its dupefilter (it was
        queued once already; counted as queued again, as its next pop counts), so that
        SCHEDULER_PERSIST (scrapy-redis's queue in Redis, its stage's part included) or JOBDIR
        (Scrapy's disk queues; memory for a request they cannot store, as Scrapy's scheduler does)
        keep it. False once the inner scheduler has closed."""
        if self.inner_closed:
            return False
        if _is_scrapy_redis(self.inner):
            if self.shared is not None:
                self.shared.give_back(request)  # in the queue thread while the reactor runs
            else:
                self.inner.queue.push(request)
            self.crawler.stats.inc_value(
                "scheduler/enqueued/redis"
            )  # as scrapy-redis counts a push
            return True
        push_back(self.inner, request)
        return True

    def has_pending_requests(self) -> bool:
        if self.shared is not None:
            return self.shared.has_requests()  # stops at the first sub-queue with a request
        if self.keyline is not None and self.keyline.pending():
            return True
        return bool(self.inner.has_pending_requests())

    def __len__(self) -> int:
        return len(self.inner) + (self.keyline.pending() if self.keyline is not None else 0)

    def enqueue_request(self, request: Request) -> bool:
        """Over scrapy-redis while the reactor runs, its enqueue_request (dupefilter, push) runs in
        the queue thread: True here, and a request its dupefilter refuses is dropped when it says so
        (Scrapy's request_dropped signal, as the engine sends it on False)."""
        start_waits = self.admission.start_waits if self.admission is not None else None
        if start_waits is not None:
            # back in the queue (a middleware before ours returned the request itself): it no
            # longer waits for its start, and must not keep its own names busy while queued
            start_waits.went_out(request)
        if self.shared is None:
            return bool(self.inner.enqueue_request(request))
        if self.queue_thread is not None and self.queue_thread.on_reactor():
            self.shared.schedule(request)
            return True
        try:
            return bool(self.inner.enqueue_request(request))
        except OUTAGE_ERRORS as exc:
            if isinstance(exc, REFUSED):
                raise
            self._hold(request, exc)
            return True

    def _hold(self, request: Request, exc: BaseException) -> None:
        """scrapy-redis's dupefilter did not answer (its queue's push is kept by SharedStageQueues):
        raised from enqueue_request, it ended a task of Scrapy's nobody awaits ("Task exception was
        never retrieved") and the request was lost; kept in memory instead."""
        assert self.shared is not None
        self.crawler.stats.inc_value("redislock/queue_held")
        self.shared.hold(request, exc)

    def _seen_again(self, request: Request) -> None:
        """A request held during an outage that scrapy-redis's dupefilter read as seen once Redis
        answered was queued all the same: said once, counted."""
        if not self.crawler.stats.get_value("redislock/queue_held_seen"):
            logger.info(
                "A request kept in memory while Redis did not answer reads as seen by scrapy-redis's dupefilter; queued all the same, since Redis may have recorded it and lost the reply: a duplicate may be fetched twice (redislock/queue_held_seen)"  # noqa: E501
            )
        self.crawler.stats.inc_value("redislock/queue_held_seen")

    def _dropped(self, request: Request) -> None:
        """scrapy-redis's dupefilter refused ``request``: the signal the engine sends for a request
        the scheduler did not take."""
        self.crawler.signals.send_catch_log(
            signals.request_dropped, request=request, spider=self.crawler.spider
        )

    def next_request(self) -> Request | None:
        request = self._next_request()
        if request is not None and self.locks is not None:
            self.sent.add(request)  # given back if it waits for a slot when the spider closes
        return request

    def _next_request(self) -> Request | None:
        if self.locks is None or self.admission is None:
            return self.inner.next_request()
        if self.keyline is not None:
            ready = self.keyline.next_ready()
            if ready is not None:
                return ready
        if self.keyline is not None:
            self.keyline.new_pass()
        while True:
            if self.keyline is not None and self.keyline.full():
                return None  # woken when a take in Redis comes back
            request = self.inner.next_request()  # from a sub-queue that its admission lets go
            if request is None:
                assert self.slots is not None
                if self.shared is None:
                    # no sub-queue could use them now (over scrapy-redis: maybe a fetch is under
                    # way, for which they are kept; the tick prunes them)
                    self.slots.kept.release_all()
                return None
            admission = self.admission
            if admission.start_waits is not None:
                # out of the inner scheduler (it may wait for its key's slots here first): its
                # delayed names' next requests stay queued (for a capped stage's request, its
                # stage's only: the stage's cap bounds the rest)
                capped = admission.route(request)[0] is not None
                admission.start_waits.leaving(request, capped=capped)
            going = self._hand_out(request)
            if going is not None:
                return going

    def _hand_out(self, request: Request) -> Request | None:
        """``request`` leaves: with the slots it needs that are got here (None while it waits for
        them, :mod:`~scrapy_redislock.requests.keyline`): of its capped stage, one kept for it (with
        none, it waits for one in the middleware's line); of its key and scopes, through the key
        line. Not a request a middleware before StageLockMiddleware answers (robots.txt, a cache:
        a capped one's cache entry was read when it was queued)."""
        assert self.admission is not None and self.slots is not None
        route = self.admission.route(request)
        stage = route[0]
        if stage is None and self.keyline is None:
            return request  # nothing to get here
        if self.admission.settled_early(request, cache=stage is None):
            return request
        in_hand: InHand | None = None
        if stage is not None:
            permit = self.slots.kept.take(stage)
            if permit is None:
                # no downloader to watch, or queues not split: it waits in the middleware
                return request
            waited = self.slots.kept.waited(stage)
            if isinstance(permit, BaseException):
                self.slots.hand(request, permit)  # a wait for the stage's queued requests ran out
                return request
            in_hand = InHand(stage, permit, route, waited)
        if self.keyline is not None:
            return None if self.keyline.holds_back(request, in_hand) else request
        if in_hand is not None:
            self.slots.hand(request, in_hand.permit)
            self.slots.locks.record_grant(in_hand.stage, in_hand.waited)
        return request

    # -- slots -------------------------------------------------------------------------------------

    def _ready(self) -> Collection[Request]:
        """Requests that got their key's slots here and wait for the engine's next ask; none once
        the key line stood down (the closing engine asks no more: the sweep frees their slots, and
        close() puts the requests back)."""
        return () if self.keyline is None or self.keyline.closed else self.keyline.ready

    def _queued(self, stage: str) -> int:
        """Requests of ``stage`` waiting in the inner scheduler (for the status CLI); 0 over
        scrapy-redis, where counting would cost a Redis command per stage."""
        return sum(queue.count(stage) for queue in split_queues(self.inner))

    def _could_use(self, stage: str) -> int:
        """How many slots in hand the queued requests of ``stage`` could use now (over scrapy-redis:
        1 while its queue was not found empty lately)."""
        if self.shared is not None:
            ahead = self.shared.ahead
            # the request fetched ahead waits for its stage's slot: a wait must be open for it
            return int(self.shared.may_have(stage) or (ahead is not None and ahead[0] == stage))
        return self._queued(stage)

    def _wake_later(self, delay: float) -> None:
        """The engine asked while every sub-queue worth asking was in its pause (an outage's
        back-off; without an engine, a sub-queue found empty): ask again when the first ends."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # driven without an event loop (scrapy-redis's own tests): it asks
            return
        if self._wake_handle is None and not self.closing:
            self._wake_handle = loop.call_later(max(delay, 0.0), self._woken)

    def _woken(self) -> None:
        self._wake_handle = None
        wake_engine(self.crawler)

    def _wake(self) -> None:
        """The shared queue has news (a request fetched, a stage's queue found empty, the queue
        read): slots kept for a stage found empty go back to Redis at once, and the engine asks
        again."""
        if not self.closing:
            assert self.slots is not None
            self.slots.kept.prune()
            wake_engine(self.crawler)

    def tick(self) -> None:
        """At every renewal round, in the front's upkeep (:meth:`RequestSlots.tick
        <scrapy_redislock.requests.requestslots.RequestSlots.tick>`, which prunes what is kept):
        stand down once the engine closes (unused slots back to Redis); else the shared queue's
        upkeep, the key line counts its load again, and the delayed names of requests dropped on
        their way let their next requests go."""
        assert self.slots is not None
        if self.inner_closed:  # the keys' registry outlives this scheduler until spider_closed
            return
        if engine_closing(self.crawler):
            self.closing = True
            self.slots.stand_down()
            if self.keyline is not None:
                self.keyline.stand_down()
            return
        if self.keyline is not None:
            self.keyline.tick()
        if self.admission is not None and self.admission.start_waits is not None:
            self.admission.start_waits.prune()  # requests dropped on their way to their start
        if self.shared is not None:
            self.shared.tick()
        if (
            self.shared is not None
            and self.watch is not None
            and (self.watch.epoch is None or self.clock() - self.watch.looked_at >= WATCH_EVERY)
        ):
            self.shared.look_soon()  # the watch for a lost queue


def _one_try(dupefilter: Any) -> Callable[[], None]:
    """scrapy-redis's dupefilter asks Redis once per request (SADD): with redis-py's own retry (on
    a timeout, with scrapy-redis's default REDIS_PARAMS), a try whose reply the network lost was
    sent again, read the fingerprint the first try had recorded as seen, and the request was dropped
    as a duplicate without a word. With one try the lost reply is an error, and the request is held
    and queued once Redis answers (redislock/queue_held, redislock/queue_held_seen).

    Returns what gives the client its retries back, for scrapy-redis's close: its DELETE of the
    dupefilter (SCHEDULER_PERSIST off) is safe to send again, and one a blip left behind would
    filter the next run's requests."""
    server = getattr(dupefilter, "server", None)
    return _tries_off(server)


def _tries_off(client: Any) -> Callable[[], None]:
    """Turn redis-py's own retries off on ``client`` (a cluster client's: its own and each node's);
    returns what turns them back on as they were."""
    if isinstance(client, redis.RedisCluster):
        nodes = [_tries_off(node.redis_connection) for node in client.get_nodes()]
        # redis-py 6 on: its count of tries (redis-py 5 has the attribute only when given one)
        retry, attempts = (
            getattr(client, "retry", None),
            getattr(client, "cluster_error_retry_attempts", None),
        )
        client.retry = Retry(NoBackoff(), 0)
        if attempts is not None:  # redis-py 5's
            setattr(client, "cluster_error_retry_attempts", 0)  # noqa: B010 (redis-py 5 only)

        def every_try() -> None:
            for node in nodes:
                node()
            client.retry = retry  # type: ignore[assignment]
            if attempts is not None:
                setattr(client, "cluster_error_retry_attempts", attempts)  # noqa: B010

        return every_try
    if isinstance(client, redis.Redis):
        # none: each connection made its own, one retry when told to retry on an error or a
        # timeout (redis-py 5's rule; from_url and Sentinel pass REDIS_PARAMS' retry_on_timeout)
        kwargs = client.get_connection_kwargs()
        retried = kwargs.get("retry_on_error") or kwargs.get("retry_on_timeout")
        before = client.get_retry() or Retry(NoBackoff(), 1 if retried else 0)
        client.set_retry(Retry(NoBackoff(), 0))
        return lambda: client.set_retry(before)
    return lambda: None


def _is_scrapy_redis(inner: Any) -> bool:
    try:
        from scrapy_redis.scheduler import Scheduler as RedisScheduler
    except ImportError:
        return False
    return isinstance(inner, RedisScheduler)
