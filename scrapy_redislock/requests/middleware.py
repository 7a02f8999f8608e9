"""StageLockMiddleware: cap the requests in flight per stage across every process of a crawl.

A request's stage comes from ``meta["redislock_stage"]``, the ``@stage(...)`` decorator on its callback,
REDISLOCK_CALLBACK_STAGES, or REDISLOCK_DEFAULT_STAGE; ``meta["dont_redislock"]`` opts it out, and robots.txt is
never throttled (see :func:`scrapy_redislock.crawl.stages.stage_of`). A capped request holds a slot of its stage from
here until its download ends, and the slot is released on every outcome: response, exception (download timeout
included), IgnoreRequest or a response from a later middleware, a request dropped on the way (found by a sweep at
every renewal tick), the spider closing. Permits are kept by request object, never in ``meta``, so retries and
redirects (which copy meta) never carry one.

With :class:`~scrapy_redislock.StageScheduler` the slot was granted before the request left the scheduler and is
picked up here. Without it, and for requests that bypass the scheduler (``engine.download_async``: media
pipelines), the request waits here, in Redis's FIFO: caps hold, but a waiting request occupies one of
CONCURRENT_REQUESTS (so a saturated stage slows the others). When the spider closes, requests waiting here keep
their place in line, as Scrapy finishes what its downloader holds, while their stage makes progress; those of a
stage that is paused (limit 0) or frees no slot anywhere for REDISLOCK_TTL + DOWNLOAD_TIMEOUT are dropped
(IgnoreRequest), logged at WARNING with counts and counted as ``redislock/<stage>/dropped_at_close``.

Fail closed: enabled with no stage is a ConfigError; with REDISLOCK_ENABLED = False the middleware stays in the
chain and fails every request that has a stage with ThrottlingDisabled (counted), never sends it unthrottled.
AcquireTimeout (REDISLOCK_WAIT_TIMEOUT) is not retried by RetryMiddleware unless RETRY_EXCEPTIONS names it.

Settings read (via :func:`scrapy_redislock.crawl.settings.read_settings`): REDISLOCK_ENABLED, REDISLOCK_URL (and the
scrapy-redis fallbacks), REDISLOCK_PARAMS, REDISLOCK_STAGES, REDISLOCK_TTL, REDISLOCK_KEY_PREFIX,
REDISLOCK_DEFAULT_STAGE, REDISLOCK_CALLBACK_STAGES, REDISLOCK_WAIT_TIMEOUT, and for keys and delays
(:mod:`~scrapy_redislock.requests.keygate`: after the stage slot, the key slot, then the delays) REDISLOCK_STAGE_KEY,
REDISLOCK_KEY_LIMIT, REDISLOCK_KEY_LIMITS, REDISLOCK_DELAY, REDISLOCK_DELAYS, REDISLOCK_RANDOMIZE_DELAY; Scrapy's
RETRY_EXCEPTIONS and DOWNLOAD_TIMEOUT.
Stats: redislock/<stage>/{acquired,wait_time_total,wait_time_max,lost,timeouts,dropped_at_close},
redislock/unknown_stage, redislock/throttling_off, redislock/redis_errors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from scrapy import Request, Spider, signals
from scrapy.downloadermiddlewares.httpcache import HttpCacheMiddleware
from scrapy.downloadermiddlewares.robotstxt import RobotsTxtMiddleware
from scrapy.exceptions import IgnoreRequest
from scrapy.utils.httpobj import urlparse_cached
from scrapy.utils.misc import load_object

from scrapy_redislock.crawl.engine import check_reactor, downloader_active, engine_closing, engine_scheduler
from scrapy_redislock.crawl.settings import read_settings
from scrapy_redislock.crawl.stagelocks import StageLocks
from scrapy_redislock.crawl.stages import stage_of
from scrapy_redislock.errors import AcquireTimeout, ConfigError, ThrottlingDisabled, UnknownStage
from scrapy_redislock.lock.core import Permit
from scrapy_redislock.requests.keygate import KeyGate

if TYPE_CHECKING:
    from typing import Self

    from scrapy.crawler import Crawler
    from scrapy.http import Response

logger = logging.getLogger(__name__)

# How often requests waiting here check whether the engine is closing (its close waits for them).
CLOSE_CHECK_INTERVAL = 0.1
# Once it closes, how often the stages they wait for are checked for progress (one read of the lock in Redis).
STALL_CHECK_INTERVAL = 1.0


class StageLockMiddleware:
    """Downloader middleware holding one slot of the request's stage while the request is downloaded."""

    def __init__(self, crawler: Crawler) -> None:
        self.crawler = crawler
        self.settings = read_settings(crawler.settings)
        self.permits: dict[Request, Permit] = {}  # by request object: never in meta, which copies carry
        self.waiting: Counter[str] = Counter()  # requests waiting here, per stage
        self._waits: dict[asyncio.Task[Permit], str] = {}  # wait -> stage
        self._dropped: set[asyncio.Task[Permit]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self._closing = False
        self._suspects: set[Request] = set()
        self.retry_timeouts = _names_acquire_timeout(crawler.settings.getlist("RETRY_EXCEPTIONS"))
        self.stall_window = self.settings.ttl + crawler.settings.getfloat("DOWNLOAD_TIMEOUT", 180)
        if not self.settings.enabled:
            logger.warning(
                "REDISLOCK_ENABLED is False: requests that have a stage fail with ThrottlingDisabled instead of "
                "going out unthrottled; remove %s from DOWNLOADER_MIDDLEWARES to crawl them unthrottled on purpose",
                MIDDLEWARE_PATH,
            )
            self.locks: StageLocks | None = None
            return
        if not self.settings.stages and not self.settings.keyed:
            raise ConfigError(
                "StageLockMiddleware is enabled but REDISLOCK_STAGES is empty, so no request would be capped; "
                "set REDISLOCK_STAGES = {stage: limit, ...} or REDISLOCK_STAGE_KEY, or REDISLOCK_ENABLED = False to "
                "switch it off on purpose"
            )
        check_reactor(crawler, "StageLockMiddleware")
        self.locks = StageLocks.of(crawler, self.settings)
        self.gate = KeyGate(crawler, self.settings) if self.settings.keyed else None  # keys and delays
        self.locks.add_waiting_source(self.waiting.__getitem__)
        self.locks.add_tick_hook(self.sweep)
        crawler.signals.connect(self.spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(self.spider_closed, signal=signals.spider_closed)
        crawler.signals.connect(self.request_left, signal=signals.request_left_downloader)

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        return cls(crawler)

    def spider_opened(self, spider: Spider) -> None:
        """Say so when a cache or robots.txt middleware runs after this one (its requests would take slots)."""
        late = [type(mw).__name__ for mw in _middlewares_after(self.crawler, self) if isinstance(mw, _EARLY_TYPES)]
        if late:
            logger.warning(
                "%s run(s) after StageLockMiddleware: cache hits and robots.txt refusals then take a slot; "
                "give StageLockMiddleware a higher order (950)",
                ", ".join(late),
            )

    # -- the request's way through ---------------------------------------------------------------------------------

    def process_request(self, request: Request, spider: Spider | None = None) -> Coroutine[Any, Any, None] | None:
        """None at once when there is nothing to wait for; a coroutine only when the request must wait here.

        A plain method keeps uncapped requests, and requests whose slot came with them from the scheduler, free of
        any coroutine round trip.
        """
        if self.locks is None:
            return self._refuse_unthrottled(request)
        handed = self._from_scheduler(request)
        if isinstance(handed, Permit):
            self.permits[request] = handed
            return self._keys(request, handed.name)
        if handed is not None:
            self._fail_timeout(request, handed)  # the scheduler's verdict after REDISLOCK_WAIT_TIMEOUT
        stage = stage_of(request, self.settings, self.crawler.spider)
        if stage is None:
            return self._keys(request, None)
        try:
            capped = self.locks.is_capped(stage)
        except UnknownStage:
            self.crawler.stats.inc_value("redislock/unknown_stage")
            raise
        if not capped:
            return self._keys(request, stage)
        return self._wait_here(request, stage)

    def _keys(self, request: Request, stage: str | None) -> Coroutine[Any, Any, None] | None:
        """After the stage slot: the key slot and the delays (:mod:`~scrapy_redislock.requests.keygate`), if any."""
        through = None if self.gate is None else self.gate.prepare(request, stage)
        return None if through is None else self._through_gate(request, through)

    async def _through_gate(self, request: Request, through: Coroutine[Any, Any, None]) -> None:
        try:
            await through
        except AcquireTimeout as exc:
            self._fail_timeout(request, exc)

    def _refuse_unthrottled(self, request: Request) -> None:
        stage = stage_of(request, self.settings, self.crawler.spider)
        if stage is None:
            return
        self.crawler.stats.inc_value("redislock/throttling_off")
        raise ThrottlingDisabled(
            f"request of stage {stage!r} refused: REDISLOCK_ENABLED is False, and it must not go out unthrottled "
            f"(remove {MIDDLEWARE_PATH} from DOWNLOADER_MIDDLEWARES to crawl unthrottled on purpose)"
        )

    def _fail_timeout(self, request: Request, error: BaseException) -> None:
        """Raise the error; an AcquireTimeout is not retried unless RETRY_EXCEPTIONS names AcquireTimeout (it is
        an OSError, which RetryMiddleware retries by default: the wait would be REDISLOCK_WAIT_TIMEOUT times
        RETRY_TIMES + 1)."""
        if isinstance(error, AcquireTimeout) and not self.retry_timeouts:
            request.meta["dont_retry"] = True
        raise error

    def _from_scheduler(self, request: Request) -> Permit | BaseException | None:
        take = getattr(engine_scheduler(self.crawler), "take_permit", None)
        return take(request) if take is not None else None

    async def _wait_here(self, request: Request, stage: str) -> None:
        """Wait in Redis's FIFO (no StageScheduler, or a request that bypassed it); see the module docstring for
        what happens when the spider closes meanwhile."""
        assert self.locks is not None
        started = time.monotonic()
        wait = asyncio.ensure_future(self.locks.acquire(stage, self.settings.wait_timeout))
        self._waits[wait] = stage
        self.waiting[stage] += 1
        self._watch_close()
        try:
            permit = await wait
        except asyncio.CancelledError:
            if wait in self._dropped or (self._closing and wait.cancelled()):
                raise IgnoreRequest(f"spider closing while waiting for a slot of stage {stage!r}") from None
            raise
        except AcquireTimeout as exc:
            self._fail_timeout(request, exc)
        finally:
            self._waits.pop(wait, None)
            self._dropped.discard(wait)
            self.waiting[stage] -= 1
        self.permits[request] = permit
        self.locks.record_grant(stage, time.monotonic() - started)
        after = self._keys(request, stage)
        if after is not None:
            await after

    def _watch_close(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._close_watch())

    async def _close_watch(self) -> None:
        """One task for all waits here. Once the engine closes they keep waiting while their stage makes progress;
        the waits of a stage that is paused or stalled are dropped, so that the close never hangs for ever."""
        assert self.locks is not None
        while self._waits:
            if self.locks.closed:
                self._drop(set(self._waits.values()), "the stage slots were closed")
                return
            if not engine_closing(self.crawler):
                await asyncio.sleep(CLOSE_CHECK_INTERVAL)
                continue
            for stage in sorted(set(self._waits.values())):
                why = await self.locks.stalled(stage, self.stall_window)
                if why:
                    self._drop({stage}, why)
            await asyncio.sleep(STALL_CHECK_INTERVAL)

    def _drop(self, stages: set[str], why: str) -> None:
        dropped: Counter[str] = Counter()
        for wait, stage in list(self._waits.items()):
            if stage in stages and wait not in self._dropped:
                self._dropped.add(wait)
                wait.cancel()
                dropped[stage] += 1
        for stage, count in sorted(dropped.items()):
            self.crawler.stats.inc_value(f"redislock/{stage}/dropped_at_close", count)
            logger.warning(
                "Spider closing: dropped %d request(s) waiting for a slot of stage %r (%s)", count, stage, why
            )

    def process_response(self, request: Request, response: Response, spider: Spider | None = None) -> Response:
        self._release(request)
        return response

    def process_exception(self, request: Request, exception: Exception, spider: Spider | None = None) -> None:
        self._release(request)

    def request_left(self, request: Request, spider: Spider) -> None:
        """The download is over (request_left_downloader fires before process_response): free the slot now."""
        self._release(request)

    def _release(self, request: Request) -> None:
        if self.locks is None:
            return
        if self.gate is not None:
            self.gate.release(request)
        permit = self.permits.pop(request, None)
        if permit is None:
            # A slot the scheduler handed out with a request that never reached process_request (an earlier
            # middleware answered it from a cache, or raised IgnoreRequest).
            handed = self._from_scheduler(request)
            permit = handed if isinstance(handed, Permit) else None
        if permit is not None:
            self.locks.release_soon(permit)

    async def sweep(self) -> None:
        """At every renewal tick: free slots of requests that left the downloader without passing back here.

        A request must be missing from ``downloader.active`` at two ticks in a row (the engine adds a request
        to it in the same call that takes it from the scheduler, so one tick would do; two costs nothing).
        """
        assert self.locks is not None
        active = downloader_active(self.crawler)
        if active is None:
            return
        gone = {request for request in self.permits if request not in active}
        for request in gone & self._suspects:
            permit = self.permits.pop(request, None)
            if permit is not None:
                logger.debug("Freeing the slot of %s, which left the downloader unseen", request)
                await self.locks.release(permit)
        self._suspects = gone

    async def spider_closed(self, spider: Spider, reason: str) -> None:
        """Free every permit and waiter of this process (one call per stage) before spider_closed completes."""
        assert self.locks is not None
        self._closing = True
        if self.gate is not None:
            await self.gate.close()
        await self.locks.close()
        self.permits.clear()


MIDDLEWARE_PATH = "scrapy_redislock.StageLockMiddleware"


def _names_acquire_timeout(exceptions: list[Any]) -> bool:
    """Whether RETRY_EXCEPTIONS names AcquireTimeout (or a subclass) itself, not only a base class like OSError."""
    for entry in exceptions:
        try:
            loaded = load_object(entry) if isinstance(entry, str) else entry
        except (ImportError, ValueError, NameError, AttributeError):
            continue
        if isinstance(loaded, type) and issubclass(loaded, AcquireTimeout):
            return True
    return False


# -- requests an earlier middleware answers or drops without a download: no slot for them ---------------------------


_EARLY_TYPES = (HttpCacheMiddleware, RobotsTxtMiddleware)


def _chain(crawler: Crawler) -> tuple[Any, ...]:
    manager = getattr(getattr(getattr(crawler, "engine", None), "downloader", None), "middleware", None)
    return tuple(getattr(manager, "middlewares", ()))


def _middlewares_after(crawler: Crawler, ours: Any) -> tuple[Any, ...]:
    chain = _chain(crawler)
    return chain[chain.index(ours) + 1 :] if ours in chain else ()


def early_middlewares(crawler: Crawler) -> tuple[Any, ...]:
    """The HttpCacheMiddleware and RobotsTxtMiddleware instances that see a request before StageLockMiddleware."""
    chain = _chain(crawler)
    ours = next((i for i, mw in enumerate(chain) if isinstance(mw, StageLockMiddleware)), len(chain))
    return tuple(mw for mw in chain[:ours] if isinstance(mw, _EARLY_TYPES))


def settled_before_download(request: Request, middlewares: tuple[Any, ...], spider: Any) -> bool:
    """True when one of ``middlewares`` (see :func:`early_middlewares`) will answer or drop the request without
    a download, so it needs no slot: a fresh cache hit, a cache miss with HTTPCACHE_IGNORE_MISSING, a URL that
    robots.txt forbids, or a host whose robots.txt is not known yet (RobotsTxtMiddleware decides first; a request
    it lets through then waits for its slot in StageLockMiddleware). Reads the cache the way HttpCacheMiddleware
    does (one more read of the entry).
    """
    for mw in middlewares:
        if isinstance(mw, HttpCacheMiddleware):
            if _cache_settles(mw, request, spider):
                return True
        elif _robots_settles(mw, request):
            return True
    return False


def _cache_settles(mw: Any, request: Request, spider: Any) -> bool:
    if request.meta.get("dont_cache") or not mw.policy.should_cache_request(request):
        return False
    try:
        cached = mw.storage.retrieve_response(spider, request)
    except Exception:  # HttpCacheMiddleware counts it as a miss and downloads
        return False
    if cached is None:
        return bool(mw.ignore_missing)
    return bool(mw.policy.is_cached_response_fresh(cached, request))


def _robots_settles(mw: Any, request: Request) -> bool:
    if request.meta.get("dont_obey_robotstxt") or request.url.startswith(("data:", "file:")):
        return False
    parsers = getattr(mw, "_parsers", None)
    if parsers is None:  # a future Scrapy: wait for a slot as before, correct if not free
        return False
    parser = parsers.get(urlparse_cached(request).netloc, _UNKNOWN)
    if parser is None:  # robots.txt could not be fetched: everything is allowed
        return False
    if parser is _UNKNOWN or not hasattr(parser, "allowed"):  # not fetched yet, or being fetched
        return True
    agent = getattr(mw, "_robotstxt_useragent", None) or request.headers.get(
        b"User-Agent", getattr(mw, "_default_useragent", None)
    )
    return not parser.allowed(request.url, agent)


_UNKNOWN = object()
