"""Every touch of Scrapy's engine and reactor that Scrapy has no public call for, in one place.

Each function degrades to something safe should a future Scrapy rename what it reads: the engine's
heartbeat takes over from :func:`wake_engine`, REDISLOCK_WAIT_TIMEOUT from :func:`engine_closing`,
the downloader's set from :func:`in_progress`; :func:`at_download_start` warns once and the bound
set when the request left the front stands. Reads no settings.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from scrapy import signals
from scrapy.utils.asyncio import is_asyncio_available

from scrapy_redislock.errors import ConfigError

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.core.scheduler import BaseScheduler
    from scrapy.crawler import Crawler

logger = logging.getLogger(__name__)
_watched: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()

T = TypeVar("T")


def one_line_config_errors() -> None:
    """Have a ConfigError that ends the crawl reported as one line (``ConfigError: <message>``), not
    as asyncio's ``Task exception was never retrieved`` with a 30-line traceback. Called by our
    components when the crawler builds them; the exit status stays 1 (Scrapy marks the crawl's
    bootstrap as failed).

    Scrapy 2.19 runs a crawl in one asyncio task (``AsyncCrawlerRunner._crawl_and_track``) and
    re-raises what ends it, leaving it to asyncio to log the unretrieved exception with its
    traceback. A done callback on that task (the task building us) retrieves a ConfigError and logs
    its message; any other exception is handed to the loop's exception handler as asyncio would
    have. Without a running task (a non-asyncio reactor, refused anyway by
    :func:`check_reactor`) it does nothing.
    """
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running event loop
        return
    if task is None or task in _watched:
        return
    _watched.add(task)
    task.add_done_callback(_report_config_error)


def _report_config_error(task: asyncio.Task[Any]) -> None:
    if task.cancelled():
        return
    error = task.exception()  # retrieved: asyncio will not log it again when the task is collected
    if error is None:
        return
    cause = config_error_in(error)
    if cause is None:
        task.get_loop().call_exception_handler(
            {"message": "Task exception was never retrieved", "exception": error, "future": task}
        )
        return
    logger.error("ConfigError: %s", cause)
    # raised while Scrapy cleaned up after it (RuntimeError: Engine slot not assigned)
    if cause is not error:
        logger.debug(
            "After the ConfigError, closing the engine raised %s: %s", type(error).__name__, error
        )


def config_error_in(error: BaseException) -> ConfigError | None:
    """``error`` if it is a ConfigError, else the first ConfigError in its chain
    (``__cause__``/``__context__``): a ConfigError raised while the engine opens the spider
    (building the scheduler) is followed by Scrapy's own ``RuntimeError: Engine slot not assigned``
    from its clean-up, which would otherwise hide it."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, ConfigError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def one_per_crawler(crawler: Crawler, attr: str, make: Callable[[], T]) -> T:
    """The crawler's one instance of a part its components share (kept on the crawler as
    ``attr``), made by ``make()`` on first use."""
    existing: T | None = getattr(crawler, attr, None)
    if existing is None:
        existing = make()
        setattr(crawler, attr, existing)
    return existing


def engine_of(crawler: Crawler) -> Any:
    """The crawler's engine, or None before it exists (Scrapy 2.19's ``Crawler.engine`` raises
    RuntimeError then)."""
    try:
        return getattr(crawler, "engine", None)
    except RuntimeError:
        return None


def at_download_start(crawler: Crawler, hook: Callable[[Request], None]) -> None:
    """Call ``hook(request)`` as each request's download starts: when the download handler gets
    it, after its downloader slot's queue and delay (DOWNLOAD_DELAY, AutoThrottle,
    CONCURRENT_REQUESTS_PER_DOMAIN), which may outlast a slot's lease. Both Scrapy 2.18 and 2.19
    call ``downloader.handlers.download_request_async`` there, and only there; it is wrapped once
    per crawler, for every hook given."""
    one_per_crawler(crawler, "_redislock_starts", lambda: _download_start_hooks(crawler)).append(
        hook
    )


def _download_start_hooks(crawler: Crawler) -> list[Callable[[Request], None]]:
    """The crawler's hooks at a download's start, its downloader's handlers wrapped to call them
    (a list nothing calls, said once, when this Scrapy has no such handlers)."""
    hooks: list[Callable[[Request], None]] = []
    handlers = getattr(getattr(engine_of(crawler), "downloader", None), "handlers", None)
    download = getattr(handlers, "download_request_async", None)
    if handlers is None or download is None:
        logger.warning(
            "This Scrapy's downloader has no handlers.download_request_async: a download that waited in its downloader slot (DOWNLOAD_DELAY, CONCURRENT_REQUESTS_PER_DOMAIN) is bounded by its slot's lease as it was when it left the scheduler or StageLockMiddleware"  # noqa: E501
        )
        return hooks

    async def download_request_async(request: Request) -> Any:
        for each in hooks:
            each(request)
        return await download(request)

    handlers.download_request_async = download_request_async
    return hooks


def wake_engine(crawler: Crawler) -> None:
    """Make the engine ask the scheduler for requests at its next loop iteration, not at its 5 s
    heartbeat.

    Scrapy 2.19 has no public call for this. ``engine._slot.nextcall`` is the CallLaterOnce the
    engine itself schedules after every finished download; should a future Scrapy rename it, this
    does nothing and the heartbeat takes over (slots are then used up to 5 s late, never lost).
    """
    slot = getattr(engine_of(crawler), "_slot", None)
    nextcall = getattr(slot, "nextcall", None)
    if nextcall is not None:
        nextcall.schedule()


def engine_closing(crawler: Crawler) -> bool:
    """True once the engine stops or closes the spider: it takes no more requests from the
    scheduler, whose waiters stand down; requests waiting in the middleware keep their place while
    their stage makes progress.

    ``engine.running`` is public and covers stop (SIGTERM, Ctrl-C); a close on its own
    (CLOSESPIDER_*, the spider finishing) only shows in the private ``engine._slot.closing``.
    Without it, the fallback is REDISLOCK_WAIT_TIMEOUT.
    """
    engine = engine_of(crawler)
    if engine is None:
        return True
    slot = getattr(engine, "_slot", None)
    if not engine.running:
        # stopped, or closing the spider (CLOSESPIDER_TIMEOUT's timer runs from spider_opened); not
        # before its start, nor while it starts (engine_started's handlers run, which may take
        # long: start_time is set then, running not yet, and _starting until a stop)
        if slot is not None and getattr(slot, "closing", None) is not None:
            return True
        return getattr(engine, "start_time", None) is not None and not getattr(
            engine, "_starting", False
        )
    return slot is None or getattr(slot, "closing", None) is not None


def downloader_active(crawler: Crawler) -> Any:
    """The requests the downloader has now (``engine.downloader.active``), or None before the engine
    exists."""
    return getattr(getattr(engine_of(crawler), "downloader", None), "active", None)


def downloader_middlewares(crawler: Crawler) -> tuple[Any, ...]:
    """The downloader middleware instances in chain order
    (``engine.downloader.middleware.middlewares``), or ()."""
    manager = getattr(getattr(engine_of(crawler), "downloader", None), "middleware", None)
    return tuple(getattr(manager, "middlewares", ()))


def engine_scheduler(crawler: Crawler) -> BaseScheduler | None:
    """The engine's scheduler: ``engine.scheduler`` (public since Scrapy 2.19), else the engine
    slot's."""
    engine = engine_of(crawler)
    if engine is None:
        return None
    try:
        return engine.scheduler
    except AttributeError:
        return getattr(getattr(engine, "_slot", None), "scheduler", None)


def in_progress(crawler: Crawler) -> Any:
    """Requests the engine has not finished with (download, callback, output:
    ``engine._slot.inprogress``), else the downloader's (weaker: a download's end, not its
    callback's), else None before the engine exists."""
    slot = getattr(engine_of(crawler), "_slot", None)
    found = getattr(slot, "inprogress", None)
    return found if found is not None else downloader_active(crawler)


def check_reactor(crawler: Crawler, component: str) -> None:
    """ConfigError unless asyncio can be used: every Redis call runs on the reactor thread with
    redis.asyncio.

    A ConfigError, not NotConfigured: Scrapy would drop a middleware raising NotConfigured and crawl
    unthrottled.
    """
    try:
        available = is_asyncio_available()
    # no reactor and no running loop: nothing can run yet, let Scrapy report that
    except RuntimeError:
        return
    if not available:
        raise ConfigError(
            f"{component} needs asyncio: TWISTED_REACTOR is {crawler.settings.get('TWISTED_REACTOR')!r}; use 'twisted.internet.asyncioreactor.AsyncioSelectorReactor' (Scrapy's default) or TWISTED_REACTOR_ENABLED = False. Redis is only called with redis.asyncio, so that the reactor never blocks"  # noqa: E501
        )


def finish_uncleanly(crawler: Crawler, reason: str, last_word: Callable[[], None]) -> None:
    """The crawl lost or dropped requests: it must not end as a clean finish. Once per crawler and
    reason, a spider_closed handler (connected now, so that it runs after CoreStats's) calls
    ``last_word`` (the closing ERROR line), replaces a finish reason of ``finished`` with ``reason``
    (another reason, a timeout or a shutdown, is kept) and leaves the crawler without a spider, for
    which Scrapy's commands exit with status 1 (as after a failed start)."""
    done: set[str] = crawler.__dict__.setdefault("_redislock_unclean", set())
    if reason in done:
        return
    done.add(reason)

    def closed(spider: Any, reason: str) -> None:
        last_word()
        if crawler.stats.get_value("finish_reason", reason) == "finished":
            crawler.stats.set_value("finish_reason", unclean)
        crawler.spider = None

    unclean = reason
    # a strong reference: signals keep weak ones, and this closure has no other owner
    crawler.__dict__.setdefault("_redislock_unclean_handlers", []).append(closed)
    crawler.signals.connect(closed, signal=signals.spider_closed)


class StartLogCount(logging.Handler):
    """The log records of a crawler's start that Scrapy's log counter does not see.

    Scrapy counts records (``log_count/<LEVEL>``) only from the spider_opened signal on (the
    LogCount extension), and CoreStats times the crawl from then too; the redislock start
    (reaching Redis, retried for up to REDISLOCK_CONNECT_TIMEOUT s with a warning each try) runs
    before it, in the scheduler's ``open()``. So a start that fails would dump stats with no
    warning or error counted and an elapsed time of milliseconds. This handler counts, at the
    crawler's LOG_LEVEL and up, what is logged from the start's beginning (when it began before
    spider_opened) until :meth:`hand_over` adds it to the stats; :meth:`timed_from_start` makes a
    failed start's ``start_time`` and ``elapsed_time_seconds`` span that wait.
    """

    def __init__(self, crawler: Crawler, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(level=crawler.settings.get("LOG_LEVEL") or logging.NOTSET)
        self.crawler = crawler
        self.clock = clock  # monotonic seconds: a failed start's elapsed time
        self.counts: Counter[str] = Counter()
        self.began = datetime.datetime.now(tz=datetime.UTC)
        self.began_monotonic = clock()
        self.installed = False

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[record.levelname] += 1

    def install(self) -> None:
        if not self.installed:
            logging.root.addHandler(self)
            self.installed = True

    def hand_over(self) -> None:
        """Stop counting (Scrapy's counter runs now) and add what was counted to the stats."""
        if not self.installed:
            return
        logging.root.removeHandler(self)
        self.installed = False
        for level, count in sorted(self.counts.items()):
            self.crawler.stats.inc_value(f"log_count/{level}", count)
        self.counts.clear()

    def timed_from_start(self) -> None:
        """A failed start's stats: timed from when the start began (CoreStats timed them from
        spider_opened, after the wait for Redis); called after CoreStats' spider_closed."""
        stats = self.crawler.stats
        stats.set_value("start_time", self.began)
        stats.set_value("elapsed_time_seconds", self.clock() - self.began_monotonic)


def count_start_logs(
    crawler: Crawler, clock: Callable[[], float] = time.monotonic
) -> StartLogCount:
    """The crawler's one :class:`StartLogCount`, counting from now (on the first caller's
    ``clock``)."""

    def make() -> StartLogCount:
        counter = StartLogCount(crawler, clock)
        counter.install()
        return counter

    return one_per_crawler(crawler, "_redislock_start_logs", make)
