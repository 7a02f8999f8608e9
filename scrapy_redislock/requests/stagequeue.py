"""Sub-queues per stage inside the inner scheduler, so that a capped request leaves it only when it
can go.

StageScheduler does not pull requests out of the inner scheduler to wait elsewhere (that lost their
priority order, and drained a shared queue into one process's memory). It gives the inner scheduler
queues that know each request's stage (and key, when keys are capped) and pop only from a sub-queue
whose stage (and key) can take a request now, as the :class:`Gate` says. Within a sub-queue the
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
  stays in Redis, visible to and takeable by every process.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import re
import time
import weakref
from collections import Counter, deque
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from scrapy.utils.misc import build_from_crawler

from scrapy_redislock._redis import Backoff
from scrapy_redislock.crawl.reach import OUTAGE_ERRORS, REFUSED

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from scrapy import Request
    from scrapy.crawler import Crawler

# A sub-queue: (capped stage or None, key or None).
Route = tuple[str | None, str | None]
UNCAPPED: Route = (None, None)

# scrapy-redis answers every pop with a Redis command: a sub-queue found empty is not asked again
# for EMPTY_PAUSE s (doubling up to EMPTY_PAUSE_MOST while it stays empty), unless this process
# pushes to it. With many processes sharing one queue those empty polls were a third of Redis's
# commands per page.
EMPTY_PAUSE = 0.05
EMPTY_PAUSE_MOST = 0.5
OUTAGE_PAUSE_MOST = 2.0  # seconds between attempts at most while Redis does not answer

logger = logging.getLogger(__name__)

__all__ = ["Gate", "SharedStageQueues", "StagePriorityQueues", "StageQueueFactory"]


class Gate(Protocol):
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

    def __init__(self, pqclass: Any, gate: Gate) -> None:
        self.pqclass = pqclass
        self.gate = gate
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
            self.gate,
            self.pqclass,
            downstream_queue_cls,
            key,
            startprios,
            start_queue_cls=start_queue_cls,
        )


class StagePriorityQueues:
    """One priority queue (the crawl's SCHEDULER_PRIORITY_QUEUE) per sub-queue; pops only where the
    gate says go."""

    def __init__(
        self,
        crawler: Crawler,
        gate: Gate,
        pqclass: Any,
        downstream_queue_cls: type,
        key: str,
        startprios: Any = None,
        *,
        start_queue_cls: type | None = None,
    ) -> None:
        if startprios and not isinstance(startprios, dict):
            raise ValueError(
                f"the JOBDIR's scheduler state ({startprios!r}) was written without "
                "StageScheduler's sub-queues "
                "(SCHEDULER was Scrapy's own, or REDISLOCK_ENABLED was False); a crawl can only be "
                "resumed with the "
                "scheduler and priority queue it was started with"
            )
        self.crawler = crawler
        self.gate = gate
        self.pqclass = pqclass
        self.downstream_queue_cls = downstream_queue_cls
        self.key = key
        self.start_queue_cls = start_queue_cls
        self.queues: dict[Route, Any] = {}
        # requests per sub-queue, kept here: len() of Scrapy's DownloaderAwarePriorityQueue walks
        # every download slot's queue
        self._sizes: Counter[Route] = Counter()
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
            self._sizes[route] = len(self.queues[route])
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
        self.push_to(self.gate.queue_route(request), request)

    def push_to(self, route: Route, request: Request) -> None:
        """Push into the sub-queue ``route`` (made if needed); a request pushed again keeps its first
        push order."""
        queue = self.queues.get(route)
        if queue is None:
            queue = self.queues[route] = self._new(route)
        if request not in self._pushed:
            self._pushed[request] = next(self._pushes)
        queue.push(request)
        self._sizes[route] += 1

    def _next(self) -> Route | None:
        ready = [route for route in self.queues if self._sizes[route] and self.gate.may_go(route)]
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
            to = None if request is None else self.gate.divert(request, route)
            if request is None or to is None:
                return request
            self.push_to(to, request)  # its key is blocked: it waits in its key's sub-queue

    def _pop(self, route: Route) -> Request | None:
        queue = self.queues[route]
        request = queue.pop()
        # a queue that had nothing to give after all (a disk entry that could not be read) is
        # counted again
        self._sizes[route] = self._sizes[route] - 1 if request is not None else len(queue)
        self._turn += 1
        self._turns[route] = self._turn
        if not self._sizes[route] and route != UNCAPPED:
            del self.queues[route], self._sizes[route]
            self._turns.pop(route, None)
            queue.close()
            if self.key:  # reclaim the sub-queue's directory; rmdir leaves it alone if files remain
                with suppress(OSError):
                    Path(self.key, _dirname(route)).rmdir()
        return request

    def peek(self) -> Request | None:
        route = self._next()
        return None if route is None else self.queues[route].peek()

    def close(self) -> dict[str, Any]:
        state = {_route_id(route): queue.close() for route, queue in self.queues.items()}
        self.queues.clear()
        self._sizes.clear()
        return state

    def count(self, stage: str) -> int:
        """Requests of ``stage`` queued here."""
        return sum(size for route, size in self._sizes.items() if route[0] == stage)

    def count_route(self, route: Route) -> int:
        """Requests queued in the sub-queue ``route``."""
        return self._sizes[route]

    def __len__(self) -> int:
        return sum(self._sizes.values())


def _is_lifo(queue_cls: Any) -> bool:
    """Whether a downstream queue class gives the last pushed first (Scrapy's and queuelib's Lifo*
    queues)."""
    return any("Lifo" in cls.__name__ for cls in getattr(queue_cls, "__mro__", ()))


def _head_rank(queue: Any) -> tuple[int, int]:
    """How soon a sub-queue's head goes: its priority (lower first: Scrapy's queues keep -priority),
    then a callback request before a start request of that priority (Scrapy's order within one
    queue)."""
    curprio = getattr(queue, "curprio", None)
    if curprio is None:
        try:
            head = queue.peek()
        except NotImplementedError:
            return 0, 0
        return (0, 0) if head is None else (-head.priority, 0)
    return curprio, 0 if curprio in getattr(queue, "queues", {curprio: None}) else 1


class SharedStageQueues:
    """scrapy-redis's queue, split by capped stage in Redis; takes the place of its scheduler's
    ``queue``."""

    def __init__(
        self,
        base: Any,
        stages: Iterable[str],
        gate: Gate,
        *,
        asked_while_paused: Callable[[float], None],
    ) -> None:
        self.base = base
        self.gate = gate
        self.asked_while_paused = asked_while_paused
        self.queues: dict[str | None, Any] = {None: base}
        for stage in stages:
            self.queues[stage] = type(base)(
                server=base.server,
                spider=base.spider,
                key=self.key_of(stage),
                serializer=base.serializer,
            )
        self._pauses = {
            stage: Backoff(first=EMPTY_PAUSE, most=EMPTY_PAUSE_MOST) for stage in self.queues
        }
        self._ask_at = dict.fromkeys(self.queues, 0.0)
        self._turns = dict.fromkeys(self.queues, 0)
        self._turn = 0
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

    def push(self, request: Request) -> None:
        """Into its stage's queue; kept in memory while Redis does not answer, and pushed at the
        next pop."""
        stage = self.gate.route(request)[0]
        if stage not in self.queues:
            stage = None
        try:
            self.queues[stage].push(request)
        except OUTAGE_ERRORS as exc:
            if isinstance(exc, REFUSED):
                raise
            self._went_out(exc)
            self.unpushed.append((stage, request))
            return
        self.moved += 1
        self._ask_at[stage] = 0.0
        self._pauses[stage].reset()

    def hold(self, request: Request, exc: BaseException) -> None:
        """``request`` could not be scheduled (the dupefilter or the queue did not answer): kept in
        memory and scheduled again at the next pop, never dropped."""
        self._went_out(exc)
        if not self.held:
            logger.info(
                "Requests scheduled while Redis does not answer are kept in memory, and queued "
                "once it answers (redislock/queue_held)"
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
            self._out_since = time.monotonic()
            logger.warning(
                "Shared queue in Redis unreachable (%s: %s); asking again in %.1f s, "
                "then backing off",
                type(exc).__name__,
                exc,
                delay,
            )
        return delay

    def pop(self, timeout: float = 0) -> Request | None:
        """The next request that can go, from the sub-queue whose turn it is; never blocks
        (``timeout`` is scrapy-redis's SCHEDULER_IDLE_BEFORE_CLOSE: a blocking pop on the reactor
        thread would stall the crawl).

        While Redis does not answer (an outage, a Sentinel failover) it answers None and asks again
        after a back-off: one warning when the outage starts, one INFO line when it ends, no
        traceback (plain scrapy-redis raises from the engine's loop at every attempt)."""
        try:
            while self.held and self.enqueue is not None:
                self.enqueue(self.held[0])  # filtered and pushed (or kept in unpushed)
                self.held.popleft()
            while self.unpushed:
                stage, unpushed = self.unpushed[0]
                self.queues[stage].push(unpushed)
                self.unpushed.popleft()
            request = self._pop()
        except OUTAGE_ERRORS as exc:
            if isinstance(exc, REFUSED):
                raise
            delay = self._went_out(exc)
            self._ask_at = dict.fromkeys(self.queues, time.monotonic() + delay)
            self.asked_while_paused(delay)
            return None
        if self._out_since is not None:
            logger.info(
                "Shared queue in Redis reachable again after %.1f s",
                time.monotonic() - self._out_since,
            )
            self._out_since = None
            self._outage.reset()
            if self.check is not None:
                self.check()  # a restart may have emptied it
        return request

    def _pop(self) -> Request | None:
        now = time.monotonic()
        paused_until = None
        for stage in sorted(self.queues, key=self._turns.__getitem__):
            if not self.gate.may_go((stage, None)):
                continue
            if now < self._ask_at[stage]:
                paused_until = min(paused_until or self._ask_at[stage], self._ask_at[stage])
                continue
            request = self.queues[stage].pop()
            if request is None:
                self._ask_at[stage] = now + self._pauses[stage].next()
                continue
            self._pauses[stage].reset()
            self.moved += 1
            self._turn += 1
            self._turns[stage] = self._turn
            if stage is None:
                real = self.gate.route(request)[0]
                if real in self.queues and real is not None and not self.gate.may_go((real, None)):
                    # pushed by another producer: it waits in its stage's queue
                    self.queues[real].push(request)
                    continue
            return request
        if paused_until is not None:
            self.asked_while_paused(paused_until - now)
        return None

    def may_have(self, stage: str) -> bool:
        """Whether ``stage``'s queue may hold a request: not found empty within its pause."""
        return stage in self._ask_at and time.monotonic() >= self._ask_at[stage]

    def has_requests(self) -> bool:
        """Whether any sub-queue holds a request: one command per sub-queue until one does. True
        while Redis does not answer: the crawl does not close on a queue it cannot see."""
        try:
            found = bool(self.in_memory) or any(len(queue) > 0 for queue in self.queues.values())
        except OUTAGE_ERRORS:
            return True
        if not found and self.check is not None:
            self.check()  # empty, or emptied by Redis (said before the engine closes the spider)
        return found

    def clear(self) -> None:
        for queue in self.queues.values():
            queue.clear()

    def close(self) -> int:
        """The queues live in Redis: only requests scheduled while it did not answer, and never
        queued since, are lost; how many (StageScheduler reports them)."""
        lost = self.in_memory
        self.held.clear()
        self.unpushed.clear()
        return lost

    def __len__(self) -> int:
        """The requests queued in Redis (the last length read, while Redis does not answer)."""
        with suppress(*OUTAGE_ERRORS):
            self._known_length = sum(len(queue) for queue in self.queues.values())
        return self._known_length + self.in_memory
