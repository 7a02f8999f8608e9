"""The request front in one line: ``ADDONS = {"scrapy_redislock.Addon": 100}``.

A Scrapy add-on (Scrapy 2.10+, ``scrapy/addons.py``) that enables
:class:`~scrapy_redislock.requests.middleware.StageLockMiddleware` and puts
:class:`~scrapy_redislock.requests.scheduler.StageScheduler` in front of whatever ``SCHEDULER`` the
project has: Scrapy's own, or scrapy-redis's (``scrapy_redis.scheduler.Scheduler``, whose queue then
stays shared by every process), which becomes ``REDISLOCK_SCHEDULER_INNER``. What it cannot wrap it
refuses with a :class:`~scrapy_redislock.errors.ConfigError` naming the settings: the worker front's
scheduler (a worker mixin sets its own), or a ``REDISLOCK_SCHEDULER_INNER`` of the project's that
differs from its ``SCHEDULER`` (which of the two should be wrapped?).

Settings it reads and writes: ``SCHEDULER``, ``REDISLOCK_SCHEDULER_INNER``,
``DOWNLOADER_MIDDLEWARES``. Every other ``REDISLOCK_*`` setting is read as usual
(:mod:`scrapy_redislock.crawl.settings`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scrapy.utils.misc import load_object

from scrapy_redislock.crawl.inner import SETTING as INNER
from scrapy_redislock.crawl.inner import inner_name
from scrapy_redislock.errors import ConfigError

if TYPE_CHECKING:
    from scrapy.settings import BaseSettings

MIDDLEWARE = "scrapy_redislock.StageLockMiddleware"
MIDDLEWARE_PRIORITY = 950  # after Scrapy's own (retries and redirects come back through it)
SCHEDULER = "scrapy_redislock.StageScheduler"
WORKER_SCHEDULER = "scrapy_redislock.StageWorkerScheduler"


class Addon:
    """Enable the request front (see the module docstring)."""

    def update_settings(self, settings: BaseSettings) -> None:
        self._wrap_scheduler(settings)
        self._add_middleware(settings)

    @staticmethod
    def _wrap_scheduler(settings: BaseSettings) -> None:
        current = settings["SCHEDULER"]
        if _is(current, WORKER_SCHEDULER):
            raise ConfigError(
                f"scrapy_redislock.Addon enables the request front, but SCHEDULER = {inner_name(current)!r} is the worker front's: use one front (StageWorkerMixin sets its own scheduler; drop the add-on there)"  # noqa: E501
            )
        if _is(current, SCHEDULER):
            return  # set up by hand already: its REDISLOCK_SCHEDULER_INNER is the project's
        priority = settings.getpriority(INNER)  # None: the project did not set it
        inner = settings[INNER]
        if priority is not None and not _same(inner, current):
            raise ConfigError(
                f"scrapy_redislock.Addon wraps SCHEDULER = {inner_name(current)!r}, but REDISLOCK_SCHEDULER_INNER = {inner_name(inner)!r} names another: set only SCHEDULER (the add-on wraps it)"  # noqa: E501
            )
        scheduler_priority = settings.getpriority("SCHEDULER") or 0
        settings.set(INNER, current, priority=max(priority or 0, scheduler_priority))
        settings.set("SCHEDULER", SCHEDULER, priority=scheduler_priority)

    @staticmethod
    def _add_middleware(settings: BaseSettings) -> None:
        middlewares = settings.getdict("DOWNLOADER_MIDDLEWARES")
        if any(_is(name, MIDDLEWARE) for name in middlewares):
            return  # the project placed it itself
        middlewares[MIDDLEWARE] = MIDDLEWARE_PRIORITY
        settings.set(
            "DOWNLOADER_MIDDLEWARES",
            middlewares,
            priority=settings.getpriority("DOWNLOADER_MIDDLEWARES") or 0,
        )


def _loaded(value: Any) -> Any:
    try:
        return load_object(value) if isinstance(value, str) else value
    except (ImportError, ValueError, NameError, AttributeError):
        return value


def _is(value: Any, path: str) -> bool:
    """``value`` (a class or an import path) is the class ``path`` names, or a subclass of it (by
    its MRO: Scrapy's scheduler metaclass makes ``issubclass`` true of any class with the
    scheduler's methods)."""
    loaded, target = _loaded(value), _loaded(path)
    return isinstance(loaded, type) and target in loaded.__mro__


def _same(a: Any, b: Any) -> bool:
    return _loaded(a) is _loaded(b)
