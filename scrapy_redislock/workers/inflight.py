"""InFlight: the requests a worker popped, from the pop until Scrapy has completely handled them.

A popped request is in the worker's in-flight record in Redis (part of the cluster's in-flight
counter) while it is taken ahead (:attr:`InFlight.buffer`), handed to the engine
(:attr:`InFlight.handed`), and finished but not yet acknowledged (:attr:`InFlight.acks`,
:attr:`InFlight.acking`). So is a request with no stage that this worker's callbacks yielded (kept
in the record by the outbox, see :mod:`~scrapy_redislock.workers.outbox`) from its keep until it
is handled (:attr:`InFlight.unstaged` once handed to the engine); it does not hold the worker on
its stage. A request is finished when it has left the engine's in-progress set
(download, redirects, callback or errback, and every request the callback yielded queued in Redis);
the finished ones are acknowledged together, in one script call, as soon as the loop iteration that
finished them is over; but not one handed out before a send of the outbox lost requests (Redis
refused them, or close cut them off): what it yielded may be among them, so it stays in the record
and goes back to its queue at close. An entry that cannot be loaded is moved to the spider's
dead-letter list.

Reads no settings (the scheduler passes CONCURRENT_REQUESTS, SCHEDULER_SERIALIZER,
REDISLOCK_ALLOWED_SCHEMES and the queue order). Stats: ``redislock/workers/dead_letters``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import redis.exceptions
from scrapy import Request

from scrapy_redislock.crawl.engine import in_progress
from scrapy_redislock.workers.queue import decode

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

    from scrapy_redislock.workers.outage import OutageLog
    from scrapy_redislock.workers.outbox import Outbox
    from scrapy_redislock.workers.queue import StageQueues
    from scrapy_redislock.workers.state import WorkerState

logger = logging.getLogger("scrapy_redislock.workers.scheduler")

EXCERPT = 60  # bytes of an entry that cannot be loaded shown in the log and in the dead-letter note


# the in-flight id of a request whose record Redis lost (:meth:`InFlight.detach`): never acknowledged
DETACHED = ""


class InFlight:
    """The requests this worker holds in its in-flight record (see the module docstring)."""

    def __init__(
        self,
        crawler: Crawler,
        queues: StageQueues,
        state: WorkerState,
        outbox: Outbox,
        outage: OutageLog,
        *,
        concurrency: int,
        serializer: Any,
        order: str,
        schemes: tuple[str, ...] = ("http", "https"),
    ) -> None:
        self.crawler = crawler
        self.stats: Any = crawler.stats
        self.queues = queues
        self.state = state
        self.outbox = outbox
        self.outage = outage
        self.concurrency = concurrency
        self.serializer = serializer
        self.schemes = schemes  # REDISLOCK_ALLOWED_SCHEMES: a queued request of another goes to the dead letters
        self.order = order
        self.buffer: deque[tuple[Request, str]] = deque()  # popped, not handed to the engine yet
        self.handed: dict[Request, str] = {}  # handed to the engine, not acked yet -> in-flight id
        # requests with no stage kept in the record, handed to the engine, not acked yet -> id
        self.unstaged: dict[Request, str] = {}
        self.acks: list[str] = []  # in-flight ids of finished requests, acknowledged together
        # in-flight ids in an ack call (or whose ack Redis refused: kept till close)
        self.acking: set[str] = set()
        # in-flight id of a handed request -> the outbox's losses then: one that saw a loss since
        # may have yielded what was lost, so it is not acknowledged (it goes back at close)
        self.losses_at: dict[str, int] = {}
        self.generation = 0  # the in-flight record's: one more each time Redis lost it (detach)
        self.acker: asyncio.Task[None] | None = None
        self.tasks: set[asyncio.Task[Any]] = set()  # the ack calls running
        # requests in this worker's in-flight record in Redis (part of the cluster's counter)
        self.own = 0
        # stages whose sorted set a FIFO or LIFO worker found work in (warned)
        self.mixed_orders: set[str] = set()

    @property
    def holding(self) -> bool:
        """Requests taken ahead or in the engine."""
        return bool(self.buffer or self.handed)

    @property
    def settled(self) -> bool:
        """Nothing taken ahead, in the engine or being acknowledged: a stage can be left."""
        return not (self.buffer or self.handed or self.tasks)

    def hand(self) -> Request | None:
        """The next request taken ahead, handed to the engine now."""
        if not self.buffer:
            return None
        request, inflight_id = self.buffer.popleft()
        self.handed[request] = inflight_id
        self.losses_at[inflight_id] = self.outbox.losses
        return request

    def hand_unstaged(self) -> Request | None:
        """The next request with no stage this worker's callbacks yielded, handed to the engine
        now (acknowledged like a popped one once handled, if it is in the in-flight record)."""
        if not self.outbox.local:
            return None
        request, inflight_id = self.outbox.local.popleft()
        if inflight_id is not None:
            self.unstaged[request] = str(inflight_id)
            self.losses_at[str(inflight_id)] = self.outbox.losses
        return request

    def wanted(self) -> int:
        """How many to pop so that about twice CONCURRENT_REQUESTS are taken; 0: not yet (pops come
        in batches of at least half CONCURRENT_REQUESTS: fewer, fuller script calls)."""
        want = 2 * self.concurrency - len(self.buffer) - len(self.handed)
        if want <= 0 or (want < self.concurrency // 2 and self.buffer):
            return 0
        return want

    def drop_ahead(self) -> list[Request]:
        """Forget the requests taken ahead, and the kept requests with no stage not handed out yet
        (the others have them, or they are queued again); those only in memory stay."""
        ahead = [request for request, _ in self.buffer]
        self.buffer.clear()
        local = self.outbox.local
        ahead += [request for request, inflight_id in local if inflight_id is not None]
        memory_only = [entry for entry in local if entry[1] is None]
        local.clear()
        local.extend(memory_only)
        return ahead

    async def give_back_ahead(self) -> int:
        """Put the requests taken ahead back at the front of their queue; how many went back."""
        ids = [inflight_id for _, inflight_id in self.buffer]
        self.buffer.clear()
        returned = await self.queues.give_back(ids)
        self.own -= returned
        return returned

    def detach(self) -> None:
        """Redis lost the crawl state: the in-flight ids of the requests in progress, and of those
        finished and not acknowledged yet, or in an ack call being retried, named entries of the
        lost record. The new record's ids start from Redis's clock, after these; but Redis back with
        an older copy of the counter (a snapshot, a replica behind) gives some out again, to new
        requests of this worker's: never acknowledged (an ack would drop them); the requests still
        finish here."""
        self.handed = dict.fromkeys(self.handed, DETACHED)
        self.unstaged = dict.fromkeys(self.unstaged, DETACHED)
        self.acks.clear()
        self.acking.clear()
        self.losses_at.clear()
        self.generation += 1  # an ack call under way sends nothing more

    def known_ids(self) -> list[str]:
        """The in-flight ids this worker knows it holds: taken ahead, in the engine, finished and
        being acked."""
        ids = [
            *(inflight_id for _, inflight_id in self.buffer),
            *self.handed.values(),
            *(str(inflight_id) for _, inflight_id in self.outbox.local if inflight_id is not None),
            *self.unstaged.values(),
            *self.acks,
            *self.acking,
        ]
        return [inflight_id for inflight_id in ids if inflight_id != DETACHED]

    # -- popping -----------------------------------------------------------------------------------

    async def pop(self, stage: str, want: int, pass_on: bool) -> int | None:
        """Pop up to ``want`` requests of ``stage`` into the buffer; how many were popped (entries
        that cannot be loaded included). None: this worker was taken for dead since its last beat
        (beat, then pop again)."""
        popped = await self.queues.pop(stage, want, pass_on=pass_on)
        if popped is None:
            return None
        self.own += len(popped)
        scored = self.queues.scored_ids
        if scored and self.order != "priority" and stage not in self.mixed_orders:
            self.mixed_orders.add(stage)
            logger.warning(
                "Worker %s (SCHEDULER_QUEUE_CLASS in %s order) took %d requests of stage %r from %s: they were queued in priority order (scrapy-redis's PriorityQueue, the default), by other workers of this spider or before a change of SCHEDULER_QUEUE_CLASS; they are fetched, but give every worker of a spider the same SCHEDULER_QUEUE_CLASS",  # noqa: E501
                self.queues.worker,
                self.order.upper(),
                len(scored),
                stage,
                self.queues.keys.scored(stage),
            )
        unloadable: list[tuple[str, str]] = []
        for inflight_id, data in popped:
            try:
                request = decode(data, self.serializer, self.crawler.spider, self.schemes)
            # whatever the entry made the loader raise: never retried, kept for people
            except Exception as exc:
                note = self._dead_letter_note(stage, data, exc, inflight_id in scored)
                unloadable.append((inflight_id, note))
                continue
            self.buffer.append((request, inflight_id))
        if unloadable:
            moved = await self.queues.bury(unloadable)
            self.own -= moved
            self.stats.inc_value("redislock/workers/dead_letters", moved)
        return len(popped)

    def _dead_letter_note(self, stage: str, data: bytes, exc: Exception, scored: bool) -> str:
        """Log an entry that cannot be loaded, once; the note that goes with it to the dead-letter
        list. ``scored``: it came from the stage's sorted set, not its list."""
        keys = self.queues.keys
        queue = keys.scored(stage) if scored else keys.queue(stage)
        excerpt = repr(data[:EXCERPT]) + ("..." if len(data) > EXCERPT else "")
        error = f"{type(exc).__name__}: {exc}"[:200]
        logger.error(
            "An entry of %s cannot be loaded (%r); moved to %s. %d bytes: %s",
            queue,
            error,
            keys.deadletter,
            len(data),
            excerpt,
        )
        note = {
            "time": round(time.time(), 3),
            "worker": self.queues.worker,
            "queue": queue,
            "error": error,
        }
        return json.dumps(note)

    # -- acknowledging -----------------------------------------------------------------------------

    def ack_finished(self) -> None:
        """Drop from the in-flight record every handed-out request the engine has completely
        handled."""
        if not (self.handed or self.unstaged):
            return
        unfinished = in_progress(self.crawler) or set()
        done = [request for request in self.handed if request not in unfinished]
        unstaged = [request for request in self.unstaged if request not in unfinished]
        finished = [self.handed.pop(request) for request in done]
        finished += [self.unstaged.pop(request) for request in unstaged]
        self.acks += [inflight_id for inflight_id in finished if inflight_id != DETACHED]
        if (done or unstaged) and (self.acker is None or self.acker.done()):
            self.acker = asyncio.get_running_loop().create_task(self._ack_soon())
            self.tasks.add(self.acker)
            self.acker.add_done_callback(self._acked)

    def _acked(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        self.state.wake()  # the last ack of a drained stage: leave it now

    async def _ack_soon(self) -> None:
        """One script call for the requests finished meanwhile. Not later than that: a finished
        request still in the in-flight record when its worker dies would be fetched again."""
        await asyncio.sleep(0)  # the other requests finished in this loop iteration join
        while self.acks:
            ids, self.acks = self.acks, []
            self.acking.update(ids)
            await self._ack(ids, set(self.outbox.pushes))

    async def _ack(self, ids: list[str], pushes: set[asyncio.Task[Any]]) -> None:
        # what the callbacks yielded is in Redis before their parents leave the in-flight record
        if pushes:
            await asyncio.wait(pushes)
        # a request handed out before a send lost requests may have yielded them: it stays in the
        # record (in acking), and goes back to its queue at close
        losses = self.outbox.losses
        ids = [i for i in ids if self.losses_at.pop(i, losses) == losses]
        if not ids:
            return
        generation = self.generation

        async def ack() -> int:
            # not after Redis lost the record: these ids may name new entries by now
            return await self.queues.ack(ids) if self.generation == generation else 0

        try:
            dropped = await self.outage.retrying("Acknowledging requests", ack)
            self.own -= dropped  # not "self.own -= await ...": that reads self.own before the await
            self.acking.difference_update(ids)
        # they stay in the record: requeued (fetched again) at close
        except redis.exceptions.RedisError as exc:
            logger.error("Could not acknowledge %d requests (%s)", len(ids), exc)


__all__ = ["InFlight"]
