"""A request's key (REDISLOCK_STAGE_KEY): the domain, Scrapy's download slot, or what a function
says.

A key is a stage met at run time: each key gets a lock of its own in Redis (``key:<key>``), created
on first use and removed once idle (:class:`~scrapy_redislock.crawl.keylocks.KeyLocks`). Reads no
settings itself:
:func:`key_function` turns the REDISLOCK_STAGE_KEY value into a function once, at start-up
(:mod:`scrapy_redislock.crawl.settings`), and :func:`key_of` calls it per request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from scrapy.utils.httpobj import urlparse_cached
from scrapy.utils.misc import load_object

from scrapy_redislock.crawl.stages import DONT_META
from scrapy_redislock.errors import ConfigError, KeyFunctionError

if TYPE_CHECKING:
    from scrapy import Request

KeyFunction = Callable[["Request", Any], Any]
KEY_MAX = 256  # characters: a key names a Redis key, and status shows it


def domain(request: Request, spider: Any = None) -> str | None:
    """The request's host name (None for URLs without one: data:, file:)."""
    return urlparse_cached(request).hostname or None


def download_slot(request: Request, spider: Any = None) -> str | None:
    """Scrapy's download slot key: ``meta["download_slot"]`` if set, else the host name."""
    slot = request.meta.get("download_slot")
    return str(slot) if slot is not None else domain(request, spider)


KINDS: dict[str, KeyFunction] = {"domain": domain, "download_slot": download_slot}


def key_function(value: Any, setting: str = "REDISLOCK_STAGE_KEY") -> KeyFunction | None:
    """The function behind a REDISLOCK_STAGE_KEY value: None, "domain", "download_slot", a dotted
    path to a function ``(request, spider) -> key or None``, or such a function; ConfigError naming
    the setting otherwise."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        if value in KINDS:
            return KINDS[value]
        if "." not in value:
            raise ConfigError(
                f"{setting} must be 'domain', 'download_slot' or the dotted path of a function (request, spider) -> key, got {value!r}"  # noqa: E501
            )
        try:
            value = load_object(value)
        # ImportError, ValueError, ... whatever importing the module raises
        except Exception as exc:
            raise ConfigError(f"{setting} cannot be loaded: {value!r} ({exc})") from None
    if not callable(value):
        raise ConfigError(
            f"{setting} must be a function (request, spider) -> key or None, got {value!r}"
        )
    return value


def key_of(request: Request, spider: Any, function: KeyFunction) -> str | None:
    """The request's key, or None (no key: no key cap, no key delay); KeyFunctionError for this
    request only."""
    try:
        key = function(request, spider)
    except Exception as exc:
        raise KeyFunctionError(
            f"REDISLOCK_STAGE_KEY function {_name(function)} raised {type(exc).__name__}: {exc} for {request.url}"
        ) from exc
    if key is None:
        return None
    if not isinstance(key, str) or not key or "{" in key or "}" in key or len(key) > KEY_MAX:
        raise KeyFunctionError(
            f"REDISLOCK_STAGE_KEY function {_name(function)} returned {key!r} for {request.url}: a key must be None or a non-empty string of at most {KEY_MAX} characters without braces"  # noqa: E501
        )
    return key


def request_key(request: Request, spider: Any, function: KeyFunction | None) -> str | None:
    """The request's key under REDISLOCK_STAGE_KEY (None: no function, or a request that opts out of
    throttling); KeyFunctionError as :func:`key_of`. The one place the scheduler and the key gate
    find a request's key."""
    if function is None or request.meta.get(DONT_META):
        return None
    return key_of(request, spider, function)


def _name(function: Any) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"
