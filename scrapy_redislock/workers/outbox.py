"""Outbox: the requests a worker's callbacks yield, on their way to their stage's queue in Redis.

``enqueue_request`` must answer at once, so a request is put here and one task sends everything put
here meanwhile, :data:`PUSH_BATCH` requests per script call, retrying through an outage (a yielded
request is never dropped for one). A duplicate is dropped as Scrapy's and scrapy-redis's schedulers
drop one: at once for a fingerprint this worker already sent to the shared dupefilter (the last
:data:`KNOWN_FINGERPRINTS` of them are kept), else when the batch reaches Redis, with
``request_dropped`` sent then. A request that names no stage is this worker's own and stays in
memory (:attr:`Outbox.local`), after a look at the shared dupefilter.

Reads Scrapy's DUPEFILTER_DEBUG (how duplicates are logged, as Scrapy's dupefilter logs them).
Stats: ``redislock/workers/<stage>/{enqueued,duplicates}``, ``redislock/workers/unqueueable`` and
Scrapy's ``dupefilter/filtered``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import redis.exceptions
from scrapy import Request, signals

from scrapy_redislock.crawl.engine import wake_engine

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


class Outbox:
    """What a worker queues in Redis, sent in batches (see the module docstring)."""

    def __init__(
        self,
        crawler: Crawler,
        queues: StageQueues,
        outage: OutageLog,
        on_queued: Callable[[str], None],
    ) -> None:
        self.crawler = crawler
        self.stats: Any = crawler.stats
        self.queues = queues
        self.outage = outage
        self.on_queued = on_queued  # a request reached its stage's queue (the stage)
        self.entries: deque[Entry] = deque()
        self.local: deque[Request] = deque()  # requests that name no stage: this worker's own
        # fingerprints sent to the shared dupefilter, oldest first (bounded)
        self.known: dict[bytes, None] = {}
        self.flusher: asyncio.Task[Any] | None = None
        self.pushes: set[asyncio.Task[Any]] = set()  # the tasks sending requests to Redis
        self.dupefilter_debug = crawler.settings.getbool("DUPEFILTER_DEBUG")
        # the first duplicate is logged (DEBUG), the others only with DUPEFILTER_DEBUG
        self.log_dupes = True

    def __len__(self) -> int:
        return len(self.entries)

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

    def keep_local(self, request: Request, fingerprint: str) -> None:
        """A request that names no stage: handed out by this worker, unless the shared dupefilter
        knows it."""
        self.spawn(self._keep_local(request, fingerprint))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.pushes.add(task)
        task.add_done_callback(self.pushes.discard)
        return task

    async def sent(self) -> None:
        """Wait until what was put so far is in Redis (or refused)."""
        while self.pushes:
            await asyncio.wait(set(self.pushes))

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
                "Filtered duplicate request: %(request)s - no more duplicates will be shown (see "
                "DUPEFILTER_DEBUG to show all duplicates)",
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
        try:
            queued = await self.outage.retrying(
                "Queueing requests", lambda: self.queues.push_many(entries)
            )
        # not an outage: Redis refused them (e.g. out of memory)
        except redis.exceptions.RedisError as exc:
            self.stats.inc_value("redislock/workers/unqueueable", len(batch))
            logger.error("Dropped %d requests: Redis refused to queue them (%s)", len(batch), exc)
            # Redis may not have them: not known duplicates here
            for _, fingerprint, *_ in batch:
                self.known.pop(bytes.fromhex(fingerprint), None)
            return
        for (stage, _, _, _, request), new in zip(batch, queued, strict=True):
            if not new:
                self._dropped(request, stage)
                continue
            self.stats.inc_value(f"redislock/workers/{stage}/enqueued")
            self.on_queued(stage)

    async def _keep_local(self, request: Request, fingerprint: str) -> None:
        if fingerprint:
            seen: bool = await self.outage.retrying(
                "Checking the dupefilter", lambda: self.queues.seen(fingerprint)
            )
            if seen:
                self._dropped(request, None)
                return
        self.local.append(request)
        wake_engine(self.crawler)


__all__ = ["KNOWN_FINGERPRINTS", "PUSH_BATCH", "Outbox"]
