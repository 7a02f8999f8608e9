"""Sub-queues per stage inside the inner scheduler, so that a capped request leaves it only when it
can go.

StageScheduler does not pull requests out of the inner scheduler to wait elsewhere (that lost their
priority order, and drained a shared queue into one process's memory). It gives the inner scheduler
queues that know each request's stage (and key, when keys are capped) and pop only from a sub-queue
whose stage (and key) can take a request now, as the :class:`Admission` says. Within a sub-queue the
inner queue's own order holds (priority, LIFO/FIFO, callback requests before start requests); across
sub-queues that can go, the head of highest priority goes first (a callback request before a start
request of the same priority), then, among equal heads, the one the single queue would have given
first (the earlier pushed for a FIFO queue, the later for a LIFO one), else the sub-queue that
waited longest.

- :class:`StagePriorityQueues` for Scrapy's scheduler (memory and JOBDIR disk queues): one
  SCHEDULER_PRIORITY_QUEUE per sub-queue, as Scrapy's DownloaderAwarePriorityQueue keeps one per
  download slot; on disk, one directory per sub-queue and the state of all of them in the
  scheduler's own state file;
- :class:`SharedStageQueues` for scrapy-redis's scheduler: one scrapy-redis queue of the same class
  per capped stage, at ``<the spider's queue key>:<stage>``; the spider's own key keeps the requests
  of no capped stage and takes whatever other producers push (a capped request found there that
  cannot go yet moves to its stage's key). The queue stays shared: what a process has not started
  stays in Redis, visible to and takeable by every process. scrapy-redis's classes (redis-py's
  blocking client) are called in :class:`QueueThread`, never on the reactor thread: the engine's
  next_request takes the one request fetched ahead there.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import json
import logging
import math
import re
import time
import uuid
import weakref
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from scrapy.utils.misc import build_from_crawler
from scrapy_redis.queue import FifoQueue, LifoQueue, PriorityQueue

from scrapy_redislock._redis import Backoff, ProjectScript, ScriptMode
from scrapy_redislock.crawl.epoch import (
    RECORD_KEPT_MS,
    SHARED_POP_SCRIPT,
    SharedQueueKeys,
    crawl_scripts,
)
from scrapy_redislock.crawl.reach import OUTAGE_ERRORS, REDIS_ERRORS, REFUSED

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable

    from scrapy import Request
    from scrapy.crawler import Crawler

    from scrapy_redislock.lock.core import Clock

# A sub-queue: (capped stage or None, key or None).
Route = tuple[str | None, str | None]
UNCAPPED: Route = (None, None)

# scrapy-redis answers every pop with a Redis command. Under an engine (in the queue thread), a
# sub-queue a pop found empty is not popped again until a look at the lengths of the queue's keys
# (one command per key, not a pop script per sub-queue) finds requests in it, or this process pushes
# to it. While one is found empty, a look runs after a pause doubling from EMPTY_PAUSE (again each
# time a sub-queue is newly found empty, or a look finds requests) up to EMPTY_PAUSE_MOST while
# this process takes or pushes requests, and after ENGINE_HEARTBEAT once it has moved none for as
# long: an idle process looks once per heartbeat of Scrapy's engine, as scrapy-redis's own idle
# polling does, and never wakes the engine for a look that found nothing.
# Driven without an engine, a sub-queue found empty is popped again after such a pause instead.
EMPTY_PAUSE = 0.05
EMPTY_PAUSE_MOST = 0.5
ENGINE_HEARTBEAT = 5.0  # Scrapy's engine asks its scheduler at least this often (seconds)
LOOK_FRESH = 0.5  # has_requests() answers False from a look at most this old (seconds)
OUTAGE_PAUSE_MOST = 2.0  # seconds between attempts at most while Redis does not answer
# how scrapy-redis's own queue classes pop (crawl/scripts/shared_pop.lua); another class pops itself
POP_KINDS: dict[type, str] = {PriorityQueue: "priority", FifoQueue: "fifo", LifoQueue: "lifo"}

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = [
    "Admission",
    "QueueThread",
    "SharedStageQueues",
    "StagePriorityQueues",
    "StageQueueFactory",
    "push_back",
    "retrieved",
    "split_queues",
]


class Admission(Protocol):
    """What the sub-queues ask StageScheduler."""

    def route(self, request: Request) -> Route:
        """The sub-queue of ``request``: its capped stage (None: not capped) and its key (None: keys
        not capped)."""

    def may_go(self, route: Route) -> bool:
        """Whether a request of this sub-queue can leave the scheduler now."""

    def queue_route(self, request: Request) -> Route:
        """The sub-queue to push ``request`` into now: its route, or its key's while that key is
        blocked (:mod:`~scrapy_redislock.requests.keyline`)."""

    def divert(self, request: Request, route: Route) -> Route | None:
        """Where a request just popped from ``route`` waits instead of leaving (its key's sub-queue,
        the key being blocked now), or None: it leaves."""

    def emptied(self, route: Route) -> None:
        """The sub-queue ``route`` ran out of requests and is gone."""


def _route_id(route: Route) -> str:
    return json.dumps(list(route))


def _route_of(route_id: str) -> Route:
    stage, key = json.loads(route_id)
    return stage, key


def _dirname(route: Route) -> str:
    """A directory name for a sub-queue: readable where it can be, unique by a hash."""
    text = "-".join("" if part is None else part for part in route) or "-"
    digest = hashlib.md5(_route_id(route).encode(), usedforsecurity=False).hexdigest()[:12]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', text)[:60]}-{digest}"


class StageQueueFactory:
    """Stands in for SCHEDULER_PRIORITY_QUEUE in Scrapy's scheduler: builds
    :class:`StagePriorityQueues` over it."""

    def __init__(self, pqclass: Any, admission: Admission) -> None:
        self.pqclass = pqclass
        self.admission = admission
        self.__qualname__ = f"StagePriorityQueues[{getattr(pqclass, '__qualname__', pqclass)}]"

    def from_crawler(
        self,
        crawler: Crawler,
        downstream_queue_cls: type,
        key: str,
        startprios: Any = None,
        *,
        start_queue_cls: type | None = None,
    ) -> StagePriorityQueues:
        return StagePriorityQueues(
            crawler,
            self.admission,
            self.pqclass,
            downstream_queue_cls,
            key,
            startprios,
            start_queue_cls=start_queue_cls,
        )


class StagePriorityQueues:
    """One priority queue (the crawl's SCHEDULER_PRIORITY_QUEUE) per sub-queue; pops only where the
    admission says go."""

    def __init__(
        self,
        crawler: Crawler,
        admission: Admission,
        pqclass: Any,
        downstream_queue_cls: type,
        key: str,
        startprios: Any = None,
        *,
        start_queue_cls: type | None = None,
    ) -> None:
        if startprios and not isinstance(startprios, dict):
            raise ValueError(
                f"the JOBDIR's scheduler state ({startprios!r}) was written without StageScheduler's sub-queues (SCHEDULER was Scrapy's own, or REDISLOCK_ENABLED was False); a crawl can only be resumed with the scheduler and priority queue it was started with"  # noqa: E501
            )
        self.crawler = crawler
        self.admission = admission
        self.pqclass = pqclass
        self.downstream_queue_cls = downstream_queue_cls
        self.key = key
        self.start_queue_cls = start_queue_cls
        self.queues: dict[Route, Any] = {}
        # requests per sub-queue, kept here: len() of Scrapy's DownloaderAwarePriorityQueue walks
        # every download slot's queue
        self._sizes: Counter[Route] = Counter()
        self._stage_sizes: Counter[str | None] = Counter()  # the same per stage: count() per ask
        # request -> push order
        self._pushed: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()
        self._pushes = itertools.count()
        self._callback_lifo = _is_lifo(downstream_queue_cls)
        self._start_lifo = (
            _is_lifo(start_queue_cls) if start_queue_cls is not None else self._callback_lifo
        )
        self._turns: dict[Route, int] = {}  # sub-queue -> when it last gave a request (a counter)
        self._turn = 0
        for route_id, prios in (startprios or {}).items():
            route = _route_of(route_id)
            self.queues[route] = self._new(route, prios)
            self._resize(route, len(self.queues[route]))
        # built at once, so that a priority queue refusing the settings says so now
        if UNCAPPED not in self.queues:
            self.queues[UNCAPPED] = self._new(UNCAPPED)

    def _new(self, route: Route, startprios: Any = ()) -> Any:
        return build_from_crawler(
            self.pqclass,
            self.crawler,
            downstream_queue_cls=self.downstream_queue_cls,
            key=str(Path(self.key, _dirname(route))) if self.key else "",
            startprios=startprios,
            start_queue_cls=self.start_queue_cls,
        )

    def push(self, request: Request) -> None:
        self.push_to(self.admission.queue_route(request), request)

    def push_to(self, route: Route, request: Request) -> None:
        """Push into the sub-queue ``route`` (made if needed); a request pushed again keeps its first
        push order."""
        queue = self.queues.get(route)
        if queue is None:
            queue = self.queues[route] = self._new(route)
        if request not in self._pushed:
            self._pushed[request] = next(self._pushes)
        queue.push(request)
        self._resize(route, self._sizes[route] + 1)

    def _resize(self, route: Route, size: int) -> None:
        self._stage_sizes[route[0]] += size - self._sizes[route]
        self._sizes[route] = size

    def _next(self) -> Route | None:
        ready = [
            route for route in self.queues if self._sizes[route] and self.admission.may_go(route)
        ]
        if len(ready) < 2:
            return ready[0] if ready else None  # no head to compare (peek can cost a scan)
        best: tuple[int, int] | None = None
        tied: list[Route] = []
        for route in ready:
            rank = _head_rank(self.queues[route])
            if best is None or rank < best:
                best, tied = rank, [route]
            elif rank == best:
                tied.append(route)
        if len(tied) < 2:
            return tied[0] if tied else None
        assert best is not None
        lifo = self._start_lifo if best[1] else self._callback_lifo
        return min(
            tied, key=lambda route: (self._push_order(route, lifo), self._turns.get(route, 0))
        )

    def _push_order(self, route: Route, lifo: bool) -> float:
        """Where the sub-queue's head stands in the order one queue would give: its push order
        (negated for LIFO); unknown (a request read back from disk) sorts after the known ones."""
        _settle(self.queues[route])
        try:
            head = self.queues[route].peek()
        except NotImplementedError:
            return math.inf
        order = self._pushed.get(head) if head is not None else None
        if order is None:
            return math.inf
        return -order if lifo else order

    def pop(self) -> Request | None:
        while True:
            route = self._next()
            if route is None:
                return None
            request = self._pop(route)
            to = None if request is None else self.admission.divert(request, route)
            if request is None or to is None:
                return request
            self.push_to(to, request)  # its key is blocked: it waits in its key's sub-queue

    def _pop(self, route: Route) -> Request | None:
        queue = self.queues[route]
        request = queue.pop()
        # a queue that had nothing to give after all (a disk entry that could not be read) is
        # counted again
        self._resize(route, self._sizes[route] - 1 if request is not None else len(queue))
        self._turn += 1
        self._turns[route] = self._turn
        if not self._sizes[route] and route != UNCAPPED:
            del self.queues[route], self._sizes[route]
            self._turns.pop(route, None)
            queue.close()
            if self.key:  # reclaim the sub-queue's directory; rmdir leaves it alone if files remain
                with suppress(OSError):
                    Path(self.key, _dirname(route)).rmdir()
            self.admission.emptied(route)
        return request

    def peek(self) -> Request | None:
        route = self._next()
        if route is None:
            return None
        _settle(self.queues[route])
        return self.queues[route].peek()

    def close(self) -> dict[str, Any]:
        state = {_route_id(route): queue.close() for route, queue in self.queues.items()}
        self.queues.clear()
        self._sizes.clear()
        self._stage_sizes.clear()
        return state

    def count(self, stage: str) -> int:
        """Requests of ``stage`` queued here."""
        return self._stage_sizes[stage]

    def count_route(self, route: Route) -> int:
        """Requests queued in the sub-queue ``route``."""
        return self._sizes[route]

    def __len__(self) -> int:
        return sum(self._sizes.values())


def split_queues(inner: Any) -> list[StagePriorityQueues]:
    """The memory and disk queues of Scrapy's scheduler ``inner``, as StageQueueFactory split them
    (none for a scheduler it could not split)."""
    queues = (getattr(inner, "mqs", None), getattr(inner, "dqs", None))
    return [queue for queue in queues if isinstance(queue, StagePriorityQueues)]


def push_back(inner: Any, request: Request, route: Route | None = None) -> None:
    """Put a request that was queued once back into Scrapy's scheduler ``inner`` (into the sub-queue
    ``route``; None: the one its stage and key give), without its dupefilter: on disk with JOBDIR,
    in memory if it cannot be serialized, as Scrapy's scheduler does. Counted as queued again
    (``scheduler/enqueued``, as Scrapy counts a push), since its next pop counts it as dequeued
    again: enqueued less dequeued stays what is queued."""

    def push(queue: Any) -> None:
        if route is None:
            queue.push(request)
        else:
            queue.push_to(route, request)

    where = "memory"
    dqs = getattr(inner, "dqs", None)
    if dqs is not None:
        with suppress(ValueError):  # it cannot be serialized: memory
            push(dqs)
            where = "disk"
    if where == "memory":
        push(inner.mqs)
    stats = getattr(inner, "stats", None)
    if stats is not None:
        stats.inc_value(f"scheduler/enqueued/{where}")
        stats.inc_value("scheduler/enqueued")


def _is_lifo(queue_cls: Any) -> bool:
    """Whether a downstream queue class gives the last pushed first (Scrapy's and queuelib's Lifo*
    queues)."""
    return any("Lifo" in cls.__name__ for cls in getattr(queue_cls, "__mro__", ()))


def _settle(queue: Any) -> None:
    """Bring a Scrapy priority queue's current priority up to date before it is peeked or ranked
    (each of DownloaderAwarePriorityQueue's per-slot queues): ``ScrapyPriorityQueue.pop()`` leaves
    ``curprio`` on a priority it emptied while start requests remain, moving on at its next pop, and
    ``peek()`` then raises KeyError. Scrapy's own scheduler never peeks. This is what the next pop
    would do first, so the order is Scrapy's."""
    pqueues = getattr(queue, "pqueues", None)
    for pq in pqueues.values() if isinstance(pqueues, dict) else (queue,):
        curprio = getattr(pq, "curprio", None)
        if (
            curprio is not None
            and curprio not in getattr(pq, "queues", {curprio: None})
            and curprio not in getattr(pq, "_start_queues", {})
            and hasattr(pq, "_update_curprio")
        ):
            pq._update_curprio()


def _head_rank(queue: Any) -> tuple[int, int]:
    """How soon a sub-queue's head goes: its priority (lower first: Scrapy's queues keep -priority),
    then a callback request before a start request of that priority (Scrapy's order within one
    queue)."""
    _settle(queue)
    curprio = getattr(queue, "curprio", None)
    if curprio is None:
        try:
            head = queue.peek()
        except NotImplementedError:
            return 0, 0
        return (0, 0) if head is None else (-head.priority, 0)
    return curprio, 0 if curprio in getattr(queue, "queues", {curprio: None}) else 1


class QueueThread:
    """The one thread that talks to scrapy-redis's queue and dupefilter while the reactor runs.

    scrapy-redis's classes send their commands with redis-py's blocking client: on the reactor
    thread each one stalled the whole crawl for a round trip to Redis. They run here instead, one
    job at a time in the order they were given (a push before the pop that follows it, a request
    given back before the queue is flushed), with the same queue classes, serializer and dupefilter:
    scrapy-redis stays the spec of the shared queue. A scheduler driven by no engine (a caller
    calling it synchronously, as scrapy-redis's own tests do), and the queue thread itself, make
    their calls at once instead (:meth:`on_reactor`): there is no reactor to stall."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self.jobs = 0  # given and not finished (a request may be on its way to Redis)
        self.engine = False  # an engine drives the scheduler (set at its open())

    def on_reactor(self) -> bool:
        """Whether calls are to go to the queue thread: an engine drives the scheduler and this
        thread runs its event loop (the reactor's)."""
        if not self.engine:
            return False
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    def run(self, job: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """``job(*args)`` in the queue thread, after every job given before; its future (whose
        callbacks run on the reactor thread)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="redislock-shared-queue"
            )
        self.jobs += 1
        future = asyncio.wrap_future(self._executor.submit(job, *args))
        future.add_done_callback(self._done)
        return future

    def _done(self, _: asyncio.Future[Any]) -> None:
        self.jobs -= 1

    async def drain(self) -> None:
        """Once every job given so far is done."""
        if self._executor is not None:
            await self.run(_nothing)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None


def _nothing() -> None:
    return None


def retrieved(task: asyncio.Task[None]) -> None:
    """A look that failed otherwise than by a Redis error: logged, not left to asyncio's "Task
    exception was never retrieved"."""
    if not task.cancelled() and (error := task.exception()) is not None:
        logger.error("Looking at the shared queue in Redis failed: %r", error, exc_info=error)


def _return_to(queue: Any, request: Request) -> None:
    """``request``, just popped from ``queue``, back where it was: scrapy-redis's PriorityQueue
    (same score, same member) and LifoQueue put it back at the head with a push; its FifoQueue pops
    from the right, so it goes back on the right. Another queue class: pushed."""
    kind = type(queue)
    if kind.push is FifoQueue.push and kind.pop is FifoQueue.pop:
        queue.server.rpush(queue.key, queue._encode_request(request))
    else:
        queue.push(request)


class Unreadable(Exception):
    """A request popped from the shared queue that scrapy-redis could not read back (a callback the
    spider no longer has, another serializer's payload): out of Redis, and lost. Never raised out
    of :class:`SharedStageQueues`: it says so (``unreadable``)."""

    def __init__(self, key: str, data: bytes) -> None:
        super().__init__(key, data)
        self.key, self.data = key, data


class SharedStageQueues:
    """scrapy-redis's queue, split by capped stage in Redis; takes the place of its scheduler's
    ``queue``.

    On the reactor thread it sends nothing to Redis itself: pushes and pops go to the
    :class:`QueueThread`. ``pop`` answers from one request fetched ahead (``ahead``), taken from
    Redis in the queue thread for a sub-queue that could go when the engine last asked, and starts
    the next fetch; the engine is woken when it arrives. A process holds out of Redis at most that
    one request besides what left the scheduler (never more: the next is fetched only once it is
    taken), and it goes back to its place in Redis (:func:`_return_to`) when its stage cannot take
    it any more, or when the spider closes (:meth:`settle`).

    A pop of scrapy-redis's own queue classes is ``crawl/scripts/shared_pop.lua``: the pop as
    scrapy-redis's, kept aside in Redis under this process's number for it, so that the same pop
    again after its reply was lost (a silent network, redis-py's own retry) answers the same request
    rather than the next one, the first lost without a word."""

    def __init__(
        self,
        base: Any,
        stages: Iterable[str],
        admission: Admission,
        *,
        prefix: str,
        asked_while_paused: Callable[[float], None],
        thread: QueueThread | None = None,
        wake: Callable[[], None] = lambda: None,
        clock: Clock = time.monotonic,
        leftover: Iterable[str] = (),
    ) -> None:
        self.base = base
        self.clock = clock  # monotonic seconds: the sub-queues' pauses, the outage's length
        self.admission = admission
        self.asked_while_paused = asked_while_paused
        self.thread = thread
        self.wake = wake  # the engine asks again (a request arrived, or the queue was read)
        self.queues: dict[str | None, Any] = {None: base}
        # configured stages not capped now: what an earlier run queued under their own key, when
        # they were capped, is read until found empty once (pushes go to the spider's own key)
        self._leftover = set(leftover) - set(stages)
        for stage in [*stages, *sorted(self._leftover)]:
            self.queues[stage] = type(base)(
                server=base.server,
                spider=base.spider,
                key=self.key_of(stage),
                serializer=base.serializer,
            )
        process = uuid.uuid4().hex[:12]
        self._popped = {  # this process's last pop of each sub-queue (REDISLOCK_KEY_PREFIX)
            stage: SharedQueueKeys.popped(prefix, str(queue.key), process)
            for stage, queue in self.queues.items()
        }
        self._pops = dict.fromkeys(self.queues, 0)  # each sub-queue's pops that brought a request
        # sub-queues whose last pop got no reply: its request may be in the record only, until the
        # same pop is asked again (at the latest at close)
        self._unanswered: set[str | None] = set()
        self._pop_script = ProjectScript(
            base.server, crawl_scripts()[SHARED_POP_SCRIPT], ScriptMode()
        )
        self._pauses = {
            stage: Backoff(first=EMPTY_PAUSE, most=EMPTY_PAUSE_MOST) for stage in self.queues
        }
        self._ask_at = dict.fromkeys(self.queues, 0.0)
        # pushes by this process per sub-queue (counted in the queue thread, where they run)
        self._pushes = dict.fromkeys(self.queues, 0)
        # sub-queues a fetch found empty, with their push count then: not popped (no slot asked for
        # a capped stage's) while no look found requests in them and this process pushed none
        self._empty: dict[str | None, int] = {}
        self._moved_at = -math.inf  # when this process last took or pushed a request
        self._probe_pause = EMPTY_PAUSE  # before the next look while a sub-queue is found empty
        self._probe: asyncio.TimerHandle | None = None
        # has_requests() answered True for a job or look under way: the engine is woken once it
        # comes back, so that it can tell the spider idle then, not at its next heartbeat
        self._owed = False
        self._turns = dict.fromkeys(self.queues, 0)
        self._turn = 0
        self._drained: set[str | None] = set()  # leftover sub-queues found empty: not asked again
        self._reading_leftover: set[str | None] = set()  # said once each
        self._outage = Backoff(first=EMPTY_PAUSE, most=OUTAGE_PAUSE_MOST)
        self._out_since: float | None = None  # when Redis stopped answering (None: it answers)
        self._known_length = 0
        # pushed while Redis did not answer
        self.unpushed: deque[tuple[str | None, Request]] = deque()
        # scheduled while Redis did not answer (scrapy-redis's dupefilter could not be asked): given
        # to ``enqueue`` (the inner scheduler's enqueue_request) again at the next pop
        self.held: deque[Request] = deque()
        self.enqueue: Callable[[Request], Any] | None = None
        self.moved = 0  # requests pushed or taken by this process (QueueWatch: it knew of work)
        # QueueWatch.look_now: when Redis answers again after an outage, and when the queue is empty
        self.check: Callable[[], None] | None = None
        # QueueWatch.look (the epoch and the lengths, in the queue thread): for has_requests()
        self.look: Callable[[], Awaitable[BaseException | None]] | None = None
        # StageScheduler's: a request that could not be scheduled (Redis did not answer) is held
        self.on_held: Callable[[Request, BaseException], None] = self.hold
        # a request scrapy-redis's dupefilter refused (Scrapy's request_dropped signal)
        self.dropped: Callable[[Request], None] = lambda request: None
        # a held request the dupefilter read as seen when scheduled again, queued all the same
        self.seen_again: Callable[[Request], None] = lambda request: None
        # what became of requests kept in memory, queued again in the queue thread: (the request,
        # None when it was seen again, else the error that lost it), said on the reactor thread
        self._requeued: deque[tuple[Request, BaseException | None]] = deque()
        # QueueWatch.unqueueable: a request scrapy-redis failed to queue otherwise than by an
        # outage (its serializer, or Redis, refused it): lost, so the crawl must not finish cleanly
        self.lost: Callable[[Request, BaseException], None] = self._log_failure
        # QueueWatch.unreadable: a popped request scrapy-redis could not read back (lost); those
        # found in the queue thread at close wait here to be said on the reactor thread
        self.unreadable: Callable[[Unreadable], None] = self._log_unreadable
        self._unreadable: deque[Unreadable] = deque()
        # with a QueueThread:
        # (its stage, the request, whether it was popped from its stage's own key) from Redis
        self.ahead: tuple[str | None, Request, bool] | None = None
        self._fetch: asyncio.Future[Any] | None = None
        self._error: BaseException | None = None  # raised at the next pop (as scrapy-redis would)
        self._length: int | None = None  # requests in Redis at the last look (None: unknown)
        self._length_at = 0.0
        self._looking: asyncio.Task[None] | None = None
        self.closing = False

    @property
    def key(self) -> str:
        return str(self.base.key)

    @property
    def server(self) -> Any:
        return self.base.server

    def key_of(self, stage: str) -> str:
        """The Redis key of ``stage``'s queue (escaped for scrapy-redis's ``key % {"spider":
        ...}``)."""
        return f"{self.base.key}:{stage}".replace("%", "%%")

    def read_queues(self) -> list[Any]:
        """The sub-queues still read: all but the leftover ones found empty (their lengths are not
        looked at again)."""
        return [self.queues[stage] for stage in self.read_stages()]

    def _threaded(self) -> bool:
        """Whether Redis is to be asked in the queue thread (the reactor runs in this one)."""
        return self.thread is not None and self.thread.on_reactor()

    def _stage_of(self, request: Request) -> str | None:
        stage = self.admission.route(request)[0]
        return stage if stage in self.queues and stage not in self._leftover else None

    # -- pushes ------------------------------------------------------------------------------------

    def schedule(self, request: Request) -> None:
        """The inner scheduler's enqueue_request (scrapy-redis's dupefilter, then :meth:`push`), in
        the queue thread; a request its dupefilter refused is dropped then (``dropped``: Scrapy's
        request_dropped signal), one it could not ask is held (``on_held``)."""
        assert self.thread is not None
        self._stage_of(request)  # its route, worked out here (the queue thread only reads it)
        self._length = None
        future = self.thread.run(self._enqueue_now, request)
        future.add_done_callback(lambda done: self._scheduled(request, done))

    def _enqueue_now(self, request: Request) -> bool | BaseException:
        assert self.enqueue is not None
        try:
            return bool(self.enqueue(request))
        except OUTAGE_ERRORS as exc:
            if isinstance(exc, REFUSED):
                raise
            return exc

    def _scheduled(self, request: Request, done: asyncio.Future[bool | BaseException]) -> None:
        self._length = None
        try:
            result = done.result()
        except Exception as exc:  # whatever scrapy-redis raised: said here
            self._failed(exc, request)
        else:
            if isinstance(result, BaseException):
                self.on_held(request, result)
            elif not result:
                self.dropped(request)
        self._answer_owed()

    def _failed(self, exc: BaseException, request: Request | None = None) -> None:
        """A job failed otherwise than by an outage: a refusal (credentials, an ACL) is raised from
        the engine's next ask, as scrapy-redis's own call would have raised it; a request that
        could not be queued, refused or otherwise, is lost (``lost``: no clean finish)."""
        if isinstance(exc, REFUSED):
            self._error = exc
            self.wake()
        if request is not None:
            self.lost(request, exc)
            return
        self._log_failure(request, exc)

    def _log_unreadable(self, exc: Unreadable) -> None:
        logger.error("A request popped from %s could not be read: %r", exc.key, exc.__cause__)

    def _say_unreadable(self) -> None:
        while self._unreadable:
            self.unreadable(self._unreadable.popleft())

    def _log_failure(self, request: Request | None, exc: BaseException) -> None:
        logger.error(
            "scrapy-redis's queue in Redis failed on %s: %r",
            request if request is not None else "a pop",
            exc,
            exc_info=exc,
        )

    def push(self, request: Request) -> None:
        """Into its stage's queue; kept in memory while Redis does not answer, and pushed at the
        next pop. Called by scrapy-redis's enqueue_request: in the queue thread while the reactor
        runs."""
        self._push_now(self._stage_of(request), request)

    def _push_now(self, stage: str | None, request: Request, *, back: bool = False) -> None:
        try:
            if back:
                _return_to(self.queues[stage], request)
            else:
                self.queues[stage].push(request)
        except OUTAGE_ERRORS as exc:
            if isinstance(exc, REFUSED):
                raise
            self._went_out(exc)
            self.unpushed.append((stage, request))
            return
        self.moved += 1
        self._pushes[stage] += 1  # it is no longer known empty (in this thread: no race with a pop)
        self._moved_at = self.clock()
        self._ask_at[stage] = 0.0
        self._pauses[stage].reset()

    def give_back(self, request: Request, *, back: bool = False) -> None:
        """Push ``request`` (one that left but never went out, or, ``back``, one fetched ahead to
        its place): in the queue thread while the reactor runs, after what was given before."""
        stage = self._stage_of(request)
        if not self._threaded():
            self._push_now(stage, request, back=back)
            return
        assert self.thread is not None
        self._length = None
        future = self.thread.run(functools.partial(self._push_now, stage, request, back=back))
        future.add_done_callback(lambda done: self._pushed(request, done))

    def _pushed(self, request: Request, done: asyncio.Future[None]) -> None:
        self._length = None
        if (exc := done.exception()) is not None:
            self._failed(exc, request)
        self._answer_owed()

    def hold(self, request: Request, exc: BaseException) -> None:
        """``request`` could not be scheduled (the dupefilter or the queue did not answer): kept in
        memory and scheduled again at the next pop, never dropped."""
        self._went_out(exc)
        if not self.held:
            logger.info(
                "Requests scheduled while Redis does not answer are kept in memory, and queued once it answers (redislock/queue_held)"  # noqa: E501
            )
        self.held.append(request)

    @property
    def in_memory(self) -> int:
        """Requests kept in memory while Redis did not answer."""
        return len(self.held) + len(self.unpushed)

    def _went_out(self, exc: BaseException) -> float:
        """Note an outage (one warning when it starts); the seconds to wait before asking Redis
        again."""
        delay = self._outage.next()
        if self._out_since is None:
            self._out_since = self.clock()
            logger.warning(
                "Shared queue in Redis unreachable (%s: %s); asking again in %.1f s, then backing off",
                type(exc).__name__,
                exc,
                delay,
            )
        return delay

    def _answers(self) -> None:
        """Redis answered: one INFO line if it did not before."""
        if self._out_since is not None:
            logger.info(
                "Shared queue in Redis reachable again after %.1f s",
                self.clock() - self._out_since,
            )
            self._out_since = None
            self._outage.reset()
            if self._threaded():
                self._length = None  # a restart may have emptied it: looked at by has_requests()
                self.wake()
            elif self.check is not None:
                self.check()  # a restart may have emptied it

    # -- pops --------------------------------------------------------------------------------------

    def pop(self, timeout: float = 0) -> Request | None:
        """The next request that can go, from the sub-queue whose turn it is; never blocks
        (``timeout`` is scrapy-redis's SCHEDULER_IDLE_BEFORE_CLOSE: a blocking pop on the reactor
        thread would stall the crawl). While the reactor runs: the request fetched ahead if its
        stage can take it (else it goes back to its place in Redis), and the next fetch starts.

        While Redis does not answer (an outage, a Sentinel failover) it answers None and asks again
        after a back-off: one warning when the outage starts, one INFO line when it ends, no
        traceback (plain scrapy-redis raises from the engine's loop at every attempt)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if not self._threaded():
            return self._pop_here()
        if self.ahead is not None:
            stage, request, _ = self.ahead
            if self.admission.may_go((stage, None)):
                self.ahead = None
                return request
            # its stage has no slot in hand yet: it waits for one here (the stage's wait in Redis
            # started), or goes back to its place in Redis at the next tick
            return None
        self._start_fetch()
        return None

    def _pop_here(self) -> Request | None:
        try:
            self._requeue()
            request = self._pop()
        except Unreadable as exc:
            self._answers()
            self.unreadable(exc)
            return None
        except OUTAGE_ERRORS as exc:
            if isinstance(exc, REFUSED):
                raise
            delay = self._went_out(exc)
            self._ask_at = dict.fromkeys(self.queues, self.clock() + delay)
            self.asked_while_paused(delay)
            return None
        finally:
            self._say_requeued()
        self._answers()
        return request

    def _requeue(self) -> bool:
        """Requests kept in memory while Redis did not answer: scheduled again, pushed again, until
        an outage stops the round (the rest stay in memory). One the dupefilter now reads as seen
        is pushed all the same: Redis may have run its first try and lost the reply, which no
        answer tells from a duplicate, and a page fetched twice is better than a page lost without
        a word. One scrapy-redis cannot queue now (its serializer, or Redis, refuses it) is lost,
        not tried for ever in front of the others. Both are said by :meth:`_say_requeued`. Whether
        any left memory."""
        moved = False
        while self.held and self.enqueue is not None:
            request = self.held[0]
            self._queue_again(request, functools.partial(self._schedule_again, request))
            self.held.popleft()
            moved = True
        while self.unpushed:
            stage, request = self.unpushed[0]
            self._queue_again(request, functools.partial(self.queues[stage].push, request))
            self.unpushed.popleft()
            self._pushes[stage] += 1  # no longer known empty
            moved = True
        return moved

    def _schedule_again(self, request: Request) -> None:
        assert self.enqueue is not None
        if not self.enqueue(request):  # filtered and pushed (or kept in unpushed)
            self._push_now(self._stage_of(request), request)
            self._requeued.append((request, None))

    def _queue_again(self, request: Request, attempt: Callable[[], object]) -> None:
        """``attempt`` to queue ``request`` again: an outage is raised (it stays in memory), any
        other error loses it."""
        try:
            attempt()
        except OUTAGE_ERRORS as exc:
            if not isinstance(exc, REFUSED):
                raise
            self._requeued.append((request, exc))
        except Exception as exc:  # whatever scrapy-redis raised: said as lost
            self._requeued.append((request, exc))

    def _say_requeued(self) -> None:
        """On the reactor thread: the held requests queued again though seen (``seen_again``),
        and those lost (:meth:`_failed`: a refusal is raised at the engine's next ask)."""
        while self._requeued:
            request, exc = self._requeued.popleft()
            if exc is None:
                self.seen_again(request)
            else:
                self._failed(exc, request)

    def _candidates(self, now: float) -> tuple[list[str | None], float | None]:
        """The sub-queues to ask now, in turn order, and when the first paused one may be asked."""
        asked: list[str | None] = []
        paused_until = None
        for stage in sorted(self.queues, key=self._turns.__getitem__):
            if stage in self._drained or self._known_empty(stage):
                continue
            if not self.admission.may_go((stage, None)):
                continue
            if now < self._ask_at[stage]:
                paused_until = min(paused_until or self._ask_at[stage], self._ask_at[stage])
                continue
            asked.append(stage)
        return asked, paused_until

    def _pop(self) -> Request | None:
        now = self.clock()
        asked, paused_until = self._candidates(now)
        for stage in asked:
            request = self._take(stage)
            if request is None:
                self._found_none(stage, now)
                continue
            self._took(stage)
            if stage is None:
                real = self._stage_of(request)
                if real is not None and not self.admission.may_go((real, None)):
                    # pushed by another producer: it waits in its stage's queue (kept in memory
                    # if Redis went out meanwhile)
                    self._push_now(real, request)
                    continue
            return request
        if paused_until is not None:
            self.asked_while_paused(paused_until - now)
        return None

    def _take(self, stage: str | None) -> Request | None:
        """One request from ``stage``'s sub-queue, popped as scrapy-redis pops it; the same pop
        again (a reply lost) answers the same request (see the class)."""
        queue = self.queues[stage]
        kind = POP_KINDS.get(type(queue))
        if kind is None:
            return cast("Request | None", queue.pop())
        number = self._pops[stage] + 1
        keys = [queue.key, self._popped[stage]]
        self._unanswered.add(stage)
        data = self._pop_script(keys=keys, args=[kind, number, RECORD_KEPT_MS])
        self._unanswered.discard(stage)
        if data is None:
            return None
        self._pops[stage] = number  # out of Redis: the next pop is another, read or not
        try:
            return cast("Request", queue._decode_request(data))
        except Exception as exc:  # whatever scrapy-redis's serializer or request_from_dict raised
            raise Unreadable(queue.key, data) from exc

    def _forget_pops(self) -> None:
        """At close: a request whose pop got no reply, its sub-queue not asked since, is taken
        from the record by the same pop and goes back to its place; then this process's records
        of its last pops go."""
        for stage in list(self._unanswered):
            try:
                request = self._take(stage)
            except Unreadable as exc:
                self._unreadable.append(exc)
                continue
            if request is not None:
                # kept in memory if Redis is out again; a leftover stage's to the spider's own key,
                # which every process reads
                home = None if stage in self._leftover else stage
                self._push_now(home, request, back=True)
        for stage, pops in self._pops.items():
            if pops:
                self._pop_script(
                    keys=[self.queues[stage].key, self._popped[stage]], args=["forget", 0, 0]
                )

    def _known_empty(self, stage: str | None) -> bool:
        """A fetch found ``stage``'s sub-queue empty, and since then no look found requests in it
        and this process pushed none to it."""
        return self._empty.get(stage, -1) == self._pushes[stage]

    def _found_none(self, stage: str | None, now: float) -> None:
        """A pop of ``stage``'s sub-queue found it empty, driven without an engine: asked again
        after its pause; a leftover one never again in this run."""
        self._ask_at[stage] = now + self._pauses[stage].next()
        self._drain(stage)

    def _drain(self, stage: str | None) -> None:
        """A leftover sub-queue found empty is not read again in this run."""
        if stage in self._leftover and stage not in self._drained:
            self._drained.add(stage)
            logger.debug(
                "The key %s of uncapped stage %r is empty: not read again",
                self.queues[stage].key,
                stage,
            )

    def _took(self, stage: str | None) -> None:
        if stage in self._leftover and stage not in self._reading_leftover:
            self._reading_leftover.add(stage)
            logger.info(
                "Stage %r is not capped in this process: the requests queued under its own key %s (by an earlier crawl that capped it, or by processes that cap it now) are read from there until it is empty",  # noqa: E501
                stage,
                self.queues[stage].key,
            )
        self._pauses[stage].reset()
        self.moved += 1
        self._moved_at = self.clock()
        self._plan_probe()  # an idle process's look, planned a heartbeat away, comes sooner
        self._turn += 1
        self._turns[stage] = self._turn

    def _start_fetch(self) -> None:
        """Fetch the next request that can go, in the queue thread (one fetch at a time, and only
        while none is ahead)."""
        if self._fetch is not None or self.ahead is not None or self.closing:
            return
        assert self.thread is not None
        now = self.clock()
        asked, paused_until = self._candidates(now)
        if not asked and not self.in_memory:
            if paused_until is not None:
                self.asked_while_paused(paused_until - now)
            return
        self._fetch = self.thread.run(self._fetch_now, asked)
        self._fetch.add_done_callback(self._fetched)

    def _fetch_now(
        self, asked: list[str | None]
    ) -> tuple[str | None, Request | Unreadable | None, list[tuple[str | None, int]], bool]:
        """In the queue thread: what was kept in memory goes to Redis first, then one pop per
        sub-queue in turn until one gives a request (or one it cannot read): (its sub-queue, it,
        the sub-queues found empty with their push counts then, whether requests kept in memory
        went to Redis)."""
        requeued = self._requeue()
        empty: list[tuple[str | None, int]] = []
        for stage in asked:
            try:
                request = self._take(stage)
            except Unreadable as exc:
                return stage, exc, empty, requeued
            if request is not None:
                return stage, request, empty, requeued
            empty.append((stage, self._pushes[stage]))
        return None, None, empty, requeued

    def _fetched(self, done: asyncio.Future[Any]) -> None:
        self._fetch = None
        now = self.clock()
        self._say_requeued()
        try:
            stage, request, empty, requeued = done.result()
        except OUTAGE_ERRORS as exc:
            if isinstance(exc, REFUSED):
                self._failed(exc)
                return
            delay = self._went_out(exc)
            self._ask_at = dict.fromkeys(self.queues, now + delay)
            self.asked_while_paused(delay)
            return
        except Exception as exc:  # raised from the engine's next ask
            self._error = exc
            self.wake()
            return
        self._answers()
        if requeued:
            self._length = None  # a look before this fetch did not see them: has_requests() looks
        emptied = False  # a capped stage newly found empty: its kept slots go back to Redis
        for name, pushes in empty:
            self._drain(name)
            if not self._known_empty(name):
                # newly found empty: looked at again soon, then less often while it stays empty
                self._probe_pause = EMPTY_PAUSE
                emptied = emptied or name is not None
            self._empty[name] = pushes
        self._plan_probe()
        if isinstance(request, Unreadable):  # said, and the engine asks again: the next fetch
            self.unreadable(request)
            self.wake()
            return
        if request is None:
            # the engine may tell the spider idle now; or pop what went to Redis from memory
            self._owed = self._owed or emptied or requeued
            self._answer_owed()
            return
        self._took(stage)
        real = self._stage_of(request) if stage is None else stage
        if self.closing:
            self.give_back(request, back=stage == real)
            return
        if stage is None and real is not None and not self.admission.may_go((real, None)):
            # pushed by another producer: it waits in its stage's queue
            self.give_back(request)
            self._start_fetch()
            return
        self.ahead = (real, request, stage == real)
        self.wake()

    def may_have(self, stage: str | None) -> bool:
        """Whether ``stage``'s queue may hold a request worth a slot: not found empty by a fetch
        since a look last found requests in it (or this process pushed one)."""
        return (
            stage in self._ask_at
            and self.clock() >= self._ask_at[stage]
            and not self._known_empty(stage)
        )

    def _plan_probe(self, *, restart: bool = False, pause: float | None = None) -> None:
        """While a sub-queue is found empty, a look after ``pause`` (by default the current pause:
        see EMPTY_PAUSE), or sooner if one is planned sooner; ``restart``: from now, whatever was
        planned (a look just ran). None while closing. Also while Redis does not answer (``pause``:
        the outage's back-off): a look that reads it ends the outage, where every sub-queue may be
        found empty and no fetch asks."""
        if (
            self.closing
            or self.look is None
            or not self._threaded()
            or not any(self._known_empty(stage) for stage in self.read_stages())
        ):
            if self._probe is not None:
                self._probe.cancel()
                self._probe = None
            return
        if pause is None:
            idle = self.clock() - self._moved_at >= ENGINE_HEARTBEAT
            pause = ENGINE_HEARTBEAT if idle else self._probe_pause
        loop = asyncio.get_running_loop()
        if self._probe is not None:
            if not restart and self._probe.when() <= loop.time() + pause:
                return  # planned sooner: a busy process's fetches must not put it off
            self._probe.cancel()
        self._probe = loop.call_later(pause, self._probe_now)

    def _probe_now(self) -> None:
        self._probe = None
        self._probe_pause = min(self._probe_pause * 2, EMPTY_PAUSE_MOST)
        self.look_soon()

    def _answer_owed(self) -> None:
        """A job or look came back: the engine is woken if has_requests() answered True for it (it
        may tell the spider idle now)."""
        if self._owed:
            self._owed = False
            self.wake()

    def tick(self) -> None:
        """At every renewal tick: a request fetched ahead that its stage could not take since goes
        back to its place in Redis (what a process has not started stays shared)."""
        if self.ahead is not None and not self.admission.may_go((self.ahead[0], None)):
            _, request, own = self.ahead
            self.ahead = None
            self.give_back(request, back=own)

    # -- the queue as a whole ----------------------------------------------------------------------

    def has_requests(self) -> bool:
        """Whether any sub-queue holds a request: one command per sub-queue until one does. True
        while Redis does not answer: the crawl does not close on a queue it cannot see.

        While the reactor runs this sends nothing: True while a request is ahead, in memory, or on
        its way to or from Redis, or while the last look at Redis (epoch and lengths, in the queue
        thread: :meth:`looked`) is unknown or older than LOOK_FRESH s, which starts a look (the
        engine is woken when the job or look comes back); else what that look saw."""
        if self._threaded():
            if self.in_memory or self.ahead is not None or self._out_since is not None:
                return True
            if self._unanswered:
                return True  # a pop's reply lost: its request is in Redis until asked again
            assert self.thread is not None
            if self.thread.jobs or self._looking is not None:
                self._owed = True
                return True
            fresh = self.clock() - self._length_at < LOOK_FRESH
            if self._length is None or not fresh:
                self.look_soon()
                self._owed = True
                return True
            # told there are requests: woken when a look or fetch may say otherwise
            self._owed = self._length > 0
            return self._length > 0
        try:
            found = bool(self.in_memory or self._unanswered) or any(
                len(queue) > 0 for queue in self.read_queues()
            )
        except OUTAGE_ERRORS:
            return True
        if not found and self.check is not None:
            self.check()  # empty, or emptied by Redis (said before the engine closes the spider)
        return found

    def look_soon(self) -> None:
        """A look (QueueWatch's: the epoch and the lengths), unless one runs: for has_requests(),
        while a sub-queue is found empty, and at a renewal tick (StageScheduler's, for the
        watch)."""
        if self.look is None or self._looking is not None or self.closing:
            return
        self._looking = asyncio.get_running_loop().create_task(self._look_now())
        self._looking.add_done_callback(retrieved)

    async def _look_now(self) -> None:
        assert self.look is not None
        pause = None
        try:
            error = await self.look()
            if isinstance(error, REFUSED):
                self._failed(error)  # raised from the engine's next ask, as a pop's refusal is
            elif error is not None:
                # said once; the next look (or fetch) after the outage's back-off
                pause = self._went_out(error)
            if self.thread is not None:
                await self.thread.drain()
        finally:
            self._looking = None
            self._plan_probe(restart=True, pause=pause)
            self._answer_owed()

    def read_stages(self) -> list[str | None]:
        """The names of the sub-queues still read (:meth:`read_queues`)."""
        return [stage for stage in self.queues if stage not in self._drained]

    def lengths(self) -> dict[str | None, int]:
        """The length of each sub-queue still read: one command each, in one round trip for
        scrapy-redis's own queue classes (in the queue thread, whose pops and pushes wait
        meanwhile)."""
        stages = self.read_stages()
        kinds = [POP_KINDS.get(type(self.queues[stage])) for stage in stages]
        if None in kinds:
            return {stage: len(self.queues[stage]) for stage in stages}
        pipe = self.base.server.pipeline(transaction=False)
        for stage, kind in zip(stages, kinds, strict=True):
            key = self.queues[stage].key
            if kind == "priority":
                pipe.zcard(key)
            else:
                pipe.llen(key)
        return {stage: int(n) for stage, n in zip(stages, pipe.execute(), strict=True)}

    def looked(self, lengths: dict[str | None, int]) -> None:
        """QueueWatch read the lengths of the queue's keys (in the queue thread): a sub-queue found
        empty that has requests now is popped again (the engine is woken to pop it). Redis answered:
        an outage is over."""
        self._answers()
        queued = sum(lengths.values())
        self._length, self._length_at = queued, self.clock()
        self._known_length = queued
        found = [s for s, n in lengths.items() if n > 0 and self._known_empty(s)]
        for stage in found:
            del self._empty[stage]
        if found:
            self._probe_pause = EMPTY_PAUSE
            self.wake()
        self._plan_probe(restart=True)
        self._answer_owed()

    def clear(self) -> None:
        for queue in self.queues.values():
            queue.clear()

    async def settle(self) -> None:
        """At close, while the reactor runs: the fetch under way comes back, the requests kept in
        memory go to Redis if it answers now (else they are lost: :meth:`close`), the request
        fetched ahead goes back to its place in Redis (never dropped), and every job given before
        is done."""
        self.closing = True
        self._plan_probe()  # none now
        if self._fetch is not None:
            await asyncio.wait([self._fetch])
        if self.in_memory and self.thread is not None:
            with suppress(*OUTAGE_ERRORS):
                await self.thread.run(self._requeue)
            self._say_requeued()
        if self.ahead is not None:
            _, request, own = self.ahead
            self.ahead = None
            self.give_back(request, back=own)
        if self.thread is not None:
            await self.thread.drain()
            with suppress(*REDIS_ERRORS):  # the records expire
                await self.thread.run(self._forget_pops)
            self._say_unreadable()

    def close(self) -> int:
        """The queues live in Redis: only requests scheduled while it did not answer, and never
        queued since, are lost, and one whose pop got no reply if it cannot be asked again now;
        how many (StageScheduler reports them)."""
        if not self._threaded():
            with suppress(*REDIS_ERRORS):  # the records expire
                self._forget_pops()
            self._say_unreadable()
        # a pop whose reply was lost and that could not be asked again: its request stays in the
        # record, which nobody reads (it expires)
        lost = self.in_memory + (self.ahead is not None) + len(self._unanswered)
        self.held.clear()
        self.unpushed.clear()
        self.ahead = None
        return lost

    def __len__(self) -> int:
        """The requests queued in Redis (the last length read, while Redis does not answer; the
        last look's while the reactor runs), and those this process holds on their way there."""
        if self._threaded():
            ahead = int(self.ahead is not None)
            return (self._length or 0) + ahead + self.in_memory
        with suppress(*OUTAGE_ERRORS):
            self._known_length = sum(len(queue) for queue in self.read_queues())
        return self._known_length + self.in_memory
