"""StageScheduler: requests of a saturated stage wait here, cheaply, instead of in the downloader.

Scrapy counts a request as active in the downloader before the middleware chain runs, and stops pulling from
the scheduler once CONCURRENT_REQUESTS are active: requests parked in a middleware for a full stage would starve
every other stage (head-of-line blocking) and hold up the engine's close. This scheduler wraps the real one
(Scrapy's by default, or scrapy-redis's) and lets a capped request go only together with a slot of its stage:

- ``next_request()`` takes requests from the inner scheduler; uncapped ones go at once, capped ones are parked
  here (in memory, at most REDISLOCK_PARK_LIMIT) and it returns None while ``has_pending_requests()`` stays True;
- per capped stage with parked requests, up to REDISLOCK_WAITERS_PER_STAGE waiter tasks block in Redis
  (``XREADGROUP BLOCK``: first come, first served across processes, woken the moment a slot is freed anywhere);
- a granted slot is paired with the oldest parked request of its stage, the engine is woken at once (not at its
  5 s heartbeat), and StageLockMiddleware picks the permit up by request object (``StageLocks.hand`` / ``take``);
- a slot freed by a finished request of this process goes straight to the oldest parked request of its stage
  (:meth:`_take_slot`, called by ``StageLocks.finish``): no Redis round trip, the engine woken at once; within
  REDISLOCK_LOCAL_REUSE seconds of Redis's grant, so that other processes waiting in Redis's line get their turn;
- a granted slot that waited for the engine and meanwhile was lost, or outlived its lease on this process's clock
  (renewals failed: Redis out of reach, a stall), is dropped, never handed out (``StageLocks.usable``); its request
  stays parked and a waiter asks Redis for a fresh slot;
- a capped request that a middleware before StageLockMiddleware will settle without a download (a fresh
  HTTPCACHE hit, a URL robots.txt forbids: see
  :func:`~scrapy_redislock.crawl.early.settled_before_download`) goes at once, without a slot; should it
  reach the middleware after all, it waits for its slot there;
- after the inner scheduler comes back empty it is not asked again for a short pause (EMPTY_PAUSE, doubling while
  it stays empty), unless this process enqueues a request: scrapy-redis answers every ask with a Redis command.

Once the engine starts closing, the waiters stand down and give their unused slots back, so that requests still
waiting in the middleware (media downloads) get them.

On close the waiters are cancelled, unused slots freed and parked requests given back to the inner scheduler
(so JOBDIR or SCHEDULER_PERSIST keep them). With REDISLOCK_ENABLED = False it is the inner scheduler and nothing
more; enabled with no stage in REDISLOCK_STAGES it is a ConfigError (nothing would be capped).

Settings read (via :func:`scrapy_redislock.crawl.settings.read_settings`): REDISLOCK_SCHEDULER_INNER,
REDISLOCK_PARK_LIMIT, REDISLOCK_WAITERS_PER_STAGE, REDISLOCK_WAIT_TIMEOUT, REDISLOCK_LOCAL_REUSE, REDISLOCK_ENABLED,
REDISLOCK_STAGES and the stage settings.
Stats: those of the middleware (acquired and wait times are counted here for requests that waited here), plus
redislock/<stage>/parked_max, redislock/<stage>/reused (slots passed on locally) and redislock/<stage>/unusable
(slots dropped before a request could start with them).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

from scrapy.settings import SETTINGS_PRIORITIES
from scrapy.utils.defer import deferred_from_coro, maybe_deferred_to_future
from scrapy.utils.misc import build_from_crawler, load_object

from scrapy_redislock._redis import Backoff
from scrapy_redislock.crawl.early import (
    MIDDLEWARE_PATH,
    early_middlewares,
    middleware_configured,
    settled_before_download,
)
from scrapy_redislock.crawl.engine import check_reactor, engine_closing, one_line_config_errors, wake_engine
from scrapy_redislock.crawl.keys import request_key
from scrapy_redislock.crawl.settings import read_settings
from scrapy_redislock.crawl.stagelocks import SlotPermit, StageLocks
from scrapy_redislock.crawl.stages import stage_of
from scrapy_redislock.errors import AcquireTimeout, ConfigError, KeyFunctionError, UnknownStage

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from scrapy.settings import Settings
    from twisted.internet.defer import Deferred

logger = logging.getLogger(__name__)

# Capped requests taken from the inner scheduler per next_request() call at most: a long run of them (a scrapy-redis
# queue answers each with a blocking call) is parked over several loop iterations, never in one long block.
PULL_BUDGET = 256

# After the inner scheduler comes back empty it is not asked again for EMPTY_PAUSE s (doubling up to EMPTY_PAUSE_MOST
# while it stays empty), unless this process enqueues a request. An engine busy with other requests asks at every
# finished download, and scrapy-redis's queue answers each ask with a Redis command (an empty RPOP): with many
# processes sharing one queue those empty polls were a third of Redis's commands per page. When the engine asked
# during a pause, it is woken at the pause's end, so work pushed by another process is seen at most that late.
EMPTY_PAUSE = 0.05
EMPTY_PAUSE_MOST = 0.5

SCRAPY_DUPEFILTER = "scrapy.dupefilters.RFPDupeFilter"
SCRAPY_REDIS_DUPEFILTER = "scrapy_redis.dupefilter.RFPDupeFilter"

__all__ = ["StageScheduler"]


def _build_inner(inner_cls: type, crawler: Crawler) -> Any:
    """The inner scheduler, built from the crawler; over scrapy-redis's scheduler, with scrapy-redis's dupefilter
    when DUPEFILTER_CLASS was left at Scrapy's default (see :func:`_scrapy_redis_settings`)."""
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

    scrapy-redis's documented settings are ``SCHEDULER = "scrapy_redis.scheduler.Scheduler"`` and ``DUPEFILTER_CLASS
    = "scrapy_redis.dupefilter.RFPDupeFilter"``. With SCHEDULER being ours, a user who left DUPEFILTER_CLASS at
    Scrapy's default got ``AttributeError: type object 'RFPDupeFilter' has no attribute 'from_settings'`` (Scrapy
    2.19's filter has none), then ``RuntimeError: Engine slot not assigned``. Left at Scrapy's default (not set by
    the project, the spider or the command line), it is scrapy-redis's own, as its documentation says (a filter per
    process over a queue shared in Redis would let every process queue the same pages again); logged at INFO. Set
    to a class scrapy-redis cannot build (neither ``from_spider`` nor ``from_settings``): a ConfigError naming
    DUPEFILTER_CLASS and the value to use.
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
            "REDISLOCK_SCHEDULER_INNER is scrapy-redis's scheduler and DUPEFILTER_CLASS is Scrapy's default: it uses "
            "scrapy-redis's dupefilter (%s), as scrapy-redis's settings say (set DUPEFILTER_CLASS to choose another)",
            SCRAPY_REDIS_DUPEFILTER,
        )
        return patched
    if not (hasattr(dupefilter, "from_spider") or hasattr(dupefilter, "from_settings")):
        raise ConfigError(
            f"DUPEFILTER_CLASS = {value!r} cannot be used by scrapy-redis's scheduler (REDISLOCK_SCHEDULER_INNER = "
            f"{settings.get('REDISLOCK_SCHEDULER_INNER')!r}): it builds its dupefilter with from_spider() or "
            f"from_settings(), which this class lacks; use DUPEFILTER_CLASS = {SCRAPY_REDIS_DUPEFILTER!r}, "
            "as scrapy-redis's documentation says"
        )
    return None


class StageScheduler:
    """A scheduler that lets capped requests go only together with a slot of their stage."""

    def __init__(self, crawler: Crawler) -> None:
        one_line_config_errors()  # a ConfigError below ends the crawl as one line, exit status 1
        self.crawler = crawler
        self.settings = read_settings(crawler.settings)
        inner_path = self.settings.scheduler_inner
        try:
            inner_cls = load_object(inner_path)
        except (ImportError, ValueError, NameError, AttributeError) as exc:
            raise ConfigError(f"REDISLOCK_SCHEDULER_INNER cannot be loaded: {inner_path!r} ({exc})") from None
        if inner_cls is StageScheduler or not callable(getattr(inner_cls, "next_request", None)):
            raise ConfigError(f"REDISLOCK_SCHEDULER_INNER must be a scheduler class, got {inner_path!r}")
        self.enabled = self.settings.enabled
        if self.enabled and not self.settings.stages and not self.settings.keyed:
            raise ConfigError(
                "StageScheduler is enabled but REDISLOCK_STAGES is empty, so no request would be capped; set "
                "REDISLOCK_STAGES = {stage: limit, ...}, or REDISLOCK_ENABLED = False to switch it off on purpose"
            )
        if self.enabled:
            check_reactor(crawler, "StageScheduler")
            if not middleware_configured(crawler):
                raise ConfigError(
                    f"SCHEDULER = 'scrapy_redislock.StageScheduler' needs the middleware too: "
                    f"DOWNLOADER_MIDDLEWARES = {{{MIDDLEWARE_PATH!r}: 950}}"
                )
        self.inner = _build_inner(inner_cls, crawler)
        self.park_limit = self.settings.park_limit
        self.waiters_per_stage = self.settings.waiters_per_stage
        self.wait_timeout = self.settings.wait_timeout
        self.locks = StageLocks.of(crawler, self.settings) if self.enabled else None
        capped = list(self.locks.locks) if self.locks is not None else []
        # stage -> (since, request, its key) oldest first; the key (REDISLOCK_STAGE_KEY) only when keys are capped
        self.parked: dict[str, deque[tuple[float, Request, str | None]]] = {stage: deque() for stage in capped}
        self.key_capped = self.settings.stage_key is not None and (
            self.settings.key_limit is not None or any(v is not None for v in self.settings.key_limits.values())
        )
        self._keys: weakref.WeakKeyDictionary[Request, str | None] = weakref.WeakKeyDictionary()
        self.ready: dict[str, deque[SlotPermit]] = {stage: deque() for stage in capped}
        self.waiters: dict[str, set[asyncio.Task[None]]] = {stage: set() for stage in capped}
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.n_parked = 0
        self.closing = False
        self._early: tuple[Any, ...] | None = None  # cache and robots.txt middlewares before ours, found on first use
        self._empty_pause = Backoff(first=EMPTY_PAUSE, most=EMPTY_PAUSE_MOST)
        self._ask_inner_at = 0.0  # monotonic: the inner scheduler came back empty; not asked again before this
        self._wake_after_pause: asyncio.TimerHandle | None = None
        if self.locks is not None:
            self.locks.add_waiting_source(lambda stage: len(self.parked.get(stage, ())))
            self.locks.add_taker(self._take_slot)
            self.locks.add_tick_hook(self.tick)

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> StageScheduler:
        return cls(crawler)

    def __getattr__(self, name: str) -> Any:
        """Anything else is the inner scheduler's (scrapy-redis's ``queue``, ``df``, ``flush``, ...)."""
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- the scheduler interface ---------------------------------------------------------------------------------

    def open(self, spider: Spider) -> Deferred[None] | None:
        result = self.inner.open(spider) if hasattr(self.inner, "open") else None
        if self.locks is None:
            return result
        return deferred_from_coro(self._open(result))

    async def _open(self, inner_result: Any) -> None:
        if inner_result is not None:
            await maybe_deferred_to_future(inner_result)
        assert self.locks is not None
        await self.locks.start_once()

    def close(self, reason: str) -> Deferred[None] | None:
        if self.locks is None:
            return self.inner.close(reason) if hasattr(self.inner, "close") else None
        self.closing = True
        return deferred_from_coro(self._close(reason))

    async def _close(self, reason: str) -> None:
        assert self.locks is not None
        for handle in self.timers.values():
            handle.cancel()
        if self._wake_after_pause is not None:
            self._wake_after_pause.cancel()
        for tasks in self.waiters.values():
            for task in tasks:
                task.cancel()
        returned = 0
        for parked in self.parked.values():
            while parked:
                _, request, _ = parked.popleft()
                request.dont_filter = True  # it passed the dupefilter once already
                self.inner.enqueue_request(request)
                returned += 1
        self.n_parked = 0
        if returned:
            logger.info("Gave %d parked requests back to the inner scheduler", returned)
        if hasattr(self.inner, "close"):
            result = self.inner.close(reason)
            if result is not None:
                await maybe_deferred_to_future(result)
        # Unused slots, waiters, and anything a request left behind: one call per stage frees it all.
        for permits in self.ready.values():
            permits.clear()
        await self.locks.close()

    def has_pending_requests(self) -> bool:
        return self.n_parked > 0 or self.inner.has_pending_requests()

    def __len__(self) -> int:
        return len(self.inner) + self.n_parked

    def enqueue_request(self, request: Request) -> bool:
        self._ask_inner_at = 0.0
        self._empty_pause.reset()
        return bool(self.inner.enqueue_request(request))

    def next_request(self) -> Request | None:
        if self.locks is None:
            return self.inner.next_request()
        request = self._hand_out()
        if request is not None:
            return request
        for _ in range(PULL_BUDGET):
            if self.n_parked >= self.park_limit:
                return None
            request = self._pull()
            if request is None:
                return None
            stage = stage_of(request, self.settings, self.crawler.spider)
            try:
                capped = stage is not None and self.locks.is_capped(stage)
            except UnknownStage:
                return request  # the middleware fails it, naming the stage and counting it
            if not capped or self._settled_early(request):
                return request
            assert stage is not None
            self._park(stage, request)
            request = self._hand_out()
            if request is not None:
                return request
        wake_engine(self.crawler)  # more may be waiting behind: come back at the next loop iteration
        return None

    def _pull(self) -> Request | None:
        """The inner scheduler's next request; None without asking it during a pause after it came back empty."""
        now = time.monotonic()
        if now < self._ask_inner_at:
            if self._wake_after_pause is None and not self.closing:
                self._wake_after_pause = asyncio.get_running_loop().call_later(
                    self._ask_inner_at - now, self._pause_over
                )
            return None
        request = self.inner.next_request()
        if request is None:
            self._ask_inner_at = now + self._empty_pause.next()
        else:
            self._empty_pause.reset()
        return request

    def _pause_over(self) -> None:
        self._wake_after_pause = None
        wake_engine(self.crawler)

    def _settled_early(self, request: Request) -> bool:
        if self._early is None:
            self._early = early_middlewares(self.crawler)
        return bool(self._early) and settled_before_download(request, self._early, self.crawler.spider)

    # -- slots ---------------------------------------------------------------------------------------------------------

    def _take_slot(self, stage: str, permit: SlotPermit) -> bool:
        """A slot freed by a finished request of this process (``StageLocks.finish``): keep it for the oldest parked
        request of its stage that has none yet, and wake the engine to take it; False when there is none."""
        parked = self.parked.get(stage)
        if not parked or len(self.ready[stage]) >= len(parked) or self.closing or engine_closing(self.crawler):
            return False
        self.ready[stage].append(permit)
        wake_engine(self.crawler)
        return True

    def _park(self, stage: str, request: Request) -> None:
        self.parked[stage].append((time.monotonic(), request, self._key(request) if self.key_capped else None))
        self.n_parked += 1
        self.crawler.stats.max_value(f"redislock/{stage}/parked_max", len(self.parked[stage]))
        self._ensure_waiters(stage)
        if self.wait_timeout is not None and stage not in self.timers:
            self._arm_timer(stage)

    def _hand_out(self) -> Request | None:
        """The oldest parked request of a stage that has a granted slot (or whose wait has timed out); with capped
        keys, the oldest whose key has room (:meth:`_pick`)."""
        now = time.monotonic()
        for stage, parked in self.parked.items():
            if not parked:
                continue
            self._drop_unusable(stage)
            ready = self.ready[stage]
            if ready:
                index = self._pick(parked) if self.key_capped else 0
                since, request, _ = parked[index]
                del parked[index]
                self.n_parked -= 1
                assert self.locks is not None
                self.locks.hand(request, ready.popleft())
                self.locks.record_grant(stage, now - since)
                return request
            if self.wait_timeout is not None and now - parked[0][0] >= self.wait_timeout:
                _, request, _ = parked.popleft()
                self.n_parked -= 1
                self.crawler.stats.inc_value(f"redislock/{stage}/timeouts")
                assert self.locks is not None
                self.locks.hand(request, AcquireTimeout(f"stage {stage!r}: no slot within {self.wait_timeout} s"))
                self._free_surplus(stage)
                return request
        return None

    def _key(self, request: Request) -> str | None:
        """The request's key (REDISLOCK_STAGE_KEY), computed once per request; None also when its function fails
        for it (the middleware then fails the request, naming the error)."""
        try:
            return self._keys[request]
        except KeyError:
            pass
        try:
            key = request_key(request, self.crawler.spider, self.settings.stage_key)
        except KeyFunctionError:
            key = None
        self._keys[request] = key
        return key

    def _pick(self, parked: deque[tuple[float, Request, str | None]]) -> int:
        """Where in ``parked`` (oldest first) the request is that gets the next slot of its stage: the oldest whose
        key has room in this process, else the oldest.

        A request takes its stage slot, then waits in the middleware for its key slot, holding the stage slot
        (the order that cannot deadlock, see :mod:`~scrapy_redislock.requests.keygate`). Handing stage slots
        oldest first, a run of requests of one busy key at the head of the queue took every slot of the stage
        and waited for that key, one at a time, while requests of other keys behind them got none (measured: 44
        pages of one host and 0 of the other in 5 s, stage cap 4, key cap 1). A key has room when fewer requests of
        this process hold a slot (any stage) and have that key than the key's limit: a request of it would not
        wait for its key here. Other processes' holders of the key are not seen (that would cost a read per
        hand-out), so a key busy elsewhere still takes stage slots here, up to its limit.
        """
        assert self.locks is not None
        load: Counter[str] = Counter()
        for held in self.locks.holding():
            key = self._key(held)
            if key is not None:
                load[key] += 1
        room: dict[str, bool] = {}
        for index, (_, _, key) in enumerate(parked):
            if key is None:
                return index
            has_room = room.get(key)
            if has_room is None:
                limit = self.settings.limit_of_key(key)
                has_room = room[key] = limit is None or load[key] < limit
            if has_room:
                return index
        return 0

    def _drop_unusable(self, stage: str) -> None:
        """Ready slots that are lost or past their lease go back, and their requests get waiters for fresh ones:
        a request must not start with such a slot (another process may hold it by now)."""
        ready = self.ready[stage]
        now = time.monotonic()
        if all(permit.usable(now) for permit in ready):
            return
        assert self.locks is not None
        kept = []
        for permit in ready:
            if self.locks.usable(permit):
                kept.append(permit)
            else:
                self.locks.release_soon(permit)
        ready.clear()
        ready.extend(kept)
        self._ensure_waiters(stage)

    def _free_surplus(self, stage: str) -> None:
        """Slots granted beyond the parked requests (they timed out meanwhile) go back at once."""
        assert self.locks is not None
        while len(self.ready[stage]) > len(self.parked[stage]):
            self.locks.release_soon(self.ready[stage].pop())

    def _live_waiters(self, stage: str) -> int:
        # A finished task stays in the set until its done callback runs, a loop iteration later: not a waiter.
        return sum(not task.done() for task in self.waiters[stage])

    def _stand_down(self) -> None:
        """The engine is closing and takes no more requests from here: stop waiting, give unused slots back."""
        assert self.locks is not None
        self.closing = True
        for tasks in self.waiters.values():
            for task in tasks:
                task.cancel()
        for permits in self.ready.values():
            while permits:
                self.locks.release_soon(permits.popleft())

    def _ensure_waiters(self, stage: str) -> None:
        wanted = min(len(self.parked[stage]) - len(self.ready[stage]), self.waiters_per_stage)
        waiters = self.waiters[stage]
        while self._live_waiters(stage) < wanted and not self.closing:
            task = asyncio.get_running_loop().create_task(self._wait_for_slots(stage))
            waiters.add(task)
            task.add_done_callback(waiters.discard)

    async def _wait_for_slots(self, stage: str) -> None:
        """One waiter: blocks in Redis for a slot, pairs it with a parked request, and goes on while needed."""
        assert self.locks is not None
        backoff = Backoff()
        while not self.closing:
            try:
                permit = await self.locks.acquire(stage, None)  # Redis errors are retried in there
            except Exception:
                delay = backoff.next()
                logger.exception("Waiting for a slot of stage %r failed; trying again in %.1f s", stage, delay)
                await asyncio.sleep(delay)
                continue
            backoff.reset()
            if self.closing or engine_closing(self.crawler):
                await self.locks.release(permit)
                return
            self.ready[stage].append(permit)
            wake_engine(self.crawler)
            if len(self.ready[stage]) > len(self.parked[stage]):
                await asyncio.sleep(0)  # the engine may take it first; if not, it is surplus
                self._free_surplus(stage)
            # Go on while the requests still waiting need every waiter, this one included.
            if len(self.parked[stage]) - len(self.ready[stage]) < self._live_waiters(stage):
                return

    def _arm_timer(self, stage: str) -> None:
        """Wake the engine when the oldest parked request of ``stage`` reaches REDISLOCK_WAIT_TIMEOUT."""
        assert self.wait_timeout is not None
        parked = self.parked[stage]
        if not parked or self.closing:
            self.timers.pop(stage, None)
            return
        due = parked[0][0] + self.wait_timeout - time.monotonic()
        # Overdue (the engine has not asked since, its downloader being full): look again a little later.
        delay = due + 0.001 if due > 0 else 0.1
        self.timers[stage] = asyncio.get_running_loop().call_later(delay, self._timer_fired, stage)

    def _timer_fired(self, stage: str) -> None:
        wake_engine(self.crawler)
        self._arm_timer(stage)

    async def tick(self) -> None:
        """At every renewal tick: stand down once the engine closes; drop ready slots that can no longer be handed
        out (so a fresh one is asked for before the engine next asks); make sure parked requests have a waiter."""
        if engine_closing(self.crawler):
            self._stand_down()
        for stage in self.parked:  # a safety net: parked requests always have someone waiting for them
            self._drop_unusable(stage)
            self._ensure_waiters(stage)
