"""Outbox: the requests a worker's callbacks yield, on their way to their stage's queue in Redis.

``enqueue_request`` must answer at once, so a request is put here and one task sends everything put
here meanwhile, :data:`PUSH_BATCH` requests per script call, retrying through an outage (a yielded
request is never dropped for one). A duplicate is dropped as Scrapy's and scrapy-redis's schedulers
drop one: at once for a fingerprint this worker already sent to the shared dupefilter (the last
:data:`KNOWN_FINGERPRINTS` of them are kept), else when the batch reaches Redis, with
``request_dropped`` sent then. A request that names no stage is this worker's own: its fingerprint
goes to the shared dupefilter together with the request into this worker's in-flight record in
Redis (``queue_keep``, batched as the pushes are), and it is handed out from
:attr:`Outbox.local`; a worker that dies or closes before it has handled one gives it back to the
front of its home stage's queue (the stage the worker was on when it was yielded) like a popped
request, so a SIGKILL loses none. Only one that the request format cannot store (SCHEDULER_SERIALIZER
refuses it) lives in memory alone, said at WARNING.

Reads Scrapy's DUPEFILTER_DEBUG (how duplicates are logged, as Scrapy's dupefilter logs them).
Stats: ``redislock/workers/<stage>/{enqueued,duplicates}``, ``redislock/workers/unqueueable``,
``redislock/workers/no_stage/{kept,memory_only}`` and Scrapy's ``dupefilter/filtered``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import redis.exceptions
from scrapy import Request, signals

from scrapy_redislock.crawl.engine import finish_uncleanly, wake_engine

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

    from scrapy_redislock.workers.outage import OutageLog
    from scrapy_redislock.workers.queue import StageQueues

logger = logging.getLogger("scrapy_redislock.workers.scheduler")

PUSH_BATCH = 500  # requests per queue_push call
# Fingerprints a worker keeps of what it sent to the shared dupefilter, to drop a duplicate of them
# at once (enqueue_request returns False); the oldest are forgotten (a duplicate of those is found
# in Redis instead).
KNOWN_FINGERPRINTS = 100_000

# (stage, hex fingerprint, serialized request, priority, request)
Entry = tuple[str, str, bytes, int, Request]
# A request with no stage: (home stage, hex fingerprint, mark, serialized request or b"", request)
Keep = tuple[str, str, str, bytes, Request]


class Outbox:
    """What a worker queues in Redis, sent in batches (see the module docstring)."""

    def __init__(
        self,
        crawler: Crawler,
        queues: StageQueues,
        outage: OutageLog,
        on_queued: Callable[[str], None],
        on_kept: Callable[[int], None],
    ) -> None:
        self.crawler = crawler
        self.stats: Any = crawler.stats
        self.queues = queues
        self.outage = outage
        self.on_queued = on_queued  # a request reached its stage's queue (the stage)
        self.on_kept = on_kept  # requests with no stage entered this worker's in-flight record
        self.entries: deque[Entry] = deque()
        self.keeps: deque[Keep] = deque()  # requests with no stage on their way to Redis
        # requests that name no stage: this worker's own, with their in-flight id (None: memory
        # only)
        self.local: deque[tuple[Request, int | None]] = deque()
        self.keeper: asyncio.Task[Any] | None = None
        self.keeping = 0  # queue_keep calls awaiting their reply
        # fingerprints sent to the shared dupefilter, oldest first (bounded)
        self.known: dict[bytes, None] = {}
        self.flusher: asyncio.Task[Any] | None = None
        self.pushes: set[asyncio.Task[Any]] = set()  # the tasks sending requests to Redis
        self.sending = 0  # requests in push and keep calls awaiting their reply
        # sends that lost requests (refused by Redis, cut off at close, failed): a request handed
        # out before one of them may have yielded what was lost (InFlight keeps it unacknowledged)
        self.losses = 0
        self.dupefilter_debug = crawler.settings.getbool("DUPEFILTER_DEBUG")
        # the first duplicate is logged (DEBUG), the others only with DUPEFILTER_DEBUG
        self.log_dupes = True

    def is_known(self, fingerprint: bytes | None) -> bool:
        return fingerprint is not None and fingerprint in self.known

    def know(self, fingerprint: bytes | None) -> None:
        """Remember a fingerprint sent to the shared dupefilter (the newest KNOWN_FINGERPRINTS of
        them)."""
        if fingerprint is None:
            return
        self.known[fingerprint] = None
        if len(self.known) > KNOWN_FINGERPRINTS:
            del self.known[next(iter(self.known))]

    def put(self, entry: Entry) -> None:
        """Queue a request in its stage's queue, with the others put meanwhile."""
        self.entries.append(entry)
        if self.flusher is None:
            self.flusher = self.spawn(self._flush())

    def keep_local(self, entry: Keep) -> None:
        """A request that names no stage: into this worker's in-flight record with its fingerprint
        (with the others put meanwhile), then handed out by this worker; dropped if the shared
        dupefilter knows it."""
        _, fingerprint, _, data, request = entry
        if not fingerprint and not data:  # nothing Redis could keep or filter
            self.local.append((request, None))
            wake_engine(self.crawler)
            return
        self.keeps.append(entry)
        if self.keeper is None:
            self.keeper = self.spawn(self._keep())

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.pushes.add(task)
        task.add_done_callback(self._sent)
        return task

    def _sent(self, task: asyncio.Task[Any]) -> None:
        self.pushes.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            self.losses += 1  # what it had taken is not in Redis
            logger.error("Sending requests to Redis failed: %r", error, exc_info=error)

    async def sent(self) -> None:
        """Wait until what was put so far is in Redis (or refused)."""
        while self.pushes:
            await asyncio.wait(set(self.pushes))

    def unsent(self) -> int:
        """Requests put here that are not in Redis yet: waiting, or in a call not answered yet."""
        return len(self.entries) + len(self.keeps) + self.sending

    def _refused(self, count: int, message: str, exc: BaseException) -> None:
        """Redis refused ``count`` requests (out of memory, a role without the command): lost. ERROR,
        counted, and the crawl does not finish cleanly; the requests handed out before it stay in
        the in-flight record (fetched again: InFlight)."""
        self.stats.inc_value("redislock/workers/unqueueable", count)
        self.losses += 1
        logger.error(message, count, exc)
        finish_uncleanly(self.crawler, "redislock_queue_lost", lambda: None)

    def filtered(self, request: Request, stage: str | None) -> None:
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
                "Filtered duplicate request: %(request)s - no more duplicates will be shown (see DUPEFILTER_DEBUG to show all duplicates)",  # noqa: E501
                {"request": request},
            )
            self.log_dupes = False

    def _dropped(self, request: Request, stage: str | None) -> None:
        """A duplicate found in Redis after ``enqueue_request`` returned True: filtered, and
        ``request_dropped`` sent as the engine sends it for a request the scheduler refuses."""
        self.filtered(request, stage)
        self.crawler.signals.send_catch_log(
            signal=signals.request_dropped, request=request, spider=self.crawler.spider
        )

    async def _flush(self) -> None:
        """Queue the entries in Redis, PUSH_BATCH requests per script call, until none is left."""
        try:
            await asyncio.sleep(0)  # let the rest of a callback's output join this batch
            while self.entries:
                count = min(PUSH_BATCH, len(self.entries))
                await self._push([self.entries.popleft() for _ in range(count)])
        finally:
            self.flusher = None

    async def _push(self, batch: list[Entry]) -> None:
        entries = [
            (stage, fingerprint, data, priority) for stage, fingerprint, data, priority, _ in batch
        ]
        self.sending += len(batch)
        try:
            queued = await self.outage.retrying(
                "Queueing requests", lambda: self.queues.push_many(entries)
            )
        # not an outage: Redis refused them (e.g. out of memory)
        except redis.exceptions.RedisError as exc:
            self._refused(
                len(batch),
                "Dropped %d requests: Redis refused to queue them (%s). The crawl will finish as redislock_queue_lost (exit status 1); any request of this worker that may have yielded them stays in its in-flight record and goes back to its queue when it closes",  # noqa: E501
                exc,
            )
            # Redis may not have them: not known duplicates here
            for _, fingerprint, *_ in batch:
                self.known.pop(bytes.fromhex(fingerprint), None)
            return
        finally:
            self.sending -= len(batch)
        for (stage, _, _, _, request), new in zip(batch, queued, strict=True):
            if not new:
                self._dropped(request, stage)
                continue
            self.stats.inc_value(f"redislock/workers/{stage}/enqueued")
            self.on_queued(stage)

    async def _keep(self) -> None:
        """Record the requests with no stage in Redis, PUSH_BATCH per script call (one call per home
        stage), until none is left."""
        try:
            await asyncio.sleep(0)  # let the rest of a callback's output join this batch
            while self.keeps:
                home = self.keeps[0][0]
                batch: list[Keep] = []
                while self.keeps and self.keeps[0][0] == home and len(batch) < PUSH_BATCH:
                    batch.append(self.keeps.popleft())
                await self._keep_batch(home, batch)
        finally:
            self.keeper = None

    async def _keep_batch(self, home: str, batch: list[Keep]) -> None:
        entries = [(fingerprint, mark, data) for _, fingerprint, mark, data, _ in batch]
        self.keeping += 1
        self.sending += len(batch)
        try:
            replies = await self.outage.retrying(
                "Keeping requests with no stage", lambda: self.queues.keep(home, entries)
            )
        # not an outage: Redis refused them (e.g. out of memory)
        except redis.exceptions.RedisError as exc:
            self._refused(
                len(batch),
                "Dropped %d requests with no stage: Redis refused to keep them (%s). The crawl will finish as redislock_queue_lost (exit status 1); any request of this worker that may have yielded them stays in its in-flight record and goes back to its queue when it closes",  # noqa: E501
                exc,
            )
            for _, fingerprint, *_ in batch:
                if fingerprint:
                    self.known.pop(bytes.fromhex(fingerprint), None)
            return
        finally:
            self.keeping -= 1
            self.sending -= len(batch)
        kept = 0
        for (_, _, _, _, request), reply in zip(batch, replies, strict=True):
            if reply == 0:
                self._dropped(request, None)
            elif reply == -2:  # this worker was taken for dead: queued in its home stage's queue
                self.stats.inc_value(f"redislock/workers/{home}/enqueued")
                self.on_queued(home)
            else:
                self.local.append((request, reply if reply > 0 else None))
                kept += reply > 0
        if kept:
            self.stats.inc_value("redislock/workers/no_stage/kept", kept)
            self.on_kept(kept)
        if self.local:
            wake_engine(self.crawler)


__all__ = ["KNOWN_FINGERPRINTS", "PUSH_BATCH", "Keep", "Outbox"]
