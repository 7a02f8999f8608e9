"""A test spider and test components, run with ``scrapy runspider`` by :mod:`testing.crawlproc`.

``-a plan=detail:300,comments:300`` yields that many requests per stage, in that order, to ``-a
base=http://127.0.0.1:PORT/<stage>/<n>``. An entry may carry a query: ``detail:2:sleep=5`` (the test
site sleeps that long), ``detail:2:drop=late`` (see :class:`LateOutcomes`); ``detail@slow:2`` puts
requests of stage ``detail`` at ``/slow/<n>`` (the site counts them apart). A stage named ``free``
gets ``dont_redislock``. ``-a via=meta`` (default) names the stage in meta; ``via=decorator`` and
``via=callback`` leave meta alone and use the callback's ``@stage`` or REDISLOCK_CALLBACK_STAGES
(callback ``parse_<stage>``). ``-a direct=N``: the first response also downloads N ``detail`` pages
with ``engine.download_async`` (as media pipelines do), bypassing the scheduler. ``-a hosts=N``
spreads the requests over N host names, request ``n`` of each plan entry to 127.0.0.<1 + n % N>
(base's port; see :class:`testing.site.CrawlSite`'s ``hosts``); ``-a first=K`` numbers the pages
from K (processes sharing the pages of one stage without fetching any twice). ``-a follow=STAGE``: each
response of another stage yields one request of STAGE (``/<STAGE>/<n>``, the same n), through the
dupefilter (the start requests have ``dont_filter``). ``-a scopes=proxy:p1,render`` puts those scopes in
every start request's ``meta["redislock_scopes"]``. ``-a unqueueable=3,7``: the requests followed
from pages 3 and 7 carry meta that no serializer can write (a lock), which scrapy-redis refuses.
:func:`path_key` and :func:`failing_key` are REDISLOCK_STAGE_KEY functions for the key tests,
:func:`host_scope` a REDISLOCK_SCOPES_OF function.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import redis.asyncio
import scrapy
from scrapy import signals
from scrapy.exceptions import IgnoreRequest
from scrapy.http import HtmlResponse
from twisted.internet import task

from scrapy_redislock import stage
from scrapy_redislock.crawl.connection import parse_url


class PlanSpider(scrapy.Spider):
    name = "plan"

    def __init__(
        self,
        base: str = "",
        plan: str = "",
        direct: str = "0",
        via: str = "meta",
        hosts: str = "1",
        first: str = "0",
        follow: str = "",
        scopes: str = "",
        unqueueable: str = "",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.hosts = int(hosts)
        self.first = int(first)
        self.follow = follow
        # pages whose followed request carries meta scrapy-redis's serializer cannot write
        self.unqueueable = {int(n) for n in unqueueable.split(",") if n}
        self.scopes = [scope for scope in scopes.split(",") if scope]
        self.direct = int(direct)
        self.base = base
        self.via = via
        self.plan: list[tuple[str, int, str]] = []
        for part in plan.split(","):
            if part:
                name, count, *query = part.split(":")
                self.plan.append((name, int(count), query[0] if query else ""))

    async def start(self) -> AsyncIterator[scrapy.Request]:
        for entry, count, query in self.plan:
            name, _, path = entry.partition("@")  # "detail@slow": stage detail, pages /slow/<n>
            suffix = f"?{query}" if query else ""
            for n in range(self.first, self.first + count):
                meta: dict[str, Any] = {}
                if self.scopes:
                    meta["redislock_scopes"] = self.scopes
                callback = self.parse
                if name == "free":
                    meta["dont_redislock"] = True
                elif self.via == "meta":
                    meta["redislock_stage"] = name
                else:
                    callback = getattr(self, f"parse_{name}", self.parse)
                base = self.base
                if self.hosts > 1:
                    base = base.replace("127.0.0.1", f"127.0.0.{1 + n % self.hosts}", 1)
                url = f"{base}/{path or name}/{n}{suffix}"
                yield scrapy.Request(
                    url, meta=meta, callback=callback, errback=self.failed, dont_filter=True
                )
        self.logger.info("Start requests: all yielded")

    async def parse(self, response: scrapy.http.Response) -> AsyncIterator[Any]:
        if self.follow and f"/{self.follow}/" not in response.url:
            n = urlsplit(response.url).path.rsplit("/", 1)[-1]
            meta: dict[str, Any] = {"redislock_stage": self.follow}
            if n.isdigit() and int(n) in self.unqueueable:
                meta["test_unpicklable"] = threading.Lock()
            yield scrapy.Request(
                f"{self.base}/{self.follow}/{n}",
                meta=meta,
                callback=self.parse,
                errback=self.failed,
            )
        while self.direct > 0:
            self.direct -= 1
            request = scrapy.Request(
                f"{self.base}/direct/{self.direct}", meta={"redislock_stage": "detail"}
            )
            await self.crawler.engine.download_async(request)
        yield {"url": response.url}

    @stage("detail")
    async def parse_detail(self, response: scrapy.http.Response) -> AsyncIterator[dict[str, str]]:
        yield {"url": response.url}

    async def parse_list(self, response: scrapy.http.Response) -> AsyncIterator[dict[str, str]]:
        # no decorator: REDISLOCK_CALLBACK_STAGES = {"parse_list": "list"}
        yield {"url": response.url}

    def failed(self, failure: Any) -> None:
        self.crawler.stats.inc_value(f"test/errback/{type(failure.value).__name__}")
        self.logger.warning("errback: %s: %s", type(failure.value).__name__, failure.value)


def path_key(request: scrapy.Request, spider: Any) -> str | None:
    """A key per page number: ``/detail/7`` -> ``page-7`` (many keys, each used once)."""
    return "page-" + urlsplit(request.url).path.rsplit("/", 1)[-1]


def host_scope(request: scrapy.Request, spider: Any) -> list[str]:
    """A REDISLOCK_SCOPES_OF function: the scope ``via:<host>`` (as a proxy per host would be)."""
    return [f"via:{urlsplit(request.url).hostname}"]


def failing_key(request: scrapy.Request, spider: Any) -> str | None:
    """The host name, but raises for pages under ``/bad/`` (a key function's bug hits only those
    requests)."""
    if "/bad/" in request.url:
        raise RuntimeError("no key for this one")
    return urlsplit(request.url).hostname


class BookedStartHeader:
    """After StageLockMiddleware (order > 950): tells the site the start a delayed request had
    confirmed, so that the site can check that no request reaches it before that moment
    (:data:`testing.site.BOOKED_HEADER`)."""

    def process_request(self, request: scrapy.Request, spider: scrapy.Spider | None = None) -> None:
        start = request.meta.get("redislock_start_at")
        if start is not None:
            request.headers["X-Booked-Start"] = repr(start)
        starts = request.meta.get("redislock_starts")
        if starts:
            request.headers["X-Starts"] = json.dumps(starts)


class LoopStall:
    """Blocks the process's event loop for ``TEST_LOOP_STALL = (seconds, every)``: a wake-up due
    meanwhile comes late, as under CPU load (the delay's confirmation must hold the next start
    back)."""

    def __init__(self, crawler: Any) -> None:
        self.seconds, self.every = crawler.settings.getlist("TEST_LOOP_STALL") or (0, 0)
        self.call = task.LoopingCall(time.sleep, float(self.seconds))
        crawler.signals.connect(self.opened, signal=signals.spider_opened)
        crawler.signals.connect(self.closed, signal=signals.spider_closed)

    @classmethod
    def from_crawler(cls, crawler: Any) -> LoopStall:
        return cls(crawler)

    def opened(self) -> None:
        if float(self.every) > 0:
            self.call.start(float(self.every), now=False)

    def closed(self) -> None:
        if self.call.running:
            self.call.stop()


class Outcomes:
    """Answers (``answer=<where>``) or drops (``drop=<where>``) requests whose query says so, for
    release tests."""

    where = ""

    def process_request(
        self, request: scrapy.Request, spider: scrapy.Spider | None = None
    ) -> HtmlResponse | None:
        query = parse_qs(urlsplit(request.url).query)
        if query.get("drop") == [self.where]:
            raise IgnoreRequest(f"dropped by the {self.where} test middleware")
        if query.get("answer") == [self.where]:
            return HtmlResponse(request.url, body=b"<html>answered</html>", request=request)
        return None


class EarlyOutcomes(Outcomes):
    """Before StageLockMiddleware (order < 950), like a cache or robots.txt: it never sees these
    requests."""

    where = "early"


class LateOutcomes(Outcomes):
    """After StageLockMiddleware (order > 950): the request holds a slot when it is answered or
    dropped."""

    where = "late"


class StatsFile:
    """Writes the crawl's stats as JSON to the STATS_JSON setting's path: at spider_closed, and
    again when the engine has stopped, after the spider_closed handlers (ours included) have all
    finished.

    At engine stop it also records ``test/pending_at_engine_stop``: grants still held in Redis under
    the crawl's key prefix (by any process), which StageLocks.close() must have freed by then.
    """

    def __init__(self, crawler: Any) -> None:
        self.crawler = crawler
        self.path = crawler.settings.get("STATS_JSON")
        crawler.signals.connect(self.write, signal=signals.spider_closed)
        crawler.signals.connect(self.engine_stopped, signal=signals.engine_stopped)

    @classmethod
    def from_crawler(cls, crawler: Any) -> StatsFile:
        return cls(crawler)

    def write(self) -> None:
        if self.path:
            with open(self.path, "w", encoding="utf-8") as out:
                json.dump(self.crawler.stats.get_stats(), out, default=str)

    async def engine_stopped(self) -> None:
        url = self.crawler.settings.get("REDISLOCK_URL") or self.crawler.settings.get("REDIS_URL")
        prefix = self.crawler.settings.get("REDISLOCK_KEY_PREFIX", "redislock")
        client = (
            parse_url(url, "REDISLOCK_URL").async_client(socket_connect_timeout=2) if url else None
        )
        try:
            if client is not None:
                pending = 0
                async for key in client.scan_iter(f"{prefix}:*:slots"):
                    pending += int((await client.xpending(key, "holders"))["pending"])
                self.crawler.stats.set_value("test/pending_at_engine_stop", pending)
        except (redis.RedisError, redis.exceptions.RedisClusterException):
            pass  # Redis is unreachable in this test: nothing to count
        finally:
            if client is not None:
                await client.aclose()
            self.write()
