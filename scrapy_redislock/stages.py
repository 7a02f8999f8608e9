"""Which stage a request belongs to: meta, callback decorator, callback mapping, default.

Reads no settings itself; :class:`scrapy_redislock.config.RedisLockSettings` is passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from scrapy_redislock.core import check_name

if TYPE_CHECKING:
    from scrapy import Request

    from scrapy_redislock.config import RedisLockSettings

STAGE_META = "redislock_stage"
DONT_META = "dont_redislock"
STAGE_ATTRIBUTE = "__redislock_stage__"

F = TypeVar("F", bound=Callable[..., Any])


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


def stage_of(request: Request, settings: RedisLockSettings, spider: Any = None) -> str | None:
    """The request's stage, or None when it is not throttled.

    robots.txt downloads are never throttled: RobotsTxtMiddleware holds capped requests until robots.txt
    arrives, so a robots.txt waiting for their stage's slot would wait forever.
    """
    if request.meta.get(DONT_META) or _is_robots_txt(request):
        return None
    name = request.meta.get(STAGE_META)
    if name is None:
        callback = request.callback
        if callback is None and spider is not None:
            callback = getattr(spider, "parse", None)  # Scrapy's default callback
        name = getattr(callback, STAGE_ATTRIBUTE, None)
        if name is None:
            callback_name = "parse" if callback is None else getattr(callback, "__name__", "")
            name = settings.callback_stages.get(callback_name)
    if name is None:
        name = settings.default_stage
    return name


def _is_robots_txt(request: Request) -> bool:
    return bool(request.meta.get("dont_obey_robotstxt")) and urlsplit(request.url).path == "/robots.txt"
