"""Requests that a downloader middleware before StageLockMiddleware settles without a download need
no slot.

Shared by the middleware (which warns when a cache or robots.txt middleware runs after it) and
StageScheduler (which lets such requests go without waiting for a slot), so that neither imports the
other. The middleware is recognised by its class attribute ``redislock_takes_slots`` (and by its
import path in DOWNLOADER_MIDDLEWARES). Reads Scrapy's DOWNLOADER_MIDDLEWARES (with its base) only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scrapy.downloadermiddlewares.httpcache import HttpCacheMiddleware
from scrapy.downloadermiddlewares.robotstxt import RobotsTxtMiddleware
from scrapy.utils.httpobj import urlparse_cached
from scrapy.utils.misc import load_object

from scrapy_redislock.crawl.engine import downloader_middlewares

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler

MIDDLEWARE_PATH = "scrapy_redislock.StageLockMiddleware"
EARLY_TYPES = (HttpCacheMiddleware, RobotsTxtMiddleware)


def takes_slots(component: Any) -> bool:
    """True for StageLockMiddleware (its class or an instance)."""
    return getattr(component, "redislock_takes_slots", False) is True


def middleware_configured(crawler: Crawler) -> bool:
    """Whether DOWNLOADER_MIDDLEWARES enables StageLockMiddleware (under any import path)."""
    for path, order in crawler.settings.getwithbase("DOWNLOADER_MIDDLEWARES").items():
        if order is None:
            continue
        try:
            if takes_slots(load_object(path) if isinstance(path, str) else path):
                return True
        except (ImportError, ValueError, NameError, AttributeError):
            continue
    return False


def middlewares_after(crawler: Crawler, ours: Any) -> tuple[Any, ...]:
    chain = downloader_middlewares(crawler)
    return chain[chain.index(ours) + 1 :] if ours in chain else ()


def early_middlewares(crawler: Crawler) -> tuple[Any, ...]:
    """The HttpCacheMiddleware and RobotsTxtMiddleware instances that see a request before
    StageLockMiddleware."""
    chain = downloader_middlewares(crawler)
    ours = next((i for i, mw in enumerate(chain) if takes_slots(mw)), len(chain))
    return tuple(mw for mw in chain[:ours] if isinstance(mw, EARLY_TYPES))


def settled_before_download(
    request: Request,
    middlewares: tuple[Any, ...],
    spider: Any,
    *,
    cache: bool = True,
    unknown: bool = True,
) -> bool:
    """True when one of ``middlewares`` (see :func:`early_middlewares`) will answer or drop the
    request without a download, so it needs no slot: a fresh cache hit, a cache miss with
    HTTPCACHE_IGNORE_MISSING (unless not ``cache``), a URL that robots.txt forbids, or a host whose
    robots.txt is not known yet (if ``unknown``: RobotsTxtMiddleware decides first; a request it
    lets through then waits for its slot in StageLockMiddleware). Reads the cache the way
    HttpCacheMiddleware does (one more read of the entry).
    """
    for mw in middlewares:
        if isinstance(mw, HttpCacheMiddleware):
            if cache and _cache_settles(mw, request, spider):
                return True
        elif _robots_settles(mw, request, unknown):
            return True
    return False


def robots_unknown(request: Request, middlewares: tuple[Any, ...]) -> bool:
    """Whether a RobotsTxtMiddleware among ``middlewares`` has not read the robots.txt of the
    request's host yet (not fetched, or being fetched): its Crawl-delay is not known."""
    if request.meta.get("dont_obey_robotstxt") or request.url.startswith(("data:", "file:")):
        return False
    for mw in middlewares:
        parsers = getattr(mw, "_parsers", None)
        if isinstance(mw, HttpCacheMiddleware) or parsers is None:
            continue
        parser = parsers.get(urlparse_cached(request).netloc, _UNKNOWN)
        return parser is not None and (parser is _UNKNOWN or not hasattr(parser, "allowed"))
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


def _robots_settles(mw: Any, request: Request, unknown: bool) -> bool:
    if request.meta.get("dont_obey_robotstxt") or request.url.startswith(("data:", "file:")):
        return False
    parsers = getattr(mw, "_parsers", None)
    if parsers is None:  # a future Scrapy: wait for a slot as before, correct if not free
        return False
    parser = parsers.get(urlparse_cached(request).netloc, _UNKNOWN)
    if parser is None:  # robots.txt could not be fetched: everything is allowed
        return False
    if parser is _UNKNOWN or not hasattr(parser, "allowed"):  # not fetched yet, or being fetched
        return unknown
    agent = getattr(mw, "_robotstxt_useragent", None) or request.headers.get(
        b"User-Agent", getattr(mw, "_default_useragent", None)
    )
    return not parser.allowed(request.url, agent)


_UNKNOWN = object()
