"""KeyLine: StageScheduler gets a request's key slot before the request leaves it, so that a key
at its cap waits in the scheduler, not in the downloader.

For requests whose key is capped (REDISLOCK_STAGE_KEY with REDISLOCK_KEY_LIMIT or
REDISLOCK_KEY_LIMITS) and whose stage is not (a broad crawl: domains, no stages), over Scrapy's
scheduler:

- A request of a key that is free here (no wait for it in progress, fewer than the key's limit of
  this process's requests holding or taking it) leaves the inner scheduler and is held back for one
  look in Redis (a take: lock/light.py). Granted, it goes on with its key slot
  (:meth:`ScopeThrottle.hand <scrapy_redislock.requests.throttle.ScopeThrottle.hand>`), and the engine is woken.
- Refused (every slot of the key is held, here or elsewhere, or others queue for it), the request
  goes back into the inner scheduler, into a sub-queue of its key (on disk with JOBDIR), and one
  wait for a slot of the key starts here (first come, first served in Redis). The key's requests
  stay queued and take none of CONCURRENT_REQUESTS, while other keys' requests go past them. A slot
  the wait gets is kept for the key's next request, which the sub-queue then lets go; the wait goes
  on while the key has more requests queued than slots kept.
- A key whose starts a site's Retry-After paused (the take says so: lock/delay.py's pause_starts)
  keeps its requests queued until the pause ends, then takes again.
- A slot kept for a key whose requests are gone, or that is no longer usable, goes back to Redis at
  the next renewal tick; a wait that runs out of REDISLOCK_WAIT_TIMEOUT fails the key's next
  request with AcquireTimeout, as a wait in the middleware would.

Looks in Redis under way are bounded by the downloader's free room (CONCURRENT_REQUESTS less what
it has and what is ready); waits by CONCURRENT_REQUESTS (each blocks one connection). Requests with a
capped stage take their key slot in the middleware, after their stage slot (the order that cannot
deadlock with requests that bypass the scheduler: docs/key-caps.md); so do all requests over
scrapy-redis's scheduler, whose queue is shared in Redis and not split by key.

Reads CONCURRENT_REQUESTS and, through the checked settings, REDISLOCK_WAIT_TIMEOUT and the key
settings.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import Counter, deque
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from scrapy_redislock.crawl.engine import downloader_active, wake_engine
from scrapy_redislock.crawl.reach import REDIS_ERRORS
from scrapy_redislock.errors import AcquireTimeout, Paused
from scrapy_redislock.requests.stagequeue import StagePriorityQueues

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler

    from scrapy_redislock.crawl.settings import RedisLockSettings
    from scrapy_redislock.crawl.stagelocks import SlotPermit
    from scrapy_redislock.requests.throttle import ScopeThrottle

logger = logging.getLogger(__name__)


class KeyLine:
    """The key slots StageScheduler gets before letting requests go (see the module docstring)."""

    def __init__(
        self,
        crawler: Crawler,
        settings: RedisLockSettings,
        throttle: ScopeThrottle,
        inner: Any,
    ) -> None:
        self.crawler = crawler
        self.settings = settings
        self.throttle = throttle
        # monotonic seconds: the throttle's, whose records this line adds to
        self.clock = throttle.clock
        self.locks = throttle.locks  # the KeyLocks
        self.inner = inner  # Scrapy's scheduler, its queues split by StagePriorityQueues
        self.room = crawler.settings.getint("CONCURRENT_REQUESTS")
        self.keys: weakref.WeakKeyDictionary[Request, str | None] = weakref.WeakKeyDictionary()
        self.looking: dict[Request, str] = {}  # held back for one take in Redis
        self.ready: deque[Request] = deque()  # got their slot meanwhile: the engine's next
        self.kept: dict[str, deque[SlotPermit | BaseException]] = {}  # per key: for its next
        self.waits: dict[str, asyncio.Task[None]] = {}  # one wait per key, while it has a queue
        # keys whose starts a Retry-After paused: until the timer ends it
        self.paused: dict[str, asyncio.TimerHandle] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        # waits under way at once: each blocks one connection
        self.connections = asyncio.Semaphore(max(1, self.room))
        self.closed = False
        self._load: Counter[str] | None = None

    # -- the keys' sub-queues in the inner scheduler ------------------------------------------------

    def queued(self, key: str) -> int:
        """Requests of ``key`` in its sub-queue of the inner scheduler."""
        queues = [getattr(self.inner, name, None) for name in ("mqs", "dqs")]
        return sum(
            queue.count_route((None, key))
            for queue in queues
            if isinstance(queue, StagePriorityQueues)
        )

    def requeue(self, request: Request, key: str) -> None:
        """Put ``request`` back into its key's sub-queue of the inner scheduler (on disk with
        JOBDIR, as Scrapy's scheduler would; in memory if it cannot be serialized); no stats, no
        dupefilter: it was queued once already."""
        dqs = getattr(self.inner, "dqs", None)
        if isinstance(dqs, StagePriorityQueues):
            try:
                dqs.push_to((None, key), request)
                return
            except ValueError:
                pass
        self.inner.mqs.push_to((None, key), request)

    # -- what the throttle and the queues ask ----------------------------------------------------------

    def key_of(self, request: Request) -> str | None:
        """The request's capped key (computed once per request)."""
        try:
            return self.keys[request]
        except KeyError:
            key = self.keys[request] = self.throttle.key_of(request)
            return key

    def blocked(self, key: str) -> bool:
        """No request of ``key`` may leave for a take now: a wait for it is under way here and
        keeps nothing yet, or this process already holds or takes the key's limit of it."""
        if key in self.paused:
            return True
        if self.kept.get(key):
            return False
        limit = self.settings.keys.limit_of(key)
        return key in self.waits or (limit is not None and self.load()[key] >= limit)

    def may_go(self, key: str) -> bool:
        """The key's sub-queue may let a request go: a slot (or the wait's error) is kept for it,
        or the key is free again (its request then takes a look)."""
        return not self.blocked(key) and not self.closed

    def new_pass(self) -> None:
        self._load = None

    def load(self) -> Counter[str]:
        """Requests of this process per key that hold a slot, take one, or have one kept: counted
        once per pass of the engine."""
        if self._load is None:
            load: Counter[str] = Counter(self.looking.values())
            for request in self.throttle.permits.holding():
                key = self.key_of(request)
                if key is not None:
                    load[key] += 1
            for key, kept in self.kept.items():
                load[key] += len(kept)
            self._load = load
        return self._load

    def full(self) -> bool:
        """Enough is under way: the downloader has no room for more than what is ready or being
        looked for."""
        active = downloader_active(self.crawler)
        busy = (0 if active is None else len(active)) + len(self.ready) + len(self.looking)
        return busy >= self.room

    def pending(self) -> int:
        """Requests out of the inner scheduler here (held for a take, or ready)."""
        return len(self.looking) + len(self.ready)

    # -- a request leaving the scheduler -----------------------------------------------------------

    def next_ready(self) -> Request | None:
        return self.ready.popleft() if self.ready else None

    def holds_back(self, request: Request) -> bool:
        """Whether ``request`` (just out of the inner scheduler) waits here for its key slot; False
        when it goes now: no capped key, or a slot (or error) kept for its key goes with it."""
        key = self.key_of(request)
        if key is None:
            return False
        kept = self.kept.get(key)
        while kept:
            outcome = kept.popleft()
            if isinstance(outcome, BaseException) or self.locks.usable(outcome):
                self._hand(request, outcome)
                return False
            self.locks.release_soon(outcome)
        self.looking[request] = key
        if self._load is not None:
            self._load[key] += 1
        self._start(self._look(request, key))
        return True

    def _hand(self, request: Request, outcome: SlotPermit | BaseException) -> None:
        if isinstance(outcome, BaseException):
            self.throttle.permits.hand(request, outcome)
        else:
            self.throttle.hand(request, outcome)

    async def _look(self, request: Request, key: str) -> None:
        """One take in Redis for ``request``: it goes with the slot, or back to its key's queue
        while a wait for the key starts."""
        started = self.clock()
        paused: Paused | None = None
        try:
            permit = await self.locks.try_take(key)
        except REDIS_ERRORS as exc:
            logger.warning("Taking a slot of key %r: Redis error (%s); it waits", key, exc)
            permit = None
        except Paused as exc:
            permit, paused = None, exc
        finally:
            self.looking.pop(request, None)
            self._load = None
        if self.closed:
            if permit is not None:
                self.locks.release_soon(permit)
            self.requeue(request, key)
            return
        if permit is not None:
            self.throttle.record(self.clock() - started)
            self.throttle.hand(request, permit)
            self.ready.append(request)
        elif paused is not None:
            self.requeue(request, key)
            self._pause(key, paused.wait)
        else:
            self.requeue(request, key)
            self._wait_for(key)
        wake_engine(self.crawler)

    def _pause(self, key: str, seconds: float) -> None:
        """A Retry-After paused the key's starts: its requests stay queued until then."""
        if key in self.paused:
            return
        loop = asyncio.get_running_loop()
        self.paused[key] = loop.call_later(seconds, self._unpause, key)

    def _unpause(self, key: str) -> None:
        self.paused.pop(key, None)
        self._load = None
        wake_engine(self.crawler)

    def _wait_for(self, key: str) -> None:
        if key not in self.waits and not self.closed:
            self.waits[key] = self._start(self._wait(key))

    async def _wait(self, key: str) -> None:
        """Wait for slots of ``key`` while it has more requests queued than slots kept (at most as
        many waits at once as CONCURRENT_REQUESTS: each blocks one connection)."""
        kept = self.kept.setdefault(key, deque())
        try:
            while not self.closed and self.queued(key) > len(kept):
                started = self.clock()
                try:
                    async with self.connections:
                        permit: SlotPermit | BaseException = await self.locks.acquire_key(
                            key, self.settings.wait_timeout
                        )
                except AcquireTimeout as exc:
                    permit = exc
                else:
                    self.throttle.record(self.clock() - started)
                kept.append(permit)
                self._load = None
                wake_engine(self.crawler)
        finally:
            if self.waits.get(key) is asyncio.current_task():
                del self.waits[key]
            if not kept:
                self.kept.pop(key, None)
            self._load = None
            wake_engine(self.crawler)

    def _start(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    # -- upkeep ------------------------------------------------------------------------------------

    def tick(self) -> None:
        """At every renewal tick: give back kept slots that no queued request can use, or that can
        no longer go with a request."""
        now = self.clock()
        for key, kept in list(self.kept.items()):
            keep = self.queued(key)
            for outcome in list(kept):
                if isinstance(outcome, BaseException):
                    continue
                if keep <= 0 or not outcome.usable(now):
                    kept.remove(outcome)
                    self.locks.release_soon(outcome)
                else:
                    keep -= 1
            if not kept and key not in self.waits:
                del self.kept[key]
        self._load = None

    def stand_down(self) -> None:
        """The engine closes: no more takes or waits; what is kept goes back to Redis."""
        self.closed = True
        for task in list(self.tasks):
            task.cancel()
        for timer in self.paused.values():
            timer.cancel()
        self.paused.clear()
        for kept in self.kept.values():
            for outcome in kept:
                if not isinstance(outcome, BaseException):
                    self.locks.release_soon(outcome)
        self.kept.clear()

    def close(self) -> None:
        """Stand down and queue back the requests out of the inner scheduler here, before it
        closes (JOBDIR keeps them)."""
        self.stand_down()
        back = [*self.ready, *self.looking]
        for request in self.ready:
            permit = self.throttle.permits.finish(request)
            if permit is not None:
                self.locks.release_soon(permit)
        self.ready.clear()
        self.looking.clear()
        for request in back:
            key = self.key_of(request)
            if key is not None:
                self.requeue(request, key)
