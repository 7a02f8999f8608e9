"""StageWorkerScheduler: a worker takes requests only from the Redis queue of the stage whose slot
it holds.

Set as SCHEDULER by :class:`~scrapy_redislock.StageWorkerMixin`. This module is the Scrapy scheduler
interface only; the worker's parts live beside it, one job each:

- :mod:`~scrapy_redislock.workers.queue`: the stage queues in Redis and how a request is stored;
- :mod:`~scrapy_redislock.workers.outbox`: what callbacks yield, on its way to Redis, and duplicates;
- :mod:`~scrapy_redislock.workers.inflight`: what the worker popped, until Scrapy has handled it;
- :mod:`~scrapy_redislock.workers.state`: the stage it holds and what it saw, changed by named
  transitions;
- :mod:`~scrapy_redislock.workers.stageslot`: taking and leaving a stage, obeying its limit;
- :mod:`~scrapy_redislock.workers.heartbeat`: beats, the dead requeued, a lost crawl state;
- :mod:`~scrapy_redislock.workers.listener`: blocking in Redis until there is work;
- :mod:`~scrapy_redislock.workers.loop`: the steps that drive them;
- :mod:`~scrapy_redislock.workers.policy`: the pure decisions (which stage to take, what to wait
  for, when a worker is dead);
- :mod:`~scrapy_redislock.workers.feed`: scrapy-redis's start URLs.

A worker holds the slot of one stage at a time (an AsyncCountingLock named ``workers:<stage>``
capped by ``worker_stages``; an uncapped stage needs none) and pops only that stage's queue;
requests its callbacks yield go to their stage's queue, whichever worker holds that one. When its
stage has no work left it frees the slot and takes the first stage in preference order that has work
and a free slot; with no work anywhere it idles.

What a worker costs Redis does not grow with the number of workers. An idle worker blocks in Redis
(BLPOP) on the signal lists of the stages it may take, which the queue scripts push when a queue
goes from empty to non-empty, so it starts within milliseconds of work appearing; it sends one
heartbeat script every ttl/3 (which also names dead workers to requeue), one look at the queue
lengths and the cluster's in-flight counter, and one read of the start-URL feed. A busy worker pops
when the engine runs short of requests, not on a clock. The crawl's end is seen by every worker at
once: the ack that leaves nothing in flight anywhere and every queue empty puts a wake token for
each worker (see ``scripts/queue_ack.lua``).

A popped request stays in the worker's in-flight record in Redis until Scrapy has completely handled
it (the engine's in-progress set: download, redirects, callback or errback, and every request the
callback yielded queued in Redis); a worker that stops beating has its in-flight requests put back
at the front of their queues by the next worker to beat once its deadline has passed (each beat
promises the next within 5 s while the worker has work, within the ttl while it has none: see
policy.liveness). A request with no stage that a callback yields is fetched by this worker, but is
kept in its in-flight record too, together with its fingerprint (see
:mod:`~scrapy_redislock.workers.outbox`), and goes back to its home stage's queue like a popped one.
So a SIGKILL loses no request; the few the dead worker had in flight are fetched again within
seconds. Every Redis call is ``redis.asyncio`` on the reactor thread, nothing blocks
it.

A worker learns its stage's limit from its slot's renewals (see
:mod:`~scrapy_redislock.workers.stageslot`): when the limit is lowered under the stage's holders, or set
to 0 (paused), the newest holders give back what they took ahead, let what is in progress finish,
free the slot and take another stage or wait. A request handed to the engine goes with a
``download_timeout`` that ends before its slot's lease, as last confirmed, can run out, and while
that lease has less than a renewal interval left (its renewal did not come: Redis out of reach, a
stall) nothing taken ahead is handed out: cut off from Redis, a worker is never in flight at the site
past its slot (:func:`~scrapy_redislock.crawl.stagelocks.within_lease`).

Settings read (via :mod:`scrapy_redislock.crawl.settings`): REDISLOCK_WORKER_STAGES (or the spider's
``worker_stages``), REDISLOCK_STAGE_PREFERENCE (or the spider's ``stage_preference``),
REDISLOCK_IDLE_CLOSE (else the spider's ``max_idle_time``, else scrapy-redis's
MAX_IDLE_TIME_BEFORE_CLOSE: see
:func:`~scrapy_redislock.workers.policy.idle_close_for`), REDISLOCK_TTL, REDISLOCK_KEY_PREFIX,
REDISLOCK_URL; scrapy-redis's SCHEDULER_PERSIST, SCHEDULER_FLUSH_ON_START, REDIS_START_URLS_AS_SET /
_AS_ZSET, SCHEDULER_SERIALIZER (the request format: by default
:mod:`~scrapy_redislock.crawl.requestformat`, which cannot run code on load). Read here:
scrapy-redis's SCHEDULER_QUEUE_CLASS (the order of the stage queues:
:func:`~scrapy_redislock.workers.queue.queue_order`), Scrapy's CONCURRENT_REQUESTS (how many
requests a worker takes ahead), DOWNLOAD_TIMEOUT (a request's own, which its slot's lease may
shorten); DUPEFILTER_DEBUG is read by the outbox. Stats:
``redislock/workers/<stage>/{enqueued,duplicates,dequeued,taken,lost}``,
``redislock/workers/{requeued,returned,start_urls,start_urls_unusable,unqueueable,unqueued,unknown_stage,dead_letters,redis_errors,queue_lost,leftover_dupefilter_cleared}``,
and Scrapy's ``dupefilter/filtered``. Finish reasons beside Scrapy's: ``redislock_queue_lost`` (also
for a request Redis or the request format refused, or that never reached Redis before the close),
``redislock_unknown_stage``, ``redislock_all_filtered``, ``redislock_start_urls_lost``.

A duplicate is dropped as Scrapy's and scrapy-redis's schedulers drop one: ``enqueue_request``
returns False (the engine sends ``request_dropped``) for a request whose fingerprint this worker
already sent to the shared dupefilter (the last
:data:`~scrapy_redislock.workers.outbox.KNOWN_FINGERPRINTS` of them are kept in memory); one that
only the shared dupefilter knows (another worker queued it) is found when the batch reaches Redis,
and the scheduler sends ``request_dropped`` itself then.

Redis going away is not an error: an outage or failover is one WARNING per outage and one INFO when
Redis answers again, every call retried with back-off. Redis coming back *empty* is: the queues'
epoch key tells a lost crawl state from being taken for dead, and a worker that knew of work logs
one ERROR, counts ``queue_lost`` and finishes its idle close as ``redislock_queue_lost``. A paused
or full stage's queue is work: no idle close, no clear. A dupefilter an earlier crawl left (no work
queued or in flight, no worker alive) is cleared at start without SCHEDULER_PERSIST (that crawl was
killed before its close), said at WARNING; kept with it, and a run it filters entirely finishes as
``redislock_all_filtered``, exit status 1 (:meth:`StageWorkerScheduler._leftover_dupefilter`).

A queued entry that cannot be loaded (garbage, a pickle payload, a truncated entry, a ``_class`` or
callback that is not what ``to_dict`` makes) is logged once with its queue and a short escaped
excerpt, counted, and moved to the spider's dead-letter list (``redislock status`` shows it); a
request that does not fit the format is refused when it is queued, naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from scrapy import Request
from scrapy.core.scheduler import BaseScheduler
from scrapy.utils.defer import deferred_from_coro

from scrapy_redislock._loop import every
from scrapy_redislock._redis import Backoff
from scrapy_redislock.crawl.engine import at_download_start, check_reactor, finish_uncleanly
from scrapy_redislock.crawl.reach import REDIS_ERRORS
from scrapy_redislock.crawl.settings import read_settings, read_worker_settings
from scrapy_redislock.crawl.stagelocks import (
    StageLocks,
    lease_end,
    out_of_lease,
    say_downloads_cut,
    within_lease,
    within_lease_at_start,
)
from scrapy_redislock.crawl.stages import stage_of
from scrapy_redislock.errors import ConfigError
from scrapy_redislock.workers.feed import StartUrlFeed
from scrapy_redislock.workers.heartbeat import Heartbeat
from scrapy_redislock.workers.inflight import InFlight
from scrapy_redislock.workers.listener import SignalListener
from scrapy_redislock.workers.loop import WorkerLoop
from scrapy_redislock.workers.outage import OutageLog
from scrapy_redislock.workers.outbox import Outbox
from scrapy_redislock.workers.policy import StagePolicy, idle_close_for, liveness
from scrapy_redislock.workers.queue import StageQueues, encode, queue_order
from scrapy_redislock.workers.stageslot import StageSlot
from scrapy_redislock.workers.state import WorkerState

if TYPE_CHECKING:
    from scrapy import Spider
    from scrapy.crawler import Crawler
    from twisted.internet.defer import Deferred

    from scrapy_redislock.crawl.settings import RedisLockSettings
    from scrapy_redislock.lock.core import Clock
    from scrapy_redislock.lock.permit import Permit

logger = logging.getLogger(__name__)

CLOSE_STEP_TIMEOUT = 10.0


async def _cancelled(tasks: set[asyncio.Task[Any]]) -> None:
    """Cancel what is left of ``tasks`` and let it end (a second at most)."""
    left = {task for task in tasks if not task.done()}
    for task in left:
        task.cancel()
    if left:
        await asyncio.wait(left, timeout=1.0)


def worker_stages(crawler: Crawler, settings: RedisLockSettings) -> dict[str, int | None]:
    """The spider's worker stages (stage -> max workers), checked: the worker front needs one Redis."""
    if settings.redis.masters:
        raise ConfigError(
            f"REDISLOCK_URL lists {len(settings.redis.masters)} masters: the worker front needs one Redis (its queues live there); a list of masters is for the request front's quorum lock"  # noqa: E501
        )
    stages = dict(settings.worker_stages)
    if not stages:
        raise ConfigError(
            f"{crawler.spidercls.__name__} needs worker_stages (a dict stage -> max workers cluster-wide, None = unlimited) or REDISLOCK_WORKER_STAGES"  # noqa: E501
        )
    return stages


class StageWorkerScheduler(BaseScheduler):
    """The scheduler of a StageWorkerMixin spider (see the module docstring)."""

    def __init__(self, crawler: Crawler, clock: Clock = time.monotonic) -> None:
        """``clock``: monotonic seconds, the one every part of the worker reads (unit tests pass a
        fake one)."""
        self.crawler = crawler
        self.clock = clock
        settings = read_settings(crawler.settings)  # the mixin put the spider's worker_stages there
        stages = worker_stages(crawler, settings)
        self.policy = StagePolicy.of(stages, settings.stage_preference)
        self.stages = stages
        self.settings = settings
        self.worker_settings = read_worker_settings(crawler.settings, settings)
        # of the stage queues
        self.order = queue_order(crawler.settings.get("SCHEDULER_QUEUE_CLASS"))
        check_reactor(crawler, "StageWorkerMixin")
        # open() decides with the spider's max_idle_time
        self.idle_close_by = (
            "REDISLOCK_IDLE_CLOSE"
            if settings.idle_close is not None
            else "MAX_IDLE_TIME_BEFORE_CLOSE"
        )
        self.locks = StageLocks(
            crawler, self.settings, stages, lock_prefix="workers:", stats_prefix="redislock/workers"
        )
        queues = self.queues = StageQueues(
            self.locks.client,
            crawler.spidercls.name,
            stages,
            key_prefix=settings.key_prefix,
            ttl=settings.ttl,
            order=self.order,
        )
        queues.work_grace = liveness(settings.ttl, working=True).grace  # what a pop promises
        self.worker = queues.worker
        self.state = state = WorkerState(stages, clock)
        self.outage = OutageLog(
            self.worker,
            on_failure=lambda: self.stats.inc_value("redislock/workers/redis_errors"),
            on_back=self._redis_back,
            clock=clock,
        )
        self.outbox = Outbox(
            crawler, queues, self.outage, on_queued=self._queued, on_kept=self._kept
        )
        self.inflight = InFlight(
            crawler,
            queues,
            state,
            self.outbox,
            self.outage,
            concurrency=max(1, crawler.settings.getint("CONCURRENT_REQUESTS")),
            serializer=self.worker_settings.serializer,
            order=self.order,
            schemes=settings.allowed_schemes,
        )
        self.heartbeat = Heartbeat(
            crawler,
            queues,
            state,
            self.inflight,
            self.outbox,
            ttl=settings.ttl,
            requeue=self.enqueue_request,
            clock=clock,
        )
        self.slot = StageSlot(crawler, self.locks, state, self.inflight, self.heartbeat, clock)
        self.listener = SignalListener(queues, state, self.policy, self.heartbeat.beats, clock)
        parts = (state, self.inflight, self.outbox, self.heartbeat, self.slot, self.listener)
        self.loop = WorkerLoop(crawler, settings, self.policy, queues, parts, self.outage, clock)
        self.loop.idle_close = self.worker_settings.idle_close
        self.loop_task: asyncio.Task[None] | None = None
        self.warned_memory_only = False
        self.spider: Spider | None = None
        # fingerprints of a dupefilter kept from an earlier crawl, found at start (0: none)
        self.leftover = 0
        self.said_all_filtered = False
        self.download_timeout = crawler.settings.getfloat("DOWNLOAD_TIMEOUT", 180)
        if any(limit is not None for limit in stages.values()):
            say_downloads_cut(settings.ttl, self.download_timeout)
        # requests handed out under a stage's slot, not yet started: bounded by its lease again as
        # their download starts
        self._leases: weakref.WeakKeyDictionary[Request, Permit] = weakref.WeakKeyDictionary()

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> StageWorkerScheduler:
        return cls(crawler)

    @property
    def stats(self) -> Any:
        return self.crawler.stats

    @property
    def current(self) -> str | None:
        """The stage this worker works on."""
        return self.state.current

    @property
    def idle_close(self) -> float | None:
        return self.loop.idle_close

    def _queued(self, stage: str) -> None:
        """A request reached its stage's queue: if that is this worker's own, drained stage, pop it
        when the engine asks."""
        self.state.queued_again(stage)

    def _kept(self, count: int) -> None:
        """Requests with no stage entered this worker's in-flight record."""
        self.inflight.own += count

    def _redis_back(self) -> None:
        """A retried call got an answer after an outage: the loop need not wait out its back-off."""
        self.loop.retry_at = 0.0
        self.state.wake()

    # -- the scheduler interface ----------------------------------------------------------------

    def open(self, spider: Spider) -> Deferred[None]:
        self.spider = spider
        max_idle_time = getattr(spider, "max_idle_time", None)
        self.loop.idle_close, self.idle_close_by = idle_close_for(
            self.settings.idle_close, max_idle_time, self.worker_settings.idle_close
        )
        return deferred_from_coro(self._open())

    async def _open(self) -> None:
        if not await self.locks.start_once():
            return  # Redis unreachable or refusing us: logged, and the spider_opened signal closes the spider
        self.locks.join_renewal()
        at_download_start(self.crawler, self._at_download_start)
        self.listener.feed = StartUrlFeed(
            self.queues,
            self.spider,
            self.worker_settings.start_urls_as,
            self.inflight.concurrency,
        )
        if self.worker_settings.flush_on_start:
            if await self.queues.clear_if_alone():
                logger.info("SCHEDULER_FLUSH_ON_START: flushed the queues (no other worker alive)")
            else:
                logger.info("SCHEDULER_FLUSH_ON_START: other workers are alive, nothing flushed")
        else:
            await self._leftover_dupefilter()
        await self.heartbeat.beat(None)
        idle_close = self.loop.idle_close
        idle = "never" if idle_close is None else f"after {idle_close:g} s with no work anywhere"
        logger.info(
            "Worker %s: stages %s (preference %s), queues under %s in %s order (SCHEDULER_QUEUE_CLASS); idle close: %s (%s)",  # noqa: E501
            self.worker,
            self.stages,
            list(self.policy.preference),
            self.queues.keys.base,
            self.order,
            idle,
            self.idle_close_by,
        )
        wakeup = self.state.opened()  # the first look at once
        loop = every(
            self.loop.interval, self.loop.step, what="Worker loop", wake=wakeup, backoff=Backoff()
        )
        self.loop_task = asyncio.get_running_loop().create_task(loop)

    def close(self, reason: str) -> Deferred[None]:
        return deferred_from_coro(self._close())

    async def _close(self) -> None:
        """Hand back what this worker holds; every step is bounded, so a close never hangs."""
        self.state.begin_close()
        if not self.locks.started:  # it never got to Redis: nothing to hand back
            await self.locks.close()
            return
        self.listener.cancel()
        if self.loop_task is not None:
            self.state.wake()
            done, _ = await asyncio.wait({self.loop_task}, timeout=CLOSE_STEP_TIMEOUT)
            if not done:  # a Redis call that hangs: cut it off
                await _cancelled({self.loop_task})
        outbox, inflight = self.outbox, self.inflight
        await self._last_pushes()
        await self._give_back_start_urls()
        inflight.ack_finished()  # the engine waited for its in-progress requests: everything handed out is done
        if inflight.tasks:
            await self._bounded(
                "acknowledging the last requests", asyncio.wait(set(inflight.tasks))
            )
            # not acknowledged: those requests stay in the record, and go back to their queue below
            await _cancelled(inflight.tasks)
        memory_only = sum(1 for _, inflight_id in outbox.local if inflight_id is None)
        if memory_only:
            logger.warning(
                "Closing with %d requests that name no stage unfetched and that the request format could not store in Redis; they are lost",  # noqa: E501
                memory_only,
            )
        # Whatever is still in the in-flight record was popped (or, with no stage, kept) but never
        # started: back to the front of its queue.
        moved = await self._bounded(
            "giving back this worker's unstarted requests", self.queues.leave()
        )
        if moved:
            self.stats.inc_value("redislock/workers/returned", moved)
        inflight.buffer.clear()
        outbox.local.clear()
        if not self.worker_settings.persist:
            await self._clear_if_finished()
        await self._bounded("closing the waiting connection", self.queues.aclose())
        await self._bounded("freeing the stage slot", self.locks.close())

    async def _last_pushes(self) -> None:
        """What callbacks and start requests put in the outbox reaches Redis, or is said lost: an
        ERROR, counted, and the crawl does not finish cleanly. The sends still under way when the
        bounded wait ends are cancelled, so that none writes to Redis after close has moved on."""
        outbox = self.outbox
        if not outbox.pushes:
            return
        with contextlib.suppress(TimeoutError):  # what is left is cancelled and said below
            await asyncio.wait_for(outbox.sent(), CLOSE_STEP_TIMEOUT)
        unsent = outbox.unsent()
        await _cancelled(outbox.pushes)
        if not unsent:
            return
        outbox.losses += 1  # the requests handed out before stay in the record
        self.stats.inc_value("redislock/workers/unqueued", unsent)
        logger.error(
            "Closing: %d request(s) yielded by callbacks or start requests may not have reached Redis, which did not answer within %g s: they are lost (redislock/workers/unqueued), and the crawl will finish as redislock_queue_lost (exit status 1). The requests of this worker that may have yielded them go back to their queue, and the start URLs of the last take to the feed, if Redis answers",  # noqa: E501
            unsent,
            CLOSE_STEP_TIMEOUT,
        )
        finish_uncleanly(self.crawler, "redislock_queue_lost", lambda: None)

    async def _give_back_start_urls(self) -> None:
        """The start URLs of a take whose reply never came, or whose requests may not all have
        reached their queues (a send lost requests since the take), go back to the feed (and this
        worker's record of its last take goes). If Redis does not answer, they are lost to this
        crawl: said at ERROR, counted, and the crawl does not finish cleanly."""
        feed = self.listener.feed
        if feed is None or not feed.enabled:
            return
        if feed.pending is not None and self.outbox.losses == feed.losses_before:
            feed.landed()  # its requests all went (the loop's step was cut off after)
        unanswered = feed.unanswered or feed.pending is not None
        try:
            moved = await asyncio.wait_for(feed.give_back(), CLOSE_STEP_TIMEOUT)
        except (TimeoutError, *REDIS_ERRORS) as exc:
            if not unanswered:
                logger.debug(
                    "On close, dropping the record of the last start-URL take failed: %s", exc
                )
                return
            logger.error(
                "Closing: a take of up to %d start URLs from %s that got no reply, or whose requests may not have reached Redis, could not be given back: Redis did not answer (%s); they may be lost to this run: whatever the take kept is in %s for a day, push it to %s again",  # noqa: E501
                feed.batch,
                feed.key,
                str(exc) or "timeout",
                feed.record,
                feed.key,
            )
            self.stats.inc_value("redislock/workers/start_urls_unreturned")
            finish_uncleanly(self.crawler, "redislock_start_urls_lost", lambda: None)
            return
        if moved:
            logger.info(
                "Closing: %d start URL(s) of a take that got no reply, or whose requests may not have reached Redis, went back to %s",  # noqa: E501
                moved,
                feed.key,
            )
            self.stats.inc_value("redislock/workers/start_urls_returned", moved)

    async def _bounded(self, what: str, step: Coroutine[Any, Any, Any] | Any) -> Any:
        try:
            return await asyncio.wait_for(step, CLOSE_STEP_TIMEOUT)
        except (TimeoutError, *REDIS_ERRORS) as exc:
            logger.warning(
                "On close, %s failed (%s); the other workers recover it after the TTL",
                what,
                str(exc) or "timeout",
            )
            return None

    def has_pending_requests(self) -> bool:
        return bool(self.inflight.buffer or self.outbox.local or self.outbox.pushes)

    def __len__(self) -> int:
        return len(self.inflight.buffer) + len(self.outbox.local)

    def enqueue_request(self, request: Request) -> bool:
        """Queue in Redis, asynchronously (one script call per batch). False for a duplicate this
        worker already sent to the shared dupefilter, as Scrapy's and scrapy-redis's schedulers
        return for one their dupefilter filters (the engine sends ``request_dropped``); a duplicate
        only Redis knows of is found when the batch reaches it (the outbox sends
        ``request_dropped`` then)."""
        stage = stage_of(request, self.settings, self.spider)
        fingerprint = (
            None if request.dont_filter else self.crawler.request_fingerprinter.fingerprint(request)
        )
        outbox = self.outbox
        if outbox.is_known(fingerprint):
            outbox.filtered(request, stage)
            return False
        hex_fingerprint = "" if fingerprint is None else fingerprint.hex()
        if stage is None:
            # this worker fetches it, but it is in Redis with its fingerprint: a SIGKILL loses none
            home = self.state.current or self.policy.preference[0]
            try:
                data = self.encode(request)
            except Exception as exc:  # the format's refusal, or a SCHEDULER_SERIALIZER's
                data = b""
                self._memory_only(request, exc)
            outbox.know(fingerprint)
            outbox.keep_local(
                (home, hex_fingerprint, self.queues.mark(request.priority), data, request)
            )
            return True
        if stage not in self.stages:
            self.stats.inc_value("redislock/workers/unknown_stage")
            logger.error(
                "Dropped %s: stage %r is not one of the worker stages %s; the crawl will finish as redislock_unknown_stage (exit status 1)",  # noqa: E501
                request,
                stage,
                list(self.stages),
            )
            finish_uncleanly(self.crawler, "redislock_unknown_stage", lambda: None)
            return False
        try:
            data = self.encode(request)
        except Exception as exc:  # the format's refusal, or whatever a SCHEDULER_SERIALIZER raises
            self.stats.inc_value("redislock/workers/unqueueable")
            logger.error(
                "Refused %s: it cannot be queued in Redis: %s. The request is lost, and the crawl will finish as redislock_queue_lost (exit status 1)",  # noqa: E501
                request,
                exc,
            )
            finish_uncleanly(self.crawler, "redislock_queue_lost", lambda: None)
            return False
        outbox.know(fingerprint)
        outbox.put((stage, hex_fingerprint, data, request.priority, request))
        return True

    def _memory_only(self, request: Request, exc: Exception) -> None:
        """A request with no stage that the request format cannot store: fetched by this worker
        from memory alone (as before issue 39), so a SIGKILL of this worker loses it; said once at
        WARNING, each one at DEBUG, counted."""
        self.stats.inc_value("redislock/workers/no_stage/memory_only")
        level = logging.DEBUG if self.warned_memory_only else logging.WARNING
        self.warned_memory_only = True
        logger.log(
            level,
            "%s names no stage and cannot be stored in Redis (%s): this worker fetches it from memory only, and loses it if it is killed first (give it a callback the request format can store, or a stage); further ones at DEBUG, counted in redislock/workers/no_stage/memory_only",  # noqa: E501
            request,
            exc,
        )

    def encode(self, request: Request) -> bytes:
        """The request as its queue stores it (SCHEDULER_SERIALIZER, by default the safe JSON
        format)."""
        return encode(request, self.worker_settings.serializer, self.spider)

    def next_request(self) -> Request | None:
        inflight = self.inflight
        inflight.ack_finished()
        local = self.outbox.local
        # what is handed next is in the in-flight record (a request with no stage goes first)
        recorded = local[0][1] is not None if local else bool(inflight.buffer)
        if recorded and self.heartbeat.beats.stalled(self.clock()):
            # No beat for most of what the last one promised (this process stalled): the others may
            # have requeued what we took ahead, and the requests with no stage in our in-flight
            # record. Hand none out until the next beat says whether they did (then the buffer is
            # dropped); one kept in memory only is nobody else's.
            self.state.wake()
            return None
        if local:
            unstaged = inflight.hand_unstaged()
            if unstaged is not None:
                out_of_lease(unstaged)  # a bound copied with another request's meta goes
            return unstaged
        permit, now = self.state.permit, self.clock()
        if (
            inflight.buffer
            and permit is not None
            and not permit.usable(now + self.locks.renew_interval)
        ):
            # The stage's slot was not renewed in time (Redis out of reach, a stall): another worker
            # may hold it soon. Start nothing more of the stage; the slot's renewal, or its loss,
            # decides what happens to what was taken ahead (StageSlot.check_lost gives it back).
            self.state.wake()
            return None
        request = inflight.hand()
        if (
            request is not None
            and permit is not None
            and stage_of(request, self.settings, self.spider) == self.state.current
        ):
            # its download ends before the slot's lease, as last confirmed, can run out (one of an
            # uncapped stage taken before this worker moved up to a capped one is not bounded: it
            # has no cap to break, and the capped slot's loss is not its own)
            within_lease(request, self._lease_left(permit, now), self.download_timeout)
            self._leases[request] = permit
        elif request is not None:
            out_of_lease(request)  # a bound copied with another request's meta goes
        if self.state.current is not None and len(inflight.buffer) < inflight.concurrency:
            # Top up before the buffer runs dry, or leave a drained stage. Without a stage the
            # engine's polls cost Redis nothing: the worker waits in Redis for a signal.
            self.state.wake()
        return request

    def _at_download_start(self, request: Request) -> None:
        """As a download starts, after its downloader slot's queue and delay: bounded again by its
        stage slot's lease as now confirmed. One that ran out meanwhile (this worker cut off from
        Redis) is cut at once, not sent while the slot may be another worker's."""
        permit = self._leases.pop(request, None)
        if permit is not None:
            left = self._lease_left(permit, self.clock())
            within_lease_at_start(request, left, self.download_timeout)

    def _lease_left(self, permit: Permit, now: float) -> float:
        """What is left at ``now`` of ``permit``'s lease, as last confirmed, less half a renewal
        interval (nothing once a renewal found the slot lost): a download bounded by it ends before
        Redis can give the slot to another."""
        return lease_end(permit, self.locks.renew_interval) - now

    def may_close(self) -> bool:
        """For the spider's idle handler: no work anywhere in the cluster for REDISLOCK_IDLE_CLOSE
        seconds."""
        return self.loop.may_close()

    @property
    def close_reason(self) -> str | None:
        """The finish reason of an idle close (the mixin's idle handler): ``redislock_queue_lost``
        once Redis lost the crawl state while this worker knew of work
        (:meth:`~scrapy_redislock.workers.heartbeat.Heartbeat.queues_lost`);
        ``redislock_all_filtered`` when a dupefilter kept from an earlier crawl filtered all this
        run was given and it fetched nothing; None: Scrapy's own (``finished``)."""
        if self.heartbeat.lost:
            return "redislock_queue_lost"
        return "redislock_all_filtered" if self._all_filtered() else None

    async def _leftover_dupefilter(self) -> None:
        """At start, before this worker's first beat: a dupefilter with no queued or in-flight work
        and no other worker alive is what an earlier crawl left. With SCHEDULER_PERSIST = False its
        last worker would have cleared it at close, had it closed cleanly (a SIGKILL, a second
        Ctrl-C): cleared now, said at WARNING. Kept (SCHEDULER_PERSIST = True): said at WARNING, and
        remembered, so that a run it filters entirely does not finish as a clean ``finished``
        (:meth:`close_reason`)."""
        try:
            found = await self.queues.dupefilter_size()
            if not found:
                return
            persist = self.worker_settings.persist
            if await self.queues.clear_if_finished(dry=persist) != 1:
                return  # other workers alive, or work left: the dupefilter is that crawl's
        except REDIS_ERRORS as exc:
            logger.warning("Could not look for a dupefilter left by an earlier crawl: %s", exc)
            return
        spider = self.crawler.spidercls.name
        if not persist:
            self.stats.set_value("redislock/workers/leftover_dupefilter_cleared", found)
            logger.warning(
                "Worker %s: found the dupefilter of an earlier crawl of spider %r (%d fingerprints) with no queued or in-flight work and no worker alive: that crawl did not close cleanly (killed, or stopped twice), else its last worker would have cleared it (SCHEDULER_PERSIST = False). Cleared it, with the rest of that crawl's state, so that this run's requests are not filtered as duplicates of its pages",  # noqa: E501
                self.worker,
                spider,
                found,
            )
            return
        self.leftover = found
        logger.warning(
            "Worker %s: the dupefilter of an earlier crawl of spider %r is kept (SCHEDULER_PERSIST = True, %d fingerprints; no queued or in-flight work, no worker alive): this run's requests for pages that crawl fetched are filtered as duplicates. To crawl them again, start with SCHEDULER_FLUSH_ON_START = True",  # noqa: E501
            self.worker,
            spider,
            found,
        )

    def _all_filtered(self) -> bool:
        """This run found a kept dupefilter at start, fetched nothing and filtered what it was
        given: said at WARNING, and the crawl finishes as ``redislock_all_filtered`` with exit
        status 1, not as a clean ``finished``."""
        stats = self.stats
        filtered = int(stats.get_value("dupefilter/filtered", 0) or 0)
        if not self.leftover or stats.get_value("response_received_count") or not filtered:
            return False
        if not self.said_all_filtered:
            self.said_all_filtered = True
            logger.warning(
                "Worker %s fetched nothing: the %d request(s) it was given were all filtered as duplicates by the dupefilter kept from an earlier crawl (%d fingerprints at start, SCHEDULER_PERSIST = True); the crawl finishes as redislock_all_filtered. Start with SCHEDULER_FLUSH_ON_START = True to crawl those pages again",  # noqa: E501
                self.worker,
                filtered,
                self.leftover,
            )
            finish_uncleanly(self.crawler, "redislock_all_filtered", lambda: None)
        return True

    async def _clear_if_finished(self) -> None:
        """SCHEDULER_PERSIST = False at close: the last worker out clears the crawl state, but only
        a finished crawl. While any stage holds work (a paused one too) or anything is in flight,
        nothing is deleted."""
        cleared = await self._bounded("clearing the queues", self.queues.clear_if_finished())
        if cleared == 1:
            logger.info(
                "SCHEDULER_PERSIST is False and this was the last worker: cleared the queues"
            )
        elif cleared == -1:
            logger.warning(
                "SCHEDULER_PERSIST is False and this was the last worker, but work is left in Redis (queued in a stage, a paused one included, or in flight): the queues are kept for the next worker (SCHEDULER_FLUSH_ON_START = True starts afresh)"  # noqa: E501
            )


__all__ = ["StageWorkerScheduler"]
