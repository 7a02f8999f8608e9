"""Per-stage request queues of one spider in Redis, shared by all its workers, and how a request is
stored there.

Keys, all under the hash tag of the spider name so that Redis Cluster keeps them on one node::

    <prefix>:{<spider>}:queue:<stage>       list: serialized requests (scrapy-redis FifoQueue orientation:
                                            LPUSH to queue, RPOP to take, LPOP in LIFO order; "to the front" is
                                            RPUSH, LPUSH in LIFO order). In priority order: the requests of
                                            priority 0, and whatever an earlier version queued
    <prefix>:{<spider>}:pqueue:<stage>      sorted set: requests of another priority (in priority order), scored
                                            -priority as scrapy-redis's PriorityQueue; each member is a 16-digit
                                            order number, then the request: equal priorities keep their push order
    <prefix>:{<spider>}:seq                 counter of those order numbers
    <prefix>:{<spider>}:signal:<stage>      list: at most one token, pushed when the stage's queue goes from
                                            empty to non-empty; idle workers block on it (BLPOP)
    <prefix>:{<spider>}:wake                list: one token per registered worker when the crawl has ended
                                            (nothing in flight, every queue empty), so idle workers see it at once
    <prefix>:{<spider>}:dupefilter          set: request fingerprints (hex), shared by all workers and stages
    <prefix>:{<spider>}:inflight:<worker>   hash: id -> "<stage><mark>\\n<request>" popped by that worker, not done
                                            yet; the mark says where it goes back to: '' the list's right end,
                                            '{L}' its left end, '{P<score>:<order number>}' its place in the
                                            sorted set; also the requests with no stage its callbacks yielded
                                            (queue_keep), under their home stage, until it has handled them
    <prefix>:{<spider>}:inflight_total      counter: requests in every worker's in-flight hash (kept by the scripts)
    <prefix>:{<spider>}:alive               zset: worker -> last beat (ms, Redis's clock)
    <prefix>:{<spider>}:due                 zset: worker -> the moment (ms, Redis's clock) by which it promised to
                                            beat again (set by each beat, moved ahead by each pop); past it, the
                                            worker is dead
    <prefix>:{<spider>}:working             hash: worker -> the stage it works on (for people and the demo)
    <prefix>:{<spider>}:ids                 counter of in-flight ids (made from Redis's clock in units of 100 µs:
                                            a new crawl state gives out no id of one Redis lost)
    <prefix>:{<spider>}:epoch               string: made when missing by a worker's first beat (Redis's clock in
                                            µs); a worker whose registration vanished reads it again: another
                                            value than the one it saw means the crawl state was lost (Redis
                                            restarted empty, flushed, a promoted replica without it)
    <prefix>:{<spider>}:deadletter          list: entries that could not be loaded, newest first, each
                                            "<note: one line of JSON>\\n<stage><mark>\\n<request>" (kept for people)

The order of a stage queue is scrapy-redis's SCHEDULER_QUEUE_CLASS (:func:`queue_order`): its
PriorityQueue (the default: higher ``request.priority`` first, equal priorities first in first out),
FifoQueue or LifoQueue. In priority order the requests of priority 0 (most of them) go to the list
exactly as before, the others to the sorted set; a pop takes the sorted set's priorities above 0,
then the list, then the priorities below 0. So a queue written by an earlier version (a FIFO list)
is simply the priority-0 part, read as it was. Whatever the order, every pop ends with the part the
order does not use (a FIFO or LIFO worker takes what the sorted set holds once its list is empty),
and every length, end-of-crawl and clear check counts both parts: nothing any worker queued is
stranded.

A popped request moves atomically from its queue into the worker's in-flight hash and leaves it when
the worker acks it. A worker that has not beaten for one TTL is dead: the next worker to beat is
told so by its beat and puts its in-flight requests back at the front of their queues
(:meth:`StageQueues.reap`). Every state change is one Lua script (``scripts/queue_*.lua``). What a
worker costs Redis does not grow with the number of workers: a beat is one script whatever the
number of workers, the in-flight counter replaces counting every worker's hash, and an idle worker
blocks on the signal lists instead of polling. Request bytes are opaque to
:class:`StageQueues`; :func:`encode` and :func:`decode` are the Scrapy side (SCHEDULER_SERIALIZER,
by default the safe JSON format of :mod:`~scrapy_redislock.crawl.requestformat`). The dead-letter
list is evidence for an operator (what was pushed by whom): no clear deletes it, only an operator
(``DEL``).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from redis.client import NEVER_DECODE
from scrapy.utils.misc import load_object

from scrapy_redislock._redis import (
    AsyncRedisClient,
    ProjectScript,
    RedisClient,
    ScriptMode,
    check_name,
    check_ttl,
    hash_tag,
    load_scripts,
    text,
)
from scrapy_redislock.crawl.epoch import EPOCH_SCRIPT, crawl_scripts
from scrapy_redislock.crawl.requestformat import request_from_data
from scrapy_redislock.errors import ConfigError, InvalidArgument
from scrapy_redislock.lock.base import waiting_client

if TYPE_CHECKING:
    from scrapy import Request, Spider

logger = logging.getLogger(__name__)

QUEUE_SCRIPTS = (
    "queue_push",
    "queue_pop",
    "queue_ack",
    "queue_beat",
    "queue_requeue",
    "queue_return",
    "queue_clear",
    "queue_bury",
    "queue_look",
    "queue_keep",
    "feed_take",
)


def worker_scripts(names: tuple[str, ...] = QUEUE_SCRIPTS) -> dict[str, str]:
    """The worker front's Lua sources by name (``workers/scripts/``), each with ``_lib.lua`` in
    front of it."""
    return load_scripts("scrapy_redislock.workers", names, "_lib")


ORDERS = ("priority", "fifo", "lifo")
# SCHEDULER_QUEUE_CLASS -> the order of the stage queues (scrapy-redis's classes and their old
# aliases).
QUEUE_CLASSES = {
    "scrapy_redis.queue.PriorityQueue": "priority",
    "scrapy_redis.queue.SpiderPriorityQueue": "priority",
    "scrapy_redis.queue.FifoQueue": "fifo",
    "scrapy_redis.queue.SpiderQueue": "fifo",
    "scrapy_redis.queue.LifoQueue": "lifo",
    "scrapy_redis.queue.SpiderStack": "lifo",
}


def queue_order(queue_class: Any) -> str:
    """The order of the stage queues for scrapy-redis's SCHEDULER_QUEUE_CLASS (a class or its import
    path; unset: its default, PriorityQueue): "priority", "fifo" or "lifo". Anything else (another
    class, a subclass of theirs, a path that does not import) is a ConfigError naming the setting:
    the worker front keeps its stage queues in Redis itself and can only give them the order of one
    of scrapy-redis's three queues."""
    if queue_class is None or queue_class == "":
        return "priority"  # scrapy-redis's default (scrapy_redis.defaults.SCHEDULER_QUEUE_CLASS)
    if isinstance(queue_class, str) and queue_class in QUEUE_CLASSES:
        return QUEUE_CLASSES[queue_class]
    found = queue_class
    if isinstance(queue_class, str):
        try:
            found = load_object(queue_class)
        except Exception:
            found = None
    from scrapy_redis import queue as scrapy_redis_queue

    known = {
        scrapy_redis_queue.PriorityQueue: "priority",
        scrapy_redis_queue.FifoQueue: "fifo",
        scrapy_redis_queue.LifoQueue: "lifo",
    }
    for cls, order in known.items():
        if found is cls:
            return order
    raise ConfigError(
        f"SCHEDULER_QUEUE_CLASS = {queue_class!r} cannot order the worker queues: StageWorkerMixin keeps its stage queues in Redis itself, in the order of one of scrapy-redis's queues; accepted: scrapy_redis.queue.PriorityQueue (the default when unset: higher request.priority first), scrapy_redis.queue.FifoQueue, scrapy_redis.queue.LifoQueue (or their aliases SpiderPriorityQueue, SpiderQueue, SpiderStack)"  # noqa: E501
    )


@dataclass(frozen=True)
class QueueKeys:
    """Redis keys of one spider's stage queues."""

    base: str

    @classmethod
    def of(cls, prefix: str, spider: str) -> QueueKeys:
        return cls(f"{check_name(prefix, 'key_prefix')}:{{{check_name(spider, 'spider name')}}}")

    dupefilter = property(lambda self: f"{self.base}:dupefilter")
    alive = property(lambda self: f"{self.base}:alive")
    working = property(lambda self: f"{self.base}:working")
    ids = property(lambda self: f"{self.base}:ids")
    in_flight = property(lambda self: f"{self.base}:inflight_total")
    wake = property(lambda self: f"{self.base}:wake")
    due = property(lambda self: f"{self.base}:due")
    deadletter = property(lambda self: f"{self.base}:deadletter")
    epoch = property(lambda self: f"{self.base}:epoch")
    sequence = property(lambda self: f"{self.base}:seq")

    def queue(self, stage: str) -> str:
        """The stage queue's list (FIFO or LIFO order; in priority order, the requests of priority
        0)."""
        return f"{self.base}:queue:{stage}"

    def scored(self, stage: str) -> str:
        """The stage queue's sorted set (in priority order, the requests of another priority than
        0)."""
        return f"{self.base}:pqueue:{stage}"

    def inflight(self, worker: str) -> str:
        return f"{self.base}:inflight:{worker}"

    def signal(self, stage: str) -> str:
        return f"{self.base}:signal:{stage}"

    def feed_taken(self, feed_key: str, worker: str) -> str:
        """``<prefix>:feed:{<the feed's hash tag>}:taken:<worker>:<the feed's key>``: a worker's last
        take of a start-URL feed (``scripts/feed_take.lua``), in the feed's hash slot."""
        prefix = self.base.partition(":{")[0]
        return f"{prefix}:feed:{{{hash_tag(feed_key)}}}:taken:{worker}:{feed_key}"


def encode(request: Request, serializer: Any, spider: Spider | None) -> bytes:
    """The request as its queue stores it (SCHEDULER_SERIALIZER, by default the safe JSON
    format)."""
    data = serializer.dumps(request.to_dict(spider=spider))
    return data.encode("utf-8") if isinstance(data, str) else bytes(data)


def decode(
    data: bytes,
    serializer: Any,
    spider: Spider | None,
    schemes: tuple[str, ...] = ("http", "https"),
) -> Request:
    """A queued entry back as a request, if its URL has one of ``schemes``
    (REDISLOCK_ALLOWED_SCHEMES); raises whatever the format raises for an entry it cannot load or
    refuses."""
    return request_from_data(data, serializer, spider, schemes)


def split_value(value: bytes) -> tuple[str, bytes, bytes]:
    """An in-flight value (or what follows a dead letter's note) as (stage, mark, request bytes):
    see the module docstring."""
    head, _, data = value.partition(b"\n")
    stage, brace, mark = head.partition(b"{")
    return stage.decode("utf-8", "replace"), brace + mark, data


class BeatReply(NamedTuple):
    """What one beat learns (the reply of ``queue_beat.lua``; the worker that beats is
    :class:`~scrapy_redislock.workers.heartbeat.Heartbeat`): ``new`` (the worker was not registered:
    first beat, or taken for dead and reaped), how many entries its in-flight record ``holds`` (0 for
    a pulse), and workers past their deadline (``dead``, to reap)."""

    new: bool
    holds: int
    dead: list[str]


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class BlockingWait:
    """The blocked reads of a worker, on connections of their own (made on first wait): for a
    token, and for a start URL."""

    def __init__(self, client: AsyncRedisClient) -> None:
        self.client = client
        # a client whose reads never time out, for BLPOP and BLMOVE
        self._waiting: Any = None

    def _client(self) -> Any:
        """The connection's client, whose reads never time out, so that a long block is never cut
        into pieces."""
        if self._waiting is None:
            self._waiting = waiting_client(self.client) or self.client
        return self._waiting

    @staticmethod
    def _seconds(timeout: float) -> float:
        """A blocking command's timeout, in hundredths here, rounded up: it never ends before
        ``timeout``."""
        return max(0.01, math.ceil(timeout * 100) / 100)

    async def wait(self, keys: list[str], timeout: float) -> tuple[str, bytes] | None:
        """Block in Redis (BLPOP) until one of ``keys`` (signal lists, the wake list) has an entry,
        at most ``timeout`` s; (key, entry) or None."""
        reply = await self._client().blpop(keys, timeout=self._seconds(timeout))
        if reply is None:
            return None
        key, value = reply
        return str(text(key)), bytes(value) if not isinstance(value, str) else value.encode()

    async def wait_for_entry(self, key: str, timeout: float) -> bool:
        """Block in Redis until the list ``key`` (a start-URL feed) has an entry, at most
        ``timeout`` s; True if it has. It takes nothing: BLMOVE moves the head onto the head again,
        so a wait cancelled or a reply lost loses no entry (the take is feed_take.lua's)."""
        moved = await self._client().blmove(key, key, self._seconds(timeout), "LEFT", "LEFT")
        return moved is not None

    async def aclose(self) -> None:
        if self._waiting is not None and self._waiting is not self.client:
            await self._waiting.aclose()


class StageQueues:
    """One worker's handle on a spider's stage queues (see the module docstring)."""

    def __init__(
        self,
        client: AsyncRedisClient,
        spider: str,
        stages: Iterable[str],
        *,
        key_prefix: str = "redislock",
        ttl: float = 30.0,
        worker: str | None = None,
        order: str = "priority",
    ) -> None:
        self.client = client
        self.keys = QueueKeys.of(key_prefix, spider)
        self.stages = [check_name(s, "stage") for s in stages]
        if order not in ORDERS:
            raise InvalidArgument(f"order must be one of {ORDERS}, got {order!r}")
        # of the stage queues: scrapy-redis's SCHEDULER_QUEUE_CLASS (see queue_order)
        self.order = order
        self.scored_ids: set[str] = set()  # of the last pop: the ids taken from a sorted set
        self.ttl = check_ttl(ttl)
        self.worker = worker or new_worker_id()
        # the epoch script is both fronts' (crawl/scripts/)
        sources = {**worker_scripts(), **crawl_scripts()}
        mode = ScriptMode()  # EVALSHA, or FCALL of the functions an admin loaded (see _redis.py)
        self.scripts = {name: ProjectScript(client, src, mode) for name, src in sources.items()}
        self.blocking = BlockingWait(client)
        # seconds within which a popping worker beats again (the scheduler sets it)
        self.work_grace = self.ttl

    @property
    def ttl_ms(self) -> int:
        return max(1, round(self.ttl * 1000))

    @property
    def inflight_key(self) -> str:
        return self.keys.inflight(self.worker)

    def _queue_keys(self) -> list[str]:
        """Every stage's list, then every stage's sorted set (the scripts take them in this
        order)."""
        return [
            *(self.keys.queue(s) for s in self.stages),
            *(self.keys.scored(s) for s in self.stages),
        ]

    def _signal_keys(self) -> list[str]:
        return [self.keys.signal(s) for s in self.stages]

    def _check_stage(self, stage: str) -> str:
        if stage not in self.stages:
            raise KeyError(f"stage {stage!r} is not one of {self.stages}")
        return stage

    # -- a worker's own operations ----------------------------------------------------------------

    def score(self, priority: int) -> str:
        """Where a request of ``priority`` goes: '' the list; else its score in the sorted set
        (-priority, as in scrapy-redis's PriorityQueue). Only in priority order, and only for a
        priority other than 0."""
        if self.order != "priority" or not priority:
            return ""
        return str(-int(priority))

    async def push(self, stage: str, fingerprint: str, data: bytes, priority: int = 0) -> bool:
        """Queue a request unless its fingerprint was seen ('' = never filtered); False for a
        duplicate."""
        return (await self.push_many([(stage, fingerprint, data, priority)]))[0]

    async def push_many(self, requests: Sequence[tuple[Any, ...]]) -> list[bool]:
        """Queue (stage, fingerprint, data[, priority]) requests in one script call; False for each
        duplicate."""
        stages = list(dict.fromkeys(self._check_stage(request[0]) for request in requests))
        index = {stage: n for n, stage in enumerate(stages, 1)}
        args: list[Any] = []
        for stage, fingerprint, data, *priority in requests:
            args += [index[stage], fingerprint, self.score(priority[0] if priority else 0), data]
        keys = [self.keys.dupefilter, self.keys.sequence, *(self.keys.queue(s) for s in stages)]
        keys += [*(self.keys.scored(s) for s in stages), *(self.keys.signal(s) for s in stages)]
        return [
            bool(n) for n in await self.scripts["queue_push"](keys=keys, args=[len(stages), *args])
        ]

    async def seen(self, fingerprint: str) -> bool:
        """Record a fingerprint in the shared dupefilter; True if it was there already."""
        stage = self.stages[0]
        keys = [
            self.keys.dupefilter,
            self.keys.sequence,
            self.keys.queue(stage),
            self.keys.scored(stage),
        ]
        keys.append(self.keys.signal(stage))
        return not (await self.scripts["queue_push"](keys=keys, args=[1, 1, fingerprint, "", ""]))[
            0
        ]

    def mark(self, priority: int) -> str:
        """Where a request of ``priority`` goes back to at the front of its queue (an in-flight
        value's mark, see the module docstring): '' the list's right end, '{L}' its left end (LIFO
        order), '{P<score>:0000000000000000}' the head of its priority in the sorted set."""
        score = self.score(priority)
        if score:
            return f"{{P{score}:{0:016d}}}"
        return "{L}" if self.order == "lifo" else ""

    async def keep(self, home: str, requests: Sequence[tuple[str, str, bytes]]) -> list[int]:
        """Requests that name no stage, fetched by this worker: (fingerprint, mark, data) each; one
        ``queue_keep`` script records each fingerprint in the shared dupefilter together with the
        request in this worker's in-flight record (from where a dead or closing worker's requests go
        back to the front of ``home``'s queue). One integer each: its in-flight id (> 0), 0 a
        duplicate, -1 only its fingerprint recorded (no data), -2 queued in ``home``'s queue (this
        worker was taken for dead: nobody would requeue its record)."""
        self._check_stage(home)
        keys = [self.keys.dupefilter, self.inflight_key, self.keys.ids, self.keys.in_flight]
        keys += [self.keys.alive, self.keys.queue(home), self.keys.scored(home)]
        keys.append(self.keys.signal(home))
        args: list[Any] = [self.worker, home]
        for fingerprint, mark, data in requests:
            args += [fingerprint, mark, data]
        return [int(n) for n in await self.scripts["queue_keep"](keys=keys, args=args)]

    async def pop(
        self, stage: str, count: int, *, pass_on: bool = False
    ) -> list[tuple[str, bytes]] | None:
        """Take up to ``count`` requests of a stage, in the queues' order, into this worker's
        in-flight record: [(id, data)]; fewer than ``count``: the queue is empty now. ``pass_on``:
        if it may hold more, wake the next idle worker. :attr:`scored_ids` are then the ids taken
        from the stage's sorted set.

        None (nothing popped) if this worker is not registered: the others took it for dead and
        requeued what it had popped; :meth:`beat` first (it says so), then pop."""
        self._check_stage(stage)
        keys = [
            self.keys.queue(stage),
            self.keys.scored(stage),
            self.inflight_key,
            self.keys.ids,
            self.keys.alive,
        ]
        keys += [self.keys.in_flight, self.keys.signal(stage), self.keys.due]
        grace_ms = max(1, round(self.work_grace * 1000))
        args: list[int | str] = [count, stage, self.worker, int(pass_on), grace_ms, self.order]
        reply = await self.scripts["queue_pop"](keys=keys, args=args)
        self.scored_ids = set()
        if reply is None:
            return None
        popped = []
        for raw_id, data, mark in zip(reply[::3], reply[1::3], reply[2::3], strict=True):
            inflight_id = str(text(raw_id))
            popped.append((inflight_id, bytes(data)))
            if str(text(mark)).startswith("{P"):
                self.scored_ids.add(inflight_id)
        return popped

    async def ack(self, ids: Iterable[str]) -> int:
        """The requests are done (their output is queued): drop them from the in-flight record."""
        ids = list(ids)
        if not ids:
            return 0
        keys = [
            self.inflight_key,
            self.keys.in_flight,
            self.keys.wake,
            self.keys.alive,
            *self._queue_keys(),
        ]
        return int(await self.scripts["queue_ack"](keys=keys, args=ids))

    async def give_back(self, ids: Iterable[str]) -> int:
        """Put popped but unstarted requests (oldest first) back at the front of their queues."""
        ids = list(ids)
        if not ids:
            return 0
        keys = [self.inflight_key, self.keys.in_flight, *self._queue_keys(), *self._signal_keys()]
        return int(
            await self.scripts["queue_return"](
                keys=keys, args=[len(self.stages), *self.stages, *ids]
            )
        )

    async def bury(self, entries: Iterable[tuple[str, str]]) -> int:
        """Move popped entries that cannot be loaded to the dead-letter list: [(in-flight id,
        note)]."""
        args = [part for entry in entries for part in entry]
        if not args:
            return 0
        keys = [self.inflight_key, self.keys.deadletter, self.keys.in_flight]
        return int(await self.scripts["queue_bury"](keys=keys, args=args))

    async def beat(self, stage: str | None) -> bool:
        """This worker is alive and works on ``stage``; True if it was not registered (first beat,
        or the others took it for dead and requeued its in-flight requests)."""
        return (await self.heartbeat(stage)).new

    async def heartbeat(
        self,
        stage: str | None,
        dead_max: int = 8,
        *,
        grace: float | None = None,
        pulse: bool = False,
    ) -> BeatReply:
        """:meth:`beat`, how many entries this worker's in-flight record holds, and up to
        ``dead_max`` workers past their deadline (for :meth:`reap`): one script call. The worker
        promises its next beat within ``grace`` seconds (default the ttl). A ``pulse`` only beats
        and names the dead (it does not count the in-flight record, nor note the stage again)."""
        keys = [self.keys.alive, self.keys.working, self.inflight_key, self.keys.due]
        grace_ms = self.ttl_ms if grace is None else max(1, round(grace * 1000))
        args: list[int | str] = [self.worker, stage or "", grace_ms, dead_max, int(pulse)]
        reply = await self.scripts["queue_beat"](keys=keys, args=args)
        return BeatReply(bool(reply[1]), int(reply[2]), [str(text(w)) for w in reply[3:]])

    async def epoch(self) -> str:
        """The queues' epoch, made now if missing (one script: GET, and SET when missing). A worker
        reads it only when a beat says it was not registered (its first beat, taken for dead, or
        Redis lost the crawl state): an epoch other than the one it saw before means the crawl state
        is gone, not that it was taken for dead."""
        return str(text(await self.scripts[EPOCH_SCRIPT](keys=[self.keys.epoch], args=[])))

    async def reclaim(self, known: Iterable[str] | Callable[[], Iterable[str] | None]) -> int:
        """Put every entry of this worker's in-flight record that is not ``known`` back at the front
        of its queue (popped or kept by a call whose reply was lost); returns how many. A callable
        is asked once the record is read: None when a call that adds to the record awaits its reply
        (its entries are not known yet: nothing is given back). Only the worker itself adds to its
        record, so nothing it does not know of can appear between the read and :meth:`give_back`."""
        listed = {str(text(i)) for i in await self.client.hkeys(self.inflight_key)}
        ids = known() if callable(known) else known
        if ids is None:
            return 0
        return await self.give_back(sorted(listed - set(ids), key=int))  # oldest first

    async def leave(self) -> int:
        """On close: give every request still in this worker's in-flight record back, and
        unregister."""
        moved, left = await self._requeue(self.worker, 0)
        if left:
            logger.error(
                "%d in-flight requests of unknown stages stay in %s", left, self.inflight_key
            )
        return moved

    # -- the cluster -------------------------------------------------------------------------------

    async def _requeue(self, worker: str, silence_ms: int) -> tuple[int, int]:
        keys = [self.keys.alive, self.keys.inflight(worker), self.keys.working, self.keys.in_flight]
        keys += [*self._queue_keys(), *self._signal_keys(), self.keys.due]
        moved, left = await self.scripts["queue_requeue"](
            keys=keys, args=[worker, silence_ms, *self.stages]
        )
        return int(moved), int(left)

    async def reap(self, silent: Iterable[str] | None = None) -> dict[str, int]:
        """Requeue the in-flight requests of every worker past its deadline (default: look them up;
        a worker passes those its :meth:`heartbeat` named); {worker: requests requeued}."""
        if silent is None:
            seconds, micros = await self.client.time()
            now = int(seconds) * 1000 + int(micros) // 1000
            silent = [
                str(text(w))
                for w in await self.client.zrangebyscore(self.keys.due, "-inf", f"({now}")
            ]
        reaped: dict[str, int] = {}
        for worker in silent:
            if worker == self.worker:
                continue  # our own beat is late (a stalled loop): we are evidently alive
            moved, left = await self._requeue(worker, self.ttl_ms)
            if moved < 0:
                continue  # it beat meanwhile
            reaped[worker] = moved
            if left:
                logger.error(
                    "%d in-flight requests of unknown stages stay in %s",
                    left,
                    self.keys.inflight(worker),
                )
        return reaped

    async def workers(self) -> dict[str, int]:
        """Registered workers and their last beat (ms, Redis's clock)."""
        # withscores: (member, score) pairs (redis-py's return type is a union that also has plain
        # members)
        pairs = cast(
            list[Sequence[Any]], await self.client.zrange(self.keys.alive, 0, -1, withscores=True)
        )
        return {str(text(w)): int(score) for w, score in pairs}

    async def look(self) -> tuple[dict[str, int], int]:
        """Pending requests per stage (both parts of each queue: LLEN and ZCARD), and requests in
        flight in every worker: one read-only script (``queue_look``)."""
        in_flight, *pending = await self.scripts["queue_look"](
            keys=[self.keys.in_flight, *self._queue_keys()]
        )
        return dict(zip(self.stages, (int(n) for n in pending), strict=True)), int(in_flight)

    async def in_flight(self) -> int:
        """Requests in flight in every worker (popped, not done yet): one GET of the scripts'
        counter."""
        return int(await self.client.get(self.keys.in_flight) or 0)

    async def signal(self, stage: str) -> None:
        """Put a token back on a stage's signal list (taken by a worker that could not take the
        stage)."""
        await self.client.lpush(self.keys.signal(stage), "1")

    async def aclose(self) -> None:
        await self.blocking.aclose()

    async def clear_if_alone(self) -> bool:
        """Delete the spider's whole crawl state if no other worker is alive; True if it did
        (SCHEDULER_FLUSH_ON_START: queued work goes too)."""
        return await self._clear(finished_only=False) == 1

    async def clear_if_finished(self, dry: bool = False) -> int:
        """Delete the spider's whole crawl state if no other worker is alive and no work is left
        anywhere (nothing queued in any stage, a paused one's included, nothing in flight in any
        worker's record): SCHEDULER_PERSIST = False at close, and at start over what a crawl that
        did not close cleanly left. 1 cleared, 0 another worker is alive, -1 work is left (nothing
        deleted). ``dry``: delete nothing, only tell (1: it would clear)."""
        return await self._clear(finished_only=True, dry=dry)

    async def dupefilter_size(self) -> int:
        """Fingerprints in the shared dupefilter (SCARD)."""
        return int(await self.client.scard(self.keys.dupefilter))

    async def _clear(self, *, finished_only: bool, dry: bool = False) -> int:
        registered = await self.workers()
        keys: list[Any] = [self.keys.alive, self.keys.working, self.keys.dupefilter, self.keys.ids]
        keys += [self.keys.in_flight, self.keys.wake, *self._queue_keys(), *self._signal_keys()]
        keys += [self.keys.inflight(w) for w in {*registered, self.worker}]
        keys += [self.keys.epoch, self.keys.due, self.keys.sequence]
        args: list[Any] = [self.worker, self.ttl_ms, "finished" if finished_only else ""]
        args += ["dry"] if dry else []
        return int(await self.scripts["queue_clear"](keys=keys, args=args))


def requeue_now(client: RedisClient, keys: QueueKeys, worker: str) -> tuple[int, int]:
    """An operator's requeue, with a blocking client (the command line): put every request in
    ``worker``'s in-flight record back at the front of its stage's queue and unregister the worker,
    now, whether it still beats or not (one ``queue_requeue`` script; the stages are read from the
    record itself). Returns (requeued, left in the record).

    A worker that was alive after all learns at its next beat that it was taken for dead and drops
    what it had taken ahead; what it had in progress is fetched twice (at least once, as when the
    others reap it)."""
    values = client.execute_command("HVALS", keys.inflight(worker), **{NEVER_DECODE: []}) or []
    stages = sorted({split_value(bytes(value))[0] for value in values})
    script_keys = [keys.alive, keys.inflight(worker), keys.working, keys.in_flight]
    script_keys += [*(keys.queue(s) for s in stages), *(keys.scored(s) for s in stages)]
    script_keys += [*(keys.signal(s) for s in stages), keys.due]
    script = ProjectScript(
        client,
        worker_scripts(("queue_requeue",))["queue_requeue"],
        ScriptMode(),
    )
    moved, left = script(keys=script_keys, args=[worker, 0, *stages])
    return int(moved), int(left)
