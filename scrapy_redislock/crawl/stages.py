"""Which stage a request belongs to: meta, callback decorator, callback mapping, default.

:func:`check_stage_names` checks at start what can be known before any request: the ``@stage``
callbacks of the spider class, REDISLOCK_CALLBACK_STAGES and REDISLOCK_DEFAULT_STAGE against the
stages of one front.

Reads no settings itself; the checked settings are passed in (their REDISLOCK_CALLBACK_STAGES and
REDISLOCK_DEFAULT_STAGE).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import urlsplit

from scrapy_redislock._redis import check_name
from scrapy_redislock.errors import ConfigError

if TYPE_CHECKING:
    from scrapy import Request


STAGE_META = "redislock_stage"
DONT_META = "dont_redislock"
STAGE_ATTRIBUTE = "__redislock_stage__"

F = TypeVar("F", bound=Callable[..., Any])


class StageSettings(Protocol):
    """What a stage is read from (the checked settings have it): a protocol, so that this module
    imports nothing of the settings module, which imports it."""

    @property
    def default_stage(self) -> str | None: ...

    @property
    def callback_stages(self) -> Mapping[str, str]: ...


def stage(name: str) -> Callable[[F], F]:
    """Give every request whose callback is the decorated method this stage.

    ``@stage("detail")`` on ``parse_detail`` saves writing ``meta={"redislock_stage": "detail"}``
    on each request; meta still wins when both are set.
    """
    check_name(name, "stage")

    def mark(callback: F) -> F:
        setattr(callback, STAGE_ATTRIBUTE, name)
        return callback

    return mark


def stage_of(request: Request, settings: StageSettings, spider: Any = None) -> str | None:
    """The request's stage, or None when it is not throttled.

    robots.txt downloads are never throttled: RobotsTxtMiddleware holds capped requests until
    robots.txt arrives, so a robots.txt waiting for their stage's slot would wait forever.
    """
    if request.meta.get(DONT_META) or _is_robots_txt(request):
        return None
    name = request.meta.get(STAGE_META)
    if name is None:
        callback = effective_callback(request, spider)
        name = getattr(callback, STAGE_ATTRIBUTE, None)
        if name is None and callback is not None:
            name = settings.callback_stages.get(
                callback if isinstance(callback, str) else _name_of(callback)
            )
    if name is None:
        name = settings.default_stage
    return name


def effective_callback(request: Request, spider: Any) -> Any:
    """The spider method that will get the request's response, as Scrapy will call it.

    - no callback: the spider's default, ``_parse``, which is ``parse`` for a Spider,
      ``parse_start_url`` for a CrawlSpider, ``parse_node`` for an XMLFeedSpider, ``parse_row`` for
      a CSVFeedSpider;
    - a CrawlSpider rule's request (callback ``_callback``, meta ``rule``): the rule's callback
      (None for a rule that only follows links);
    - a callback given as a method name (Rule and sitemap_rules take names; a deserialized request
      may keep one): the spider's method of that name, or the name itself when the spider has none.
    """
    callback: Any = request.callback
    if callback is None:
        return _default_callback(spider)
    if isinstance(callback, str):
        return getattr(spider, callback, callback)
    if _name_of(callback) == "_callback" and "rule" in request.meta:
        # CrawlSpider's compiled rules; anything else fails below
        rules: Any = getattr(spider, "_rules", None)
        try:
            return rules[request.meta["rule"]].callback
        except (TypeError, IndexError, KeyError, AttributeError):
            return callback
    return callback


def _default_callback(spider: Any) -> Any:
    if spider is None:
        return "parse"
    # Scrapy only when a crawl asks
    from scrapy.spiders import CrawlSpider, CSVFeedSpider, XMLFeedSpider

    for kind, method in (
        (CrawlSpider, "parse_start_url"),
        (XMLFeedSpider, "parse_node"),
        (CSVFeedSpider, "parse_row"),
    ):
        if isinstance(spider, kind):
            return getattr(spider, method, None)
    return getattr(spider, "parse", None)


def _name_of(callback: Any) -> str:
    return str(getattr(callback, "__name__", ""))


def _is_robots_txt(request: Request) -> bool:
    return (
        bool(request.meta.get("dont_obey_robotstxt"))
        and urlsplit(request.url).path == "/robots.txt"
    )


# -- the stage names a crawl can be checked for at start -------------------------------------------


def unknown_stage(what: str, stage: str, known: Collection[str], setting: str) -> ConfigError:
    """The ConfigError for a stage name ``what`` gives that ``setting`` does not configure, naming
    the closest configured stage (as the setting-name check does)."""
    closest = difflib.get_close_matches(stage, sorted(known), n=1, cutoff=0.0)
    hint = f" (did you mean {closest[0]!r}?)" if closest else ""
    configured = ", ".join(repr(s) for s in sorted(known)) or "none"
    return ConfigError(
        f"{what} names stage {stage!r}, which is not in {setting}{hint}; configured: {configured}"
    )


def decorated_callbacks(spidercls: type) -> dict[str, str]:
    """``{method name: stage}`` of the spider class's methods marked ``@stage(...)`` (the ones its
    instances have: a subclass that overrides a method without the decorator unmarks it)."""
    found: dict[str, str] = {}
    for name in sorted({name for klass in inspect.getmro(spidercls) for name in vars(klass)}):
        try:
            member = inspect.getattr_static(spidercls, name)
        except AttributeError:
            continue
        function = getattr(member, "__func__", member)  # staticmethod, classmethod
        try:
            marked = getattr(function, STAGE_ATTRIBUTE, None)
        # an object whose __getattr__ raises something odd: not a callback of ours
        except Exception:
            continue
        if isinstance(marked, str):
            found[name] = marked
    return found


def check_stage_names(
    spidercls: type, settings: StageSettings, stages: Collection[str], setting: str
) -> None:
    """ConfigError when a stage name known before any request is not one of ``stages`` (``setting``:
    REDISLOCK_STAGES for the request front, REDISLOCK_WORKER_STAGES for the worker front): a
    ``@stage`` callback of the spider class, REDISLOCK_CALLBACK_STAGES, REDISLOCK_DEFAULT_STAGE. The
    message names the stage, the callback (or the setting) and the closest configured stage. Stages
    named in ``meta`` are only known per request."""
    spider = getattr(spidercls, "__name__", str(spidercls))
    for name, stage_name in decorated_callbacks(spidercls).items():
        if stage_name not in stages:
            raise unknown_stage(f"callback {spider}.{name} (@stage)", stage_name, stages, setting)
    for callback, stage_name in sorted(settings.callback_stages.items()):
        if stage_name not in stages:
            raise unknown_stage(
                f"REDISLOCK_CALLBACK_STAGES[{callback!r}]", stage_name, stages, setting
            )
    if settings.default_stage is not None and settings.default_stage not in stages:
        raise unknown_stage("REDISLOCK_DEFAULT_STAGE", settings.default_stage, stages, setting)
