"""StageWorkerScheduler: a worker takes requests only from the Redis queue of the stage whose slot
it holds.

Set as SCHEDULER by :class:`~scrapy_redislock.StageWorkerMixin`. This module is the Scrapy scheduler
interface and the worker's loop; the parts live beside it: :mod:`~scrapy_redislock.workers.queue`
(the stage queues in Redis and how a request is stored), :mod:`~scrapy_redislock.workers.policy`
(which stage to take, what to wait for) and
:mod:`~scrapy_redislock.workers.feed` (scrapy-redis's start URLs).

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
policy.liveness). So a SIGKILL loses no request; the few the dead worker had in flight are fetched
again within seconds. Every Redis call is ``redis.asyncio`` on the reactor thread, nothing blocks
it.

A worker learns its stage's limit from its slot's renewals (see
:mod:`~scrapy_redislock.workers.slots`): when the limit is lowered under the stage's holders, or set
to 0 (paused), the newest holders give back what they took ahead, let what is in progress finish,
free the slot and take another stage or wait.

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
requests a worker takes ahead) and DUPEFILTER_DEBUG (how duplicates are logged, as Scrapy's
dupefilter logs them). Stats:
``redislock/workers/<stage>/{enqueued,duplicates,dequeued,taken,lost}``,
``redislock/workers/{requeued,returned,start_urls,unqueueable,dead_letters,redis_errors,queue_lost}``,
and Scrapy's ``dupefilter/filtered``.

A duplicate is dropped as Scrapy's and scrapy-redis's schedulers drop one: ``enqueue_request``
returns False (the engine sends ``request_dropped``) for a request whose fingerprint this worker
already sent to the shared dupefilter (the last :data:`KNOWN_FINGERPRINTS` of them are kept in
memory); one that only the shared dupefilter knows (another worker queued it) is found when the
batch reaches Redis, and the scheduler sends ``request_dropped`` itself then.

Redis going away is not an error: an outage or failover is one WARNING per outage and one INFO when
Redis answers again, every call retried with back-off. Redis coming back *empty* is: the queues'
epoch key tells a lost crawl state from being taken for dead, and a worker that knew of work logs
one ERROR, counts ``queue_lost`` and finishes its idle close as ``redislock_queue_lost``. A paused
or full stage's queue is work: no idle close, no clear.

A queued entry that cannot be loaded (garbage, a pickle payload, a truncated entry, a ``_class`` or
callback that is not what ``to_dict`` makes) is logged once with its queue and a short escaped
excerpt, counted, and moved to the spider's dead-letter list (``redislock status`` shows it); a
request that does not fit the format is refused when it is queued, naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, cast

import redis.exceptions
from scrapy import Request, signals
from scrapy.core.scheduler import BaseScheduler
from scrapy.utils.defer import deferred_from_coro

from scrapy_redislock._loop import every
from scrapy_redislock._redis import Backoff
from scrapy_redislock.crawl.engine import check_reactor, in_progress, wake_engine
from scrapy_redislock.crawl.reach import OUTAGE_ERRORS, REDIS_ERRORS, REFUSED
from scrapy_redislock.crawl.settings import read_settings, read_worker_settings
from scrapy_redislock.crawl.stages import stage_of
from scrapy_redislock.errors import ConfigError
from scrapy_redislock.workers.feed import StartUrlFeed
from scrapy_redislock.workers.outage import OutageLog
from scrapy_redislock.workers.policy import (
    StagePolicy,
    idle_close_for,
    keeps_slot,
    keeps_streak,
    liveness,
    may_reap,
    next_wake,
)
from scrapy_redislock.workers.queue import StageQueues, decode, encode, queue_order
from scrapy_redislock.workers.slots import WorkerSlots

if TYPE_CHECKING:
    from scrapy import Spider
    from scrapy.crawler import Crawler
    from twisted.internet.defer import Deferred

    from scrapy_redislock.lock.core import Permit

logger = logging.getLogger(__name__)

CLOSE_STEP_TIMEOUT = 10.0
PUSH_BATCH = 500  # requests per queue_push call
EXCERPT = 60  # bytes of an entry that cannot be loaded shown in the log and in the dead-letter note
BEAT_MARGIN = 0.01  # seconds a blocked wait lasts past the due heartbeat (Redis's timeouts count whole milliseconds)
# seconds the loop waits past a due heartbeat for the blocked wait to end (a fallback)
WAIT_GRACE = 1.0
# Fingerprints a worker keeps of what it sent to the shared dupefilter, to drop a duplicate of them
# at once (enqueue_request returns False); the oldest are forgotten (a duplicate of those is found
# in Redis instead).
KNOWN_FINGERPRINTS = 100_000


class StageWorkerScheduler(BaseScheduler):
    """The scheduler of a StageWorkerMixin spider (see the module docstring)."""

    def __init__(self, crawler: Crawler) -> None:
        self.crawler = crawler
        settings = read_settings(crawler.settings)  # the mixin put the spider's worker_stages there
        if settings.masters:
            raise ConfigError(
                f"REDISLOCK_URL lists {len(settings.masters)} masters: the worker front needs one "
                "Redis (its queues "
                "live there); a list of masters is for the request front's quorum lock"
            )
        stages = dict(settings.worker_stages)
        if not stages:
            raise ConfigError(
                f"{crawler.spidercls.__name__} needs worker_stages (a dict stage -> max workers "
                "cluster-wide, None "
                "= unlimited) or REDISLOCK_WORKER_STAGES"
            )
        self.policy = StagePolicy.of(stages, settings.stage_preference)
        self.preference = list(self.policy.preference)
        self.stages = stages
        self.settings = settings
        self.worker_settings = read_worker_settings(crawler.settings, settings)
        # of the stage queues
        self.order = queue_order(crawler.settings.get("SCHEDULER_QUEUE_CLASS"))
        check_reactor(crawler, "StageWorkerMixin")
        # open() decides with the spider's max_idle_time
        self.idle_close = self.worker_settings.idle_close
        self.idle_close_by = (
            "REDISLOCK_IDLE_CLOSE"
            if settings.idle_close is not None
            else "MAX_IDLE_TIME_BEFORE_CLOSE"
        )
        self.serializer = self.worker_settings.serializer
        self.locks = WorkerSlots(
            crawler, self.settings, stages, lock_prefix="workers:", stats_prefix="redislock/workers"
        )
        self.locks.on_limit = self._limit_seen
        self.queues = StageQueues(
            self.locks.client,
            crawler.spidercls.name,
            stages,
            key_prefix=settings.key_prefix,
            ttl=settings.ttl,
            order=self.order,
        )
        self.queues.work_grace = liveness(settings.ttl, working=True).grace  # what a pop promises
        self.worker = self.queues.worker
        self.concurrency = max(1, crawler.settings.getint("CONCURRENT_REQUESTS"))
        # popped from Redis, not handed to the engine yet
        self.buffer: deque[tuple[Request, str]] = deque()
        self.handed: dict[Request, str] = {}  # handed to the engine, not acked yet -> in-flight id
        self.local: deque[Request] = deque()  # requests that name no stage: this worker's own
        self.current: str | None = None
        self.permit: Permit | None = None
        self.lengths: dict[str, int] = dict.fromkeys(stages, 0)
        self.empty: set[str] = set()  # stages whose queue this worker last found empty
        # capped stages with work whose slots were all taken at the last look
        self.full: set[str] = set()
        # stages whose signal token this worker took: pass it on when popping
        self.signalled: set[str] = set()
        # requests in this worker's in-flight record in Redis (part of the cluster's counter)
        self.own = 0
        self.start_stages: set[str] = set()  # stages that start URLs from Redis went to
        self.feed: StartUrlFeed | None = None
        self.fed: list[Any] = []  # start-URL entries a blocked wait took, to turn into requests
        # (stage, fingerprint, serialized request, priority, request) to queue in Redis
        self.outbox: deque[tuple[str, str, bytes, int, Request]] = deque()
        # fingerprints sent to the shared dupefilter, oldest first (bounded)
        self.known: dict[bytes, None] = {}
        self.dupefilter_debug = crawler.settings.getbool("DUPEFILTER_DEBUG")
        # the first duplicate is logged (DEBUG), the others only with DUPEFILTER_DEBUG
        self.log_dupes = True
        # stages whose sorted set a FIFO or LIFO worker found work in (warned)
        self.mixed_orders: set[str] = set()
        self.flusher: asyncio.Task[Any] | None = None
        self.pushes: set[asyncio.Task[Any]] = set()
        self.tasks: set[asyncio.Task[Any]] = set()
        # in-flight ids of finished requests, acknowledged together after ACK_DELAY
        self.acks: list[str] = []
        # in-flight ids in an ack call (or whose ack Redis refused: kept till close)
        self.acking: set[str] = set()
        self.acker: asyncio.Task[None] | None = None
        self.listener: asyncio.Task[None] | None = None
        self.listening: list[str] = []  # the keys the running listener blocks on
        self.busy_at = time.monotonic()
        self.failing = False  # the last loop step met a Redis error: never idle-close on what could not be read
        # the cluster was found idle at the last look (for REDISLOCK_IDLE_CLOSE)
        self.quiet_since: float | None = None
        self.look_due = True  # look at the queues at the next step without a stage: woken, beat, or a stage left
        self.beat_at = time.monotonic()  # when the last beat that reached Redis was sent
        self.beat_due = 0.0
        # the next pulse of a worker with work (a beat at least every second: see policy)
        self.pulse_due = 0.0
        # the silence its last beat promised not to exceed (else it is dead)
        self.grace = settings.ttl
        self.pulse_interval = settings.ttl / 3  # the interval its last beat set for the next one
        # since when its beats reach Redis without a gap (for reaping)
        self.streak_since: float | None = None
        self.replied_at = 0.0  # when the last beat's reply came
        self.leaving = False  # its capped stage is over its limit: finish what is in progress, then free the slot
        # (limit, grant) its slot was last checked against
        self.limit_checked: tuple[int, str] | None = None
        # when it took its stage (a limit reported before then is not the stage's now)
        self.taken_at = 0.0
        self.loop_task: asyncio.Task[None] | None = None
        self.wakeup: asyncio.Event | None = None
        self.closing = False
        self.spider: Spider | None = None
        # Pauses, restarts and outages of Redis (see _queues_lost, _outage_step, may_close):
        self.work_seen = False  # the last look found work somewhere (queued, paused or full stages too; in flight)
        # the queues' epoch this worker saw (changes only when the crawl state is gone)
        self.epoch: str | None = None
        self.lost = False  # Redis lost the crawl state while this worker knew of work: close as redislock_queue_lost
        # one WARNING per outage, one INFO when Redis answers again
        self.outage = OutageLog(self.worker)
        self.retry_at = 0.0  # after a failed step: the loop's next try (its own back-off, logged once per outage)
        self.retry_backoff = Backoff()

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> StageWorkerScheduler:
        return cls(crawler)

    @property
    def stats(self) -> Any:
        return self.crawler.stats

    @property
    def beat_interval(self) -> float:
        return self.settings.ttl / 3

    # -- the scheduler interface ----------------------------------------------------------------

    def open(self, spider: Spider) -> Deferred[None]:
        self.spider = spider
        max_idle_time = getattr(spider, "max_idle_time", None)
        self.idle_close, self.idle_close_by = idle_close_for(
            self.settings.idle_close, max_idle_time, self.worker_settings.idle_close
        )
        return deferred_from_coro(self._open())

    async def _open(self) -> None:
        if not await self.locks.start_once():
            return  # Redis unreachable or refusing us: logged, and the spider_opened signal closes the spider
        self.feed = StartUrlFeed(
            self.queues.client, self.spider, self.worker_settings.start_urls_as, self.concurrency
        )
        if self.worker_settings.flush_on_start:
            if await self.queues.clear_if_alone():
                logger.info("SCHEDULER_FLUSH_ON_START: flushed the queues (no other worker alive)")
            else:
                logger.info("SCHEDULER_FLUSH_ON_START: other workers are alive, nothing flushed")
        await self._beat(None)
        idle = (
            "never"
            if self.idle_close is None
            else f"after {self.idle_close:g} s with no work anywhere"
        )
        logger.info(
            "Worker %s: stages %s (preference %s), queues under %s in %s order "
            "(SCHEDULER_QUEUE_CLASS); idle close: "
            "%s (%s)",
            self.worker,
            self.stages,
            self.preference,
            self.queues.keys.base,
            self.order,
            idle,
            self.idle_close_by,
        )
        self.busy_at = time.monotonic()
        self.wakeup = asyncio.Event()
        self.wakeup.set()  # the first look at once
        loop = every(
            self._interval, self._step, what="Worker loop", wake=self.wakeup, backoff=Backoff()
        )
        self.loop_task = asyncio.get_running_loop().create_task(loop)

    def close(self, reason: str) -> Deferred[None]:
        return deferred_from_coro(self._close())

    async def _close(self) -> None:
        """Hand back what this worker holds; every step is bounded, so a close never hangs."""
        self.closing = True
        if not self.locks.started:  # it never got to Redis: nothing to hand back
            await self.locks.close()
            return
        if self.listener is not None:
            self.listener.cancel()
        if self.loop_task is not None:
            assert self.wakeup is not None
            self.wakeup.set()
            done, _ = await asyncio.wait({self.loop_task}, timeout=CLOSE_STEP_TIMEOUT)
            if not done:  # a Redis call that hangs: cut it off
                self.loop_task.cancel()
                await asyncio.wait({self.loop_task}, timeout=1.0)
        if self.pushes:
            await self._bounded("queueing the last requests", asyncio.wait(set(self.pushes)))
            if self.outbox:
                logger.error(
                    "Closing: %d requests yielded by callbacks never reached Redis",
                    len(self.outbox),
                )
        self._ack_finished()  # the engine waited for its in-progress requests: everything handed out is done
        if self.tasks:
            await self._bounded("acknowledging the last requests", asyncio.wait(set(self.tasks)))
        if self.local:
            logger.warning(
                "Closing with %d requests that name no stage unfetched; they are lost",
                len(self.local),
            )
        # Whatever is still in the in-flight record was popped but never started: back to the front
        # of its queue.
        moved = await self._bounded(
            "giving back this worker's unstarted requests", self.queues.leave()
        )
        if moved:
            self.stats.inc_value("redislock/workers/returned", moved)
        self.buffer.clear()
        if not self.worker_settings.persist:
            await self._clear_if_finished()
        await self._bounded("closing the waiting connection", self.queues.aclose())
        await self._bounded("freeing the stage slot", self.locks.close())

    async def _bounded(self, what: str, step: Coroutine[Any, Any, Any] | Any) -> Any:
        try:
            return await asyncio.wait_for(step, CLOSE_STEP_TIMEOUT)
        except (TimeoutError, *REDIS_ERRORS) as exc:
            logger.warning(
                "On close, %s failed (%s); the other workers recover it after the TTL",
                what,
                exc or "timeout",
            )
            return None

    def has_pending_requests(self) -> bool:
        return bool(self.buffer or self.local or self.pushes)

    def __len__(self) -> int:
        return len(self.buffer) + len(self.local)

    def enqueue_request(self, request: Request) -> bool:
        """Queue in Redis, asynchronously (one script call per batch). False for a duplicate this
        worker already sent to the shared dupefilter, as Scrapy's and scrapy-redis's schedulers
        return for one their dupefilter filters (the engine sends ``request_dropped``); a duplicate
        only Redis knows of is found when the batch reaches it (:meth:`_dropped` sends
        ``request_dropped`` then)."""
        stage = stage_of(request, self.settings, self.spider)
        fingerprint = (
            None if request.dont_filter else self.crawler.request_fingerprinter.fingerprint(request)
        )
        if fingerprint is not None and fingerprint in self.known:
            self._filtered(request, stage)
            return False
        hex_fingerprint = "" if fingerprint is None else fingerprint.hex()
        if stage is None:
            self._know(fingerprint)
            self._push_task(self._keep_local(request, hex_fingerprint))
            return True
        if stage not in self.stages:
            self.stats.inc_value("redislock/workers/unknown_stage")
            logger.error(
                "Dropped %s: stage %r is not one of the worker stages %s",
                request,
                stage,
                list(self.stages),
            )
            return False
        try:
            data = self.encode(request)
        except Exception as exc:  # the format's refusal, or whatever a SCHEDULER_SERIALIZER raises
            self.stats.inc_value("redislock/workers/unqueueable")
            logger.error("Refused %s: it cannot be queued in Redis: %s", request, exc)
            return False
        self._know(fingerprint)
        self.outbox.append((stage, hex_fingerprint, data, request.priority, request))
        # one task sends everything enqueued meanwhile, in one script call per batch
        if self.flusher is None:
            self.flusher = self._push_task(self._flush())
        return True

    def _know(self, fingerprint: bytes | None) -> None:
        """Remember a fingerprint sent to the shared dupefilter (the newest KNOWN_FINGERPRINTS of
        them)."""
        if fingerprint is None:
            return
        self.known[fingerprint] = None
        if len(self.known) > KNOWN_FINGERPRINTS:
            del self.known[next(iter(self.known))]

    def _filtered(self, request: Request, stage: str | None) -> None:
        """A duplicate: counted and logged as Scrapy's dupefilter does (``df.log``: the first one at
        DEBUG, every one with DUPEFILTER_DEBUG), and in the stage's ``duplicates``."""
        self.stats.inc_value("dupefilter/filtered")
        self.stats.inc_value(
            f"redislock/workers/{stage if stage is not None else 'no_stage'}/duplicates"
        )
        if self.dupefilter_debug:
            referer = request.headers.get("Referer")
            logger.debug(
                "Filtered duplicate request: %(request)s (referer: %(referer)s)",
                {
                    "request": request,
                    "referer": referer.decode("utf-8", "replace") if referer else None,
                },
            )
        elif self.log_dupes:
            logger.debug(
                "Filtered duplicate request: %(request)s - no more duplicates will be shown (see "
                "DUPEFILTER_DEBUG to "
                "show all duplicates)",
                {"request": request},
            )
            self.log_dupes = False

    def _dropped(self, request: Request, stage: str | None) -> None:
        """A duplicate found in Redis after ``enqueue_request`` returned True: filtered, and
        ``request_dropped`` sent as the engine sends it for a request the scheduler refuses."""
        self._filtered(request, stage)
        self.crawler.signals.send_catch_log(
            signal=signals.request_dropped, request=request, spider=self.spider
        )

    def encode(self, request: Request) -> bytes:
        """The request as its queue stores it (SCHEDULER_SERIALIZER, by default the safe JSON
        format)."""
        return encode(request, self.serializer, self.spider)

    def next_request(self) -> Request | None:
        self._ack_finished()
        if self.local:
            return self.local.popleft()
        request = None
        if self.buffer and time.monotonic() - self.beat_at > 0.8 * self.grace:
            # No beat for most of what the last one promised (this process stalled): the others may
            # have requeued what we took ahead. Hand nothing out until the next beat says whether
            # they did (then the buffer is dropped).
            self._wake()
            return None
        if self.buffer:
            request, inflight_id = self.buffer.popleft()
            self.handed[request] = inflight_id
        if self.current is not None and len(self.buffer) < self.concurrency:
            # Top up before the buffer runs dry, or leave a drained stage. Without a stage the
            # engine's polls cost Redis nothing: the worker waits in Redis for a signal.
            self._wake()
        return request

    def may_close(self) -> bool:
        """For the spider's idle handler: no work anywhere in the cluster for REDISLOCK_IDLE_CLOSE
        seconds."""
        # Redis cannot be asked (down, failing over): the queues may well hold work
        if self.failing:
            return False
        # work somewhere, paused or full: wait for it, never close
        if self.work_seen or self.current is not None:
            return False
        return self.idle_close is not None and time.monotonic() - self.busy_at >= self.idle_close

    def _wake(self) -> None:
        if self.wakeup is not None:
            self.wakeup.set()

    # -- requests in and out of Redis --------------------------------------------------------------

    def _push_task(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.pushes.add(task)
        task.add_done_callback(self.pushes.discard)
        return task

    async def _retrying(self, what: str, call: Any) -> Any:
        """Retry a call until Redis answers: a request yielded by a callback must not be dropped."""
        backoff = Backoff()
        while True:
            try:
                result = await call()
            # down, or failing over: one warning per outage (OutageLog)
            except OUTAGE_ERRORS as exc:
                self.stats.inc_value("redislock/workers/redis_errors")
                delay = backoff.next()
                self.outage.failed(what, exc, delay)
                await asyncio.sleep(delay)
                continue
            # the end of an outage: the loop need not wait out its own back-off
            if self.outage.down:
                self.retry_at = 0.0
                self._wake()
            self.outage.answered()
            return result

    async def _flush(self) -> None:
        """Queue the outbox in Redis, PUSH_BATCH requests per script call, until it stays empty."""
        try:
            await asyncio.sleep(0)  # let the rest of a callback's output join this batch
            while self.outbox:
                batch = [self.outbox.popleft() for _ in range(min(PUSH_BATCH, len(self.outbox)))]
                entries = [
                    (stage, fingerprint, data, priority)
                    for stage, fingerprint, data, priority, _ in batch
                ]
                try:
                    queued = await self._retrying(
                        "Queueing requests", lambda e=entries: self.queues.push_many(e)
                    )
                # not an outage: Redis refused them (e.g. out of memory)
                except redis.exceptions.RedisError as exc:
                    self.stats.inc_value("redislock/workers/unqueueable", len(batch))
                    logger.error(
                        "Dropped %d requests: Redis refused to queue them (%s)", len(batch), exc
                    )
                    for (
                        _,
                        fingerprint,
                        _,
                        _,
                        _,
                    ) in batch:  # Redis may not have them: not known duplicates here
                        self.known.pop(bytes.fromhex(fingerprint), None)
                    continue
                for (stage, _, _, _, request), new in zip(batch, queued, strict=True):
                    if not new:
                        self._dropped(request, stage)
                        continue
                    self.stats.inc_value(f"redislock/workers/{stage}/enqueued")
                    if stage == self.current and stage in self.empty:
                        # our own stage has work again: pop it when the engine asks
                        self.empty.discard(stage)
                        self._wake()
        finally:
            self.flusher = None

    async def _keep_local(self, request: Request, fingerprint: str) -> None:
        if fingerprint and await self._retrying(
            "Checking the dupefilter", lambda: self.queues.seen(fingerprint)
        ):
            self._dropped(request, None)
            return
        self.local.append(request)
        wake_engine(self.crawler)

    def _ack_finished(self) -> None:
        """Drop from the in-flight record every handed-out request the engine has completely
        handled."""
        if not self.handed:
            return
        unfinished = in_progress(self.crawler) or set()
        done = [request for request in self.handed if request not in unfinished]
        if done:
            self.acks += [self.handed.pop(request) for request in done]
            if self.acker is None or self.acker.done():
                self.acker = asyncio.get_running_loop().create_task(self._ack_soon())
                self.tasks.add(self.acker)
                self.acker.add_done_callback(self._acked)

    def _acked(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        self._wake()  # the last ack of a drained stage: leave it now

    async def _ack_soon(self) -> None:
        """One script call for the requests finished meanwhile. Not later than that: a finished
        request still in the in-flight record when its worker dies would be fetched again."""
        await asyncio.sleep(0)  # the other requests finished in this loop iteration join
        while self.acks:
            ids, self.acks = self.acks, []
            self.acking.update(ids)
            await self._ack(ids, set(self.pushes))

    async def _ack(self, ids: list[str], pushes: set[asyncio.Task[Any]]) -> None:
        # what the callbacks yielded is in Redis before their parents leave the in-flight record
        if pushes:
            await asyncio.wait(pushes)
        try:
            dropped = await self._retrying("Acknowledging requests", lambda: self.queues.ack(ids))
            self.own -= dropped  # not "self.own -= await ...": that reads self.own before the await
            self.acking.difference_update(ids)
        # they stay in the record: requeued (fetched again) at close
        except redis.exceptions.RedisError as exc:
            logger.error("Could not acknowledge %d requests (%s)", len(ids), exc)

    # -- the worker loop: one step when woken (the engine wants requests, a signal, an ack), else at
    # the beat ------

    def _interval(self) -> float:
        if self.closing:
            return 0.0
        if self.retry_at > time.monotonic():  # a step failed in an outage: its back-off first
            return self.retry_at - time.monotonic()
        beat_due = self.beat_due
        if self.listener is not None and not self.listener.done():
            beat_due += WAIT_GRACE  # the blocked wait ends at the beat and wakes the loop; this is a fallback
        if self._working():
            beat_due = min(beat_due, self.pulse_due)
        return next_wake(time.monotonic(), beat_due, self.quiet_since, self.idle_close)

    async def _step(self) -> bool:
        if self.closing:
            return False
        if time.monotonic() < self.retry_at:  # woken during the back-off of an outage: wait it out
            return True
        try:
            now = time.monotonic()
            if now >= self.beat_due:
                self.look_due = True  # at each heartbeat (a token lost on the way is found so)
                await self._beat_and_reap()
            elif now >= self.pulse_due and self._working():
                await self._pulse()
            if self.quiet_since is not None and self.idle_close is not None:
                # still quiet? then close
                self.look_due |= now >= self.quiet_since + self.idle_close
            await self._check_lost()
            await self._check_limit()
            self._ack_finished()
            if self.fed:
                await self._feed(self.fed)
            if self.current is not None:
                await self._work()
            if self.current is None and self.look_due and not self.closing:
                await self._look()
            self._listen()
        except REDIS_ERRORS as exc:
            self.stats.inc_value("redislock/workers/redis_errors")
            self.failing = True
            # the others may not reach Redis either: reap nobody until beats run again
            self.streak_since = None
            if not self._outage_step(exc):
                raise  # not an outage (Redis refused a command): logged with its traceback by the loop, retried
            return not self.closing
        # Redis answers again: idle time counts from now, not from before the outage
        if self.failing:
            self.failing = False
            self.busy_at = time.monotonic()
            self._outage_over()
        return not self.closing

    async def _work(self) -> None:
        """On a stage: pop when the engine runs short; leave the stage once it is drained here and
        in Redis."""
        stage = self.current
        assert stage is not None
        if self.leaving:
            await self._finish_leaving(stage)
            return
        woken = stage in self.signalled
        if woken:
            self.signalled.discard(stage)
            self.empty.discard(stage)
        if stage not in self.empty:
            await self._fill(pass_on=woken)
            if stage in self.empty and stage in self.start_stages:
                await self._feed(None)  # its queue ran empty: the start URLs may have more for it
        if (
            self.current == stage
            and stage in self.empty
            and not (self.buffer or self.handed or self.tasks)
        ):
            await self._leave_stage()

    async def _look(self) -> None:
        """With no stage: read the feed, look at every queue and the cluster's in-flight counter,
        take a stage."""
        self.look_due = False
        await self._feed(None)
        self.lengths, in_flight = await self.queues.look()
        self.empty = {stage for stage, n in self.lengths.items() if not n}
        self.full = set()
        for stage in self.policy.to_try(None, self.lengths):
            if await self._take(stage):
                await self._fill(pass_on=stage in self.signalled)
                break
            self.full.add(stage)
        for stage in self.signalled & self.full:
            # a token for a stage with no free slot: its holders' (they may wait)
            await self.queues.signal(stage)
        self.signalled.clear()
        busy = any(self.lengths.values()) or self.buffer or self.handed or self.local or self.pushes
        # a paused stage's queue is work: wait, never close
        self.work_seen = bool(busy or in_flight > self.own)
        if busy or in_flight > self.own:
            self.busy_at = time.monotonic()
            self.quiet_since = None
            return
        # look again when it has been quiet for REDISLOCK_IDLE_CLOSE
        self.quiet_since = self.busy_at
        if self.may_close():
            # the engine's idle check (every 5 s) closes the spider from here
            self.quiet_since = None
            # the engine checks for idleness at its next round, not in 5 s
            wake_engine(self.crawler)

    async def _move_up(self) -> None:
        """From an uncapped stage, take a preferred capped stage that has work and a free slot (at
        each beat).

        Requests of the uncapped stage already taken finish here (no cap to break); no new ones are
        taken.
        """
        current = self.current
        if current is None or current in self.policy.capped or current == self.preference[0]:
            return
        self.lengths, _ = await self.queues.look()
        has_work_here = bool(self.buffer or self.handed)
        for stage in self.policy.to_try(current, self.lengths, has_work_here):
            if await self._take(stage):
                return

    # -- blocking in Redis until there is work -----------------------------------------------------

    def _listen_keys(self) -> list[str]:
        if self.closing:
            return []
        stages = self.policy.listens_to(self.current, self.empty, self.full, leaving=self.leaving)
        if not stages:
            return []
        keys = [self.queues.keys.signal(stage) for stage in stages] + [self.queues.keys.wake]
        feed_key = self.feed.blocking_key if self.feed is not None else None
        return [*keys, feed_key] if feed_key else keys

    def _listen(self) -> None:
        """Block in Redis (in a task) on the signal lists the policy names, unless a wait on them
        already runs."""
        keys = self._listen_keys()
        running = self.listener is not None and not self.listener.done()
        if running and (keys == self.listening or not keys):
            return  # a wait no longer needed ends at its timeout; a token it takes meanwhile is handled or put back
        if running:
            assert self.listener is not None
            self.listener.cancel()  # a stage change: the old wait's keys are stale (costs a reconnect)
        self.listening = keys
        self.listener = None
        if keys:
            self.listener = asyncio.get_running_loop().create_task(self._wait_for_work(keys))

    async def _wait_for_work(self, keys: list[str]) -> None:
        """Block until a token or entry arrives, or until the heartbeat is due; then wake the loop
        (one BLPOP per heartbeat period while nothing happens)."""
        queue_keys = self.queues.keys
        try:
            # Just past the beat: a wait that ended a moment before it would find nothing due and
            # wait again.
            reply = await self.queues.wait_signal(
                keys, max(0.0, self.beat_due - time.monotonic()) + BEAT_MARGIN
            )
        except REDIS_ERRORS as exc:
            # Not woken: the loop's next step (at the beat, or after its back-off) waits again.
            logger.debug(
                "Waiting for work: Redis error (%s); the loop waits again at its next step", exc
            )
            # the others may not reach Redis either: reap nobody until beats run again
            self.streak_since = None
            return
        if reply is not None:
            key, value = reply
            self.look_due = True
            if key == queue_keys.wake:
                self.busy_at = time.monotonic()  # the crawl has just ended: idle from now
            elif self.feed is not None and key == self.feed.key:
                self.fed.append(value)
            else:
                stage = next(s for s in self.stages if queue_keys.signal(s) == key)
                if self.current is not None and stage != self.current:
                    with contextlib.suppress(*REDIS_ERRORS):
                        await self.queues.signal(stage)  # not for us any more: the next worker's
                else:
                    self.signalled.add(stage)
        self._wake()

    # -- heartbeat, stage slots --------------------------------------------------------------------

    async def _beat(self, stage: str | None, pulse: bool = False) -> list[str]:
        sent = time.monotonic()
        plan = liveness(self.settings.ttl, self._working(stage))
        new, holds, dead = await self.queues.heartbeat(stage, grace=plan.grace, pulse=pulse)
        self._beaten(sent, plan.interval, plan.grace)
        self.beat_at = sent
        if not pulse:
            self.beat_due = sent + self.beat_interval
        # Redis lost the crawl state: not taken for dead (see _queues_lost)
        if new and await self._queues_lost():
            new = False
        if not new and not pulse and holds > len(known := self._known_ids()):
            await self._reclaim(known)
        if new and self.own:
            # Silent for a TTL (a stall: CPU starvation, a debugger, SIGSTOP, a long blocking call):
            # the others put this worker's in-flight requests back in the queues. The unstarted ones
            # are dropped here; the ones already in the engine (downloads, at most
            # CONCURRENT_REQUESTS, and responses waiting for their callback) get fetched twice.
            dropped = len(self.buffer)
            self.buffer.clear()
            self.stats.inc_value("redislock/workers/presumed_dead")
            logger.warning(
                "Worker %s was silent for the TTL and taken for dead: dropped %d requests taken "
                "ahead (the others "
                "have them), %d in progress here may get fetched twice",
                self.worker,
                dropped,
                len(self.handed),
            )
        if new:
            self.own = 0
        return dead

    def _known_ids(self) -> list[str]:
        """The in-flight ids this worker knows it holds: taken ahead, in the engine, finished and
        being acked."""
        return [
            *(inflight_id for _, inflight_id in self.buffer),
            *self.handed.values(),
            *self.acks,
            *self.acking,
        ]

    async def _reclaim(self, known: list[str]) -> None:
        """The in-flight record holds more than this worker knows of: a pop ran in Redis but its
        reply was lost (a connection cut, a failover; a cluster client may also have run it again).
        Those requests go back to the front of their queues, for whichever worker comes first."""
        moved = await self.queues.reclaim(known)
        if moved:
            self.stats.inc_value("redislock/workers/reclaimed", moved)
            logger.warning(
                "Worker %s put %d requests back in their queues: popped by a call whose reply was "
                "lost",
                self.worker,
                moved,
            )
            self.empty.clear()
            self.look_due = True

    async def _beat_and_reap(self) -> None:
        dead = await self._beat(self.current)
        await self._reap(dead)
        await self._read_limit_unseen()
        await self._move_up()

    # -- liveness (pulses, reaping the dead) and a stage's limit lowered under its holders ---------

    def _working(self, stage: str | None = None) -> bool:
        """Whether this worker has work whose loss would cost time if it died: a stage, or requests
        in flight."""
        return (
            (stage or self.current) is not None or self.own > 0 or bool(self.buffer or self.handed)
        )

    def _beaten(self, sent: float, interval: float, grace: float) -> None:
        """A beat sent at ``sent`` reached Redis, promising the next within ``grace``; the next is
        due after ``interval``. Beats that keep coming without a gap make a streak (see
        :meth:`_reap`)."""
        if self.streak_since is None or not keeps_streak(
            sent - self.replied_at, self.pulse_interval
        ):
            self.streak_since = sent
        self.replied_at = time.monotonic()
        self.grace, self.pulse_interval = grace, interval
        self.pulse_due = sent + interval

    async def _pulse(self) -> None:
        """A worker with work beats at least every second (its promise is a few seconds: see
        policy.liveness), so that a killed worker's requests are fetched again within seconds; the
        pulse also names the dead."""
        await self._reap(await self._beat(self.current, pulse=True))

    async def _reap(self, dead: list[str]) -> None:
        """Requeue the requests of the workers a beat named dead, once this worker's own beats have
        reached Redis without a gap for a while (policy.may_reap): right after an outage or a stall
        of its own, the others may not have beaten yet either."""
        if not dead or self.streak_since is None:
            return
        if not may_reap(time.monotonic() - self.streak_since, self.settings.ttl):
            return
        reaped = await self.queues.reap(dead)
        for worker, moved in reaped.items():
            logger.warning(
                "Worker %s stopped beating: put %d of its requests back in the queues",
                worker,
                moved,
            )
            self.stats.inc_value("redislock/workers/requeued", moved)

    def _limit_seen(self, stage: str, limit: int) -> None:
        """A renewal of a slot reported the stage's limit (WorkerSlots): look at it now if it
        changed."""
        permit = self.permit
        if (
            stage == self.current
            and permit is not None
            and self.limit_checked != (limit, permit.grant)
        ):
            self._wake()

    async def _read_limit_unseen(self) -> None:
        """At a heartbeat: if no renewal reported the stage's limit since the last one, read it (one
        HGET)."""
        stage = self.current
        if stage is None or self.permit is None:
            return
        seen = self.locks.limits_seen.get(stage)
        if seen is None or seen[1] < max(self.taken_at, time.monotonic() - self.beat_interval):
            limit = await self.locks.read_limit(stage)
            if limit is not None:
                self.locks.limits_seen[stage] = (limit, time.monotonic())

    async def _check_limit(self) -> None:
        """Leave a capped stage whose limit was lowered under its holders (or set to 0: paused) if
        this worker's slot is one of the newest (policy.keeps_slot). One XPENDING each time the
        limit a renewal reported changes (and once after taking the stage); nothing otherwise."""
        stage, permit = self.current, self.permit
        if stage is None or permit is None or self.leaving or permit.lost:
            return
        seen = self.locks.limits_seen.get(stage)
        if seen is None or seen[1] < self.taken_at:
            return  # not reported since the stage was taken: the grant was made under the limit of then
        limit = seen[0]
        if self.limit_checked == (limit, permit.grant):
            return
        oldest = await self.locks.oldest_grants(stage, limit)
        self.limit_checked = (limit, permit.grant)
        if (
            not keeps_slot(permit.grant, oldest, limit)
            and self.current == stage
            and self.permit is permit
        ):
            await self._start_leaving(stage, limit)

    async def _start_leaving(self, stage: str, limit: int) -> None:
        """Over the limit: give back what was taken ahead (to the front of the queue), take nothing
        new; the slot is freed once what is in progress here has finished
        (:meth:`_finish_leaving`)."""
        self.leaving = True
        ids = [inflight_id for _, inflight_id in self.buffer]
        self.buffer.clear()
        returned = await self.queues.give_back(ids)
        self.own -= returned
        self.stats.inc_value(f"redislock/workers/{stage}/yielded")
        logger.info(
            "Worker %s leaves stage %r: its limit is %d now and this slot is one of the newest; "
            "gave %d unstarted "
            "requests back, %d in progress finish first",
            self.worker,
            stage,
            limit,
            returned,
            len(self.handed),
        )
        self._wake()

    async def _finish_leaving(self, stage: str) -> None:
        """Leaving: once nothing of the stage is in progress here, free the slot (then take another
        stage or wait)."""
        if stage in self.signalled:  # a token for the stage taken meanwhile: the next holder's
            self.signalled.discard(stage)
            await self.queues.signal(stage)
        if self.buffer or self.handed or self.tasks:
            return
        await self._leave_stage("over its limit: the stage was lowered or paused")

    async def _feed(self, entries: list[Any] | None) -> None:
        """Turn start URLs (taken by a blocked wait, else read now) into queued requests."""
        feed = self.feed
        if feed is None or not feed.enabled:
            return
        if entries is None:
            entries = await feed.read()
        else:
            self.fed = []
        if not entries:
            return
        for request in feed.requests(entries):
            stage = stage_of(request, self.settings, self.spider)
            if stage is not None:
                self.start_stages.add(stage)
            self.stats.inc_value("redislock/workers/start_urls")
            self.crawler.engine.crawl(request)
        # in their queues before this step looks at the lengths
        await asyncio.gather(*set(self.pushes))
        self.busy_at = time.monotonic()
        self.quiet_since = None
        self.empty.clear()
        self.look_due = True

    async def _check_lost(self) -> None:
        """A lost slot lease (stalled longer than the TTL, or an operator's reset): leave the stage
        at once."""
        permit = self.permit
        if permit is None or not permit.lost or self.current is None:
            return
        stage = self.current
        ids = [inflight_id for _, inflight_id in self.buffer]
        self.buffer.clear()
        # StageLocks counted it: redislock/workers/<stage>/lost
        returned = await self.queues.give_back(ids)
        self.own -= returned
        logger.warning(
            "Worker %s lost its slot of stage %r; gave %d unstarted requests back, %d in progress "
            "finish here",
            self.worker,
            stage,
            returned,
            len(self.handed),
        )
        self.permit, self.current = None, None
        self.look_due = True
        await self._beat(None)

    async def _take(self, stage: str) -> bool:
        if self.locks.is_capped(stage):
            # The worker front runs on one Redis (masters are refused in __init__): its slots are
            # plain Permits.
            permit = cast("Permit | None", await self.locks.locks[stage].try_acquire())
            if permit is None:
                return False
            # moving up from a capped stage does not happen; be safe anyway
            if self.permit is not None:
                await self.locks.release(self.permit)
            self.permit = permit
        previous, self.current = self.current, stage
        self.empty.discard(stage)
        self.leaving, self.limit_checked, self.taken_at = False, None, time.monotonic()
        await self._beat(stage)
        self.stats.inc_value(f"redislock/workers/{stage}/taken")
        logger.info(
            "Worker %s works on stage %r%s",
            self.worker,
            stage,
            f" (was {previous!r})" if previous else "",
        )
        return True

    async def _leave_stage(self, why: str = "no work left there") -> None:
        permit, self.permit = self.permit, None
        stage, self.current = self.current, None
        self.look_due = True
        self.leaving = False
        if permit is not None:
            await self.locks.release(permit)
        await self._beat(None)
        logger.info("Worker %s left stage %r (%s)", self.worker, stage, why)

    async def _fill(self, pass_on: bool = False) -> int:
        """Pop requests of the current stage so that about twice CONCURRENT_REQUESTS are taken."""
        stage = self.current
        if stage is None:
            return 0
        self._ack_finished()
        want = 2 * self.concurrency - len(self.buffer) - len(self.handed)
        if want <= 0 or (want < self.concurrency // 2 and self.buffer):
            # pop in batches of at least half CONCURRENT_REQUESTS: fewer, fuller script calls
            return 0
        popped = await self.queues.pop(stage, want, pass_on=pass_on)
        # taken for dead since the last beat: the beat says so and drops the buffer, then pop
        if popped is None:
            await self._beat(stage)
            popped = await self.queues.pop(stage, want, pass_on=pass_on) or []
        if len(popped) < want:
            self.empty.add(stage)
        self.own += len(popped)
        scored = self.queues.scored_ids
        if scored and self.order != "priority" and stage not in self.mixed_orders:
            self.mixed_orders.add(stage)
            logger.warning(
                "Worker %s (SCHEDULER_QUEUE_CLASS in %s order) took %d requests of stage %r from "
                "%s: they were queued "
                "in priority order (scrapy-redis's PriorityQueue, the default), by other workers "
                "of this spider or "
                "before a change of SCHEDULER_QUEUE_CLASS; they are fetched, but give every worker "
                "of a spider the "
                "same SCHEDULER_QUEUE_CLASS",
                self.worker,
                self.order.upper(),
                len(scored),
                stage,
                self.queues.keys.scored(stage),
            )
        unloadable: list[tuple[str, str]] = []
        for inflight_id, data in popped:
            try:
                request = decode(data, self.serializer, self.spider)
            # whatever the entry made the loader raise: never retried, kept for people
            except Exception as exc:
                unloadable.append(
                    (inflight_id, self._dead_letter_note(data, exc, inflight_id in scored))
                )
                continue
            self.buffer.append((request, inflight_id))
        if unloadable:
            moved = await self.queues.bury(unloadable)
            self.own -= moved
            self.stats.inc_value("redislock/workers/dead_letters", moved)
        if popped:
            self.stats.inc_value(f"redislock/workers/{stage}/dequeued", len(popped))
            self.busy_at = time.monotonic()
            self.quiet_since = None
            wake_engine(self.crawler)
        return len(popped)

    def _dead_letter_note(self, data: bytes, exc: Exception, scored: bool = False) -> str:
        """Log an entry that cannot be loaded, once; the note that goes with it to the dead-letter
        list. ``scored``: it came from the stage's sorted set, not its list."""
        keys, stage = self.queues.keys, self.current or ""
        queue = keys.scored(stage) if scored else keys.queue(stage)
        excerpt = repr(data[:EXCERPT]) + ("..." if len(data) > EXCERPT else "")
        error = f"{type(exc).__name__}: {exc}"[:200]
        logger.error(
            "An entry of %s cannot be loaded (%r); moved to %s. %d bytes: %s",
            queue,
            error,
            self.queues.keys.deadletter,
            len(data),
            excerpt,
        )
        note = {
            "time": round(time.time(), 3),
            "worker": self.worker,
            "queue": queue,
            "error": error,
        }
        return json.dumps(note)

    # -- Redis paused, restarted or gone: never close on paused work; say once what an outage or a
    # loss costs -----

    @property
    def close_reason(self) -> str | None:
        """The finish reason of an idle close (the mixin's idle handler): ``redislock_queue_lost``
        once Redis lost the crawl state while this worker knew of work (:meth:`_queues_lost`); None:
        Scrapy's own (``finished``)."""
        return "redislock_queue_lost" if self.lost else None

    def _outage_step(self, exc: BaseException) -> bool:
        """A step failed on a Redis error. An outage (down, paused, restarting, failing over): one
        WARNING for the whole outage (:class:`~scrapy_redislock.workers.outage.OutageLog`), the next
        step after a back-off; True. Anything else (Redis refused a command): False, for the loop to
        log with its traceback."""
        if isinstance(exc, REFUSED) or not isinstance(exc, OUTAGE_ERRORS):
            return False
        delay = self.retry_backoff.next()
        self.retry_at = time.monotonic() + delay
        self.outage.failed("the worker loop", exc, delay)
        return True

    def _outage_over(self) -> None:
        """A step went through after failing: one INFO line if that ends an outage."""
        self.retry_at = 0.0
        self.retry_backoff.reset()
        self.outage.answered()

    def _knows_of_work(self) -> bool:
        """Whether this worker knew of queued or in-flight work: its own (popped, in progress, taken
        ahead), its stage's queue not yet found empty, or work anywhere at its last look (paused and
        full stages included)."""
        on_stage = self.current is not None and self.current not in self.empty
        return bool(self.own or self.buffer or self.handed or on_stage or self.work_seen)

    async def _queues_lost(self) -> bool:
        """After a beat that found this worker unregistered (its first beat, taken for dead, or
        Redis lost the crawl state): read the queues' epoch (one script, only then). Another epoch
        than the one seen before means the crawl state is gone, not that the others took this worker
        for dead: every request queued in any stage and in flight in any worker, the dupefilter, the
        registry.

        Said loudly when this worker knew of work: ERROR once, stat
        ``redislock/workers/queue_lost``, and its idle close finishes as ``redislock_queue_lost``.
        What it still holds is kept: the requests it had taken ahead go back to the (new) queues,
        the ones in progress finish here and queue what they yield. True if lost."""
        epoch = await self.queues.epoch()
        seen, self.epoch = self.epoch, epoch
        if seen is None or seen == epoch:
            return False
        knew, queued = self._knows_of_work(), sum(self.lengths.values())
        ahead = [request for request, _ in self.buffer]
        self.buffer.clear()
        self.known.clear()  # the shared dupefilter went with the rest: what this worker sent is no longer there
        for request in ahead:
            # into the new queues (their in-flight record is gone with the rest)
            self.enqueue_request(request)
        self.own = 0
        self.empty.clear()
        self.look_due = True
        if not knew:
            logger.warning(
                "Worker %s: the worker queues of spider %r were emptied in Redis (a restart "
                "without persistence, or "
                "FLUSHALL); this worker knew of no queued or in-flight work. The dupefilter went "
                "with them: pages "
                "fetched before may be fetched again",
                self.worker,
                self.crawler.spidercls.name,
            )
            return True
        self.lost = True
        self.stats.inc_value("redislock/workers/queue_lost")
        logger.error(
            "Worker %s: Redis lost the worker queues of spider %r (restarted without persistence, "
            "flushed, or a "
            "replica without them promoted): every request queued in any stage (%d at this "
            "worker's last look) and "
            "in flight in any other worker is gone, the dupefilter with them; they cannot be "
            "recovered. This worker "
            "queues again the %d requests it had taken ahead and finishes the %d in progress; once "
            "idle it closes "
            "as redislock_queue_lost (REDISLOCK_IDLE_CLOSE). Keep the queues with Redis "
            "persistence (appendonly "
            "yes), or use the request front, whose queue lives in each process",
            self.worker,
            self.crawler.spidercls.name,
            queued,
            len(ahead),
            len(self.handed),
        )
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
                "SCHEDULER_PERSIST is False and this was the last worker, but work is left in "
                "Redis (queued in a "
                "stage, a paused one included, or in flight): the queues are kept for the next "
                "worker "
                "(SCHEDULER_FLUSH_ON_START = True starts afresh)"
            )


__all__ = ["StageWorkerScheduler"]
