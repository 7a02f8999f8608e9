"""REDISLOCK_SCHEDULER_INNER, the scheduler StageScheduler wraps: taken as Scrapy takes SCHEDULER.

A class object, or the import path of one (``"scrapy.core.scheduler.Scheduler"``), loaded with
Scrapy's own ``load_object`` (so a class defined anywhere, even one not importable by its qualified
name, works when given as the object), then checked against the interface Scrapy's engine checks
SCHEDULER against: ``issubclass(cls, BaseScheduler)``, whose metaclass asks for callable
``has_pending_requests``, ``enqueue_request`` and ``next_request`` (``open`` and ``close`` are
optional, as for the engine). A value that fails any of this is a
:class:`~scrapy_redislock.errors.ConfigError` naming REDISLOCK_SCHEDULER_INNER and the value.

:func:`check_inner_scheduler` is what :func:`~scrapy_redislock.crawl.settings.read_settings` checks
without importing anything (a class is checked in full, a path only for its form);
:func:`load_inner_scheduler` imports a path and checks the class, at StageScheduler's start.
"""

from __future__ import annotations

from typing import Any

from scrapy.core.scheduler import BaseScheduler
from scrapy.utils.misc import load_object

from scrapy_redislock.errors import ConfigError

SETTING = "REDISLOCK_SCHEDULER_INNER"
# What Scrapy's BaseScheduler metaclass asks of a scheduler class (scrapy/core/scheduler.py), named
# in messages.
REQUIRED_METHODS = ("has_pending_requests", "enqueue_request", "next_request")


def inner_name(value: Any) -> str:
    """The value as one would write it in the settings: the import path as given, or a class's
    dotted name."""
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return str(value)


def check_inner_scheduler(value: Any) -> str | type:
    """The setting's value if it can be a scheduler: a class with the scheduler interface, or a
    dotted import path (imported later, by :func:`load_inner_scheduler`); ConfigError naming the
    setting and the value otherwise."""
    if isinstance(value, type):
        return _checked(value, value)
    parts = value.split(".") if isinstance(value, str) else []
    if len(parts) < 2 or not all(part and part == "".join(part.split()) for part in parts):
        raise ConfigError(
            f"{SETTING} must be a scheduler class or its import path (like SCHEDULER, e.g. 'scrapy.core.scheduler.Scheduler'), got {value!r}"  # noqa: E501
        )
    return value


def load_inner_scheduler(value: Any, outer: type | None = None) -> type:
    """The scheduler class ``value`` names (a class, or its import path), checked as Scrapy checks
    SCHEDULER.

    ``outer``: the wrapping scheduler's class (StageScheduler), refused as its own inner scheduler
    (it and its subclasses). ConfigError naming REDISLOCK_SCHEDULER_INNER and the value when it
    cannot be loaded or lacks the interface."""
    check_inner_scheduler(value)
    try:
        loaded = load_object(value)
    except (ImportError, ValueError, NameError, AttributeError, TypeError) as exc:
        raise ConfigError(f"{SETTING} cannot be loaded: {inner_name(value)!r} ({exc})") from None
    cls = _checked(loaded, value)
    if outer is not None and issubclass(cls, outer):
        raise ConfigError(
            f"{SETTING} = {inner_name(value)!r} is {outer.__name__} itself, which wraps the inner scheduler: name the scheduler it should wrap (e.g. 'scrapy.core.scheduler.Scheduler')"  # noqa: E501
        )
    return cls


def _checked(loaded: Any, value: Any) -> type:
    """``loaded`` if it is a class with the scheduler interface (Scrapy's ``issubclass(cls,
    BaseScheduler)``)."""
    if not isinstance(loaded, type):
        raise ConfigError(
            f"{SETTING} must name a scheduler class, got {inner_name(value)!r}: a {type(loaded).__name__}"
        )
    missing = [name for name in REQUIRED_METHODS if not callable(getattr(loaded, name, None))]
    if missing or not issubclass(loaded, BaseScheduler):
        lacks = f" (it lacks {', '.join(missing)})" if missing else ""
        raise ConfigError(
            f"{SETTING} = {inner_name(value)!r} is not a scheduler class{lacks}: Scrapy's scheduler interface (scrapy.core.scheduler.BaseScheduler) needs callable {', '.join(REQUIRED_METHODS)}"  # noqa: E501
        )
    return loaded
