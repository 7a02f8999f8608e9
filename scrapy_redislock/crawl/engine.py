"""Every touch of Scrapy's engine and reactor that Scrapy has no public call for, in one place.

Each function degrades to something safe should a future Scrapy rename what it reads: the engine's heartbeat takes
over from :func:`wake_engine`, REDISLOCK_WAIT_TIMEOUT from :func:`engine_closing`, the downloader's set from
:func:`in_progress`. Reads no settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scrapy.utils.asyncio import is_asyncio_available

from scrapy_redislock.errors import ConfigError

if TYPE_CHECKING:
    from scrapy.core.scheduler import BaseScheduler
    from scrapy.crawler import Crawler


def wake_engine(crawler: Crawler) -> None:
    """Make the engine ask the scheduler for requests at its next loop iteration, not at its 5 s heartbeat.

    Scrapy 2.19 has no public call for this. ``engine._slot.nextcall`` is the CallLaterOnce the engine itself
    schedules after every finished download; should a future Scrapy rename it, this does nothing and the
    heartbeat takes over (slots are then used up to 5 s late, never lost).
    """
    slot = getattr(getattr(crawler, "engine", None), "_slot", None)
    nextcall = getattr(slot, "nextcall", None)
    if nextcall is not None:
        nextcall.schedule()


def engine_closing(crawler: Crawler) -> bool:
    """True once the engine stops or closes the spider: it takes no more requests from the scheduler, whose waiters
    stand down; requests waiting in the middleware keep their place while their stage makes progress.

    ``engine.running`` is public and covers stop (SIGTERM, Ctrl-C); a close on its own (CLOSESPIDER_*, the spider
    finishing) only shows in the private ``engine._slot.closing``. Without it, the fallback is REDISLOCK_WAIT_TIMEOUT.
    """
    engine = getattr(crawler, "engine", None)
    if engine is None:
        return True
    if not engine.running:
        return getattr(engine, "start_time", None) is not None  # stopped; before its start it is not closing
    slot = getattr(engine, "_slot", None)
    return slot is None or getattr(slot, "closing", None) is not None


def downloader_active(crawler: Crawler) -> Any:
    """The requests the downloader has now (``engine.downloader.active``), or None before the engine exists."""
    return getattr(getattr(getattr(crawler, "engine", None), "downloader", None), "active", None)


def downloader_middlewares(crawler: Crawler) -> tuple[Any, ...]:
    """The downloader middleware instances in chain order (``engine.downloader.middleware.middlewares``), or ()."""
    manager = getattr(getattr(getattr(crawler, "engine", None), "downloader", None), "middleware", None)
    return tuple(getattr(manager, "middlewares", ()))


def left_twice(crawler: Crawler, held: Any, suspects: set[Any]) -> tuple[set[Any], set[Any]]:
    """Of the requests in ``held``, those missing from the downloader now and at the last look (``suspects``),
    and those missing now (the next look's suspects). The engine adds a request to the downloader in the same call
    that takes it from the scheduler, so one look would do; two cost nothing. (set(), set()) before the engine."""
    active = downloader_active(crawler)
    if active is None:
        return set(), suspects
    gone = {request for request in held if request not in active}
    return gone & suspects, gone


def engine_scheduler(crawler: Crawler) -> BaseScheduler | None:
    """The engine's scheduler: ``engine.scheduler`` (public since Scrapy 2.19), else the engine slot's."""
    engine = getattr(crawler, "engine", None)
    if engine is None:
        return None
    try:
        return engine.scheduler
    except AttributeError:
        return getattr(getattr(engine, "_slot", None), "scheduler", None)


def in_progress(crawler: Crawler) -> Any:
    """Requests the engine has not finished with (download, callback, output: ``engine._slot.inprogress``), else
    the downloader's (weaker: a download's end, not its callback's), else None before the engine exists."""
    slot = getattr(getattr(crawler, "engine", None), "_slot", None)
    found = getattr(slot, "inprogress", None)
    return found if found is not None else downloader_active(crawler)


def check_reactor(crawler: Crawler, component: str) -> None:
    """ConfigError unless asyncio can be used: every Redis call runs on the reactor thread with redis.asyncio.

    A ConfigError, not NotConfigured: Scrapy would drop a middleware raising NotConfigured and crawl unthrottled.
    """
    try:
        available = is_asyncio_available()
    except RuntimeError:  # no reactor and no running loop: nothing can run yet, let Scrapy report that
        return
    if not available:
        raise ConfigError(
            f"{component} needs asyncio: TWISTED_REACTOR is {crawler.settings.get('TWISTED_REACTOR')!r}; use "
            "'twisted.internet.asyncioreactor.AsyncioSelectorReactor' (Scrapy's default) or "
            "TWISTED_REACTOR_ENABLED = False. Redis is only called with redis.asyncio, so that the reactor never blocks"
        )
