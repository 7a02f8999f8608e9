"""A request's key (REDISLOCK_STAGE_KEY): the domain, Scrapy's download slot, or what a function
says.

A key is a stage met at run time: each key gets a lock of its own in Redis (``key:<key>``), created
on first use and removed once idle (:class:`~scrapy_redislock.crawl.keylocks.KeyLocks`). Reads no
settings itself:
:func:`key_function` turns the REDISLOCK_STAGE_KEY value into a function once, at start-up
(:mod:`scrapy_redislock.crawl.settings`), and :func:`request_key` calls it per request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

from scrapy.utils.httpobj import urlparse_cached
from scrapy.utils.misc import load_object

from scrapy_redislock.crawl.stages import DONT_META
from scrapy_redislock.errors import ConfigError, KeyFunctionError

if TYPE_CHECKING:
    from scrapy import Request

KeyFunction = Callable[["Request", Any], Any]
F = TypeVar("F", bound=Callable[..., Any])
KEY_MAX = 256  # characters: a key names a Redis key, and status shows it


def domain(request: Request, spider: Any = None) -> str | None:
    """The request's host name (None for URLs without one: data:, file:)."""
    return urlparse_cached(request).hostname or None


def download_slot(request: Request, spider: Any = None) -> str | None:
    """Scrapy's download slot key: ``meta["download_slot"]`` if set, else the host name."""
    slot = request.meta.get("download_slot")
    return str(slot) if slot is not None else domain(request, spider)


KINDS: dict[str, KeyFunction] = {"domain": domain, "download_slot": download_slot}


def key_function(
    value: Any, setting: str = "REDISLOCK_STAGE_KEY", optional: bool = False
) -> KeyFunction | None:
    """The function behind a REDISLOCK_STAGE_KEY value: None, "domain", "download_slot", a dotted
    path to a function ``(request, spider) -> key or None``, or such a function; ConfigError naming
    the setting otherwise. Its parser in :mod:`~scrapy_redislock.crawl.settings`."""
    return load_function(value, setting, KINDS, "key", "key or None")


def load_function(
    value: Any, setting: str, kinds: Mapping[str, F], returns: str, may_return: str
) -> F | None:
    """The function a setting names (REDISLOCK_STAGE_KEY, REDISLOCK_SCOPES_OF): None, one of
    ``kinds`` by name, a dotted path to a function ``(request, spider) -> returns``, or such a
    function; ConfigError naming the setting otherwise."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        if value in kinds:
            return kinds[value]
        if "." not in value:
            named = ", ".join(repr(kind) for kind in kinds)
            raise ConfigError(
                f"{setting} must be {named} or the dotted path of a function (request, spider) -> {returns}, got {value!r}"  # noqa: E501
            )
        try:
            value = load_object(value)
        # ImportError, ValueError, ... whatever importing the module raises
        except Exception as exc:
            raise ConfigError(f"{setting} cannot be loaded: {value!r} ({exc})") from None
    if not callable(value):
        raise ConfigError(
            f"{setting} must be a function (request, spider) -> {may_return}, got {value!r}"
        )
    return cast("F", value)


def is_key_name(name: Any) -> bool:
    """A key or scope name: a non-empty string of at most KEY_MAX characters without braces (it
    names Redis keys inside a hash tag, and status shows it)."""
    return (
        isinstance(name, str)
        and bool(name)
        and "{" not in name
        and "}" not in name
        and len(name) <= KEY_MAX
    )


def request_key(request: Request, spider: Any, function: KeyFunction | None) -> str | None:
    """The request's key under REDISLOCK_STAGE_KEY, or None (no function, a request that opts out of
    throttling, or none from the function: no key cap, no key delay); KeyFunctionError for this
    request only. The one place the scheduler and the throttle find a request's key."""
    if function is None or request.meta.get(DONT_META):
        return None
    try:
        key = function(request, spider)
    except Exception as exc:
        raise KeyFunctionError(
            f"REDISLOCK_STAGE_KEY function {function_name(function)} raised {type(exc).__name__}: {exc} for {request.url}"  # noqa: E501
        ) from exc
    if key is None:
        return None
    if not is_key_name(key):
        raise KeyFunctionError(
            f"REDISLOCK_STAGE_KEY function {function_name(function)} returned {key!r} for {request.url}: a key must be None or a non-empty string of at most {KEY_MAX} characters without braces"  # noqa: E501
        )
    return key


def function_name(function: Any) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"
