"""A mixed-priority crawl and two probes, for StageScheduler's drop-in figures (``bench/dropin.py``,
``tests/requests/test_shared_queue.py``).

:class:`MixedSpider` (``scrapy runspider``, ``-a base=<site>``): ``-a lists=L`` list pages (stage
``list``, priority 0), each yielding ``-a details=D`` detail pages (stage ``detail``) and ``-a
comments=C`` comment pages (stage ``comments``, left uncapped by the caller) of priorities spread
over -5..5, and, from every ``-a urgent=U``-th list page, one request of priority 100
(``/urgent/<i>``, alternately of stage ``detail`` and ``comments``): what a crawl yields mid-way
when something must go next. Every URL is unique; the stage is in meta.

:class:`OrderLog` (extension and downloader middleware at order 1, ``ORDER_JSON`` = the output
path): records, per request, when it was queued (``request_scheduled``), when it left the scheduler
(the first downloader middleware sees it at once: ``Downloader.fetch`` runs the chain right after
``next_request``) and when it reached the downloader (``request_reached_downloader``: after every
middleware, so after the wait for a slot). Written as JSON at ``spider_closed``.

:class:`HeldProbe` (extension and downloader middleware at order 1, ``HELD_PROBE_FILE`` = the output
path): what this process holds out of the scheduler, as JSON lines, written and flushed as they come
(a process killed with SIGKILL leaves every line but the one being written): ``{"opened": t}`` at
``spider_opened``, then a sample at every request leaving the scheduler (right after the pop: the
peaks) and every ``HELD_PROBE_INTERVAL`` s (default 0.05): ``popped`` (the scheduler's
``scheduler/dequeued/redis`` stat, ``scheduler/dequeued`` over Scrapy's own: taken from the queue),
``reached`` (``request_reached_downloader``: past every middleware, so holding a slot when capped),
``left`` (``request_left_downloader``: done) and ``active`` (``len(downloader.active)``). Held =
popped - left; waiting for a slot (or on its way through the middlewares) = popped - reached. Times
are ``time.monotonic()``, the clock of :class:`testing.site.CrawlSite` (one clock for every process
of a machine).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO, Any

import scrapy
from scrapy import signals


class MixedSpider(scrapy.Spider):
    name = "mixed"

    def __init__(
        self,
        base: str = "",
        lists: str = "12",
        details: str = "12",
        comments: str = "4",
        urgent: str = "3",
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.base = base
        self.lists, self.details, self.comments, self.urgent = (
            int(lists),
            int(details),
            int(comments),
            int(urgent),
        )

    async def start(self) -> AsyncIterator[scrapy.Request]:
        for i in range(self.lists):
            yield self.request(f"/list/{i}", "list", 0, self.parse_list)

    def request(self, path: str, stage: str, priority: int, callback: Any = None) -> scrapy.Request:
        meta = {"redislock_stage": stage}
        return scrapy.Request(
            self.base + path, meta=meta, priority=priority, callback=callback or self.parse_leaf
        )

    def parse_list(self, response: scrapy.http.Response) -> Iterator[scrapy.Request]:
        i = int(response.url.rsplit("/", 1)[1])
        for j in range(self.details):
            yield self.request(f"/detail/{i}-{j}", "detail", (7 * j + 3 * i) % 11 - 5)
            if j < self.comments:
                yield self.request(f"/comments/{i}-{j}", "comments", (5 * j + 2 * i) % 11 - 5)
        if self.urgent and i % self.urgent == self.urgent - 1:
            stage = "detail" if (i // self.urgent) % 2 == 0 else "comments"
            yield self.request(f"/urgent/{i}", stage, 100)

    def parse_leaf(self, response: scrapy.http.Response) -> Iterator[dict[str, str]]:
        yield {"url": response.url}


def on_pop(crawler: Any, callback: Any) -> None:
    """Call ``callback(request or None)`` each time the engine takes a request from the scheduler
    (in the ``next_request`` call itself: the moment it leaves). Wraps the scheduler's
    ``next_request``; from ``spider_opened``, when the engine has built its scheduler."""
    scheduler = crawler.engine._slot.scheduler
    inner = scheduler.next_request

    def next_request() -> Any:
        request = inner()
        callback(request)
        return request

    scheduler.next_request = next_request


class OrderLog:
    """The order requests are queued, leave the scheduler and reach the downloader (see the module's
    docstring)."""

    def __init__(self, crawler: Any) -> None:
        self.crawler = crawler
        self.path = crawler.settings.get("ORDER_JSON")
        self.records: dict[str, dict[str, Any]] = {}
        self.counts = {"queued": 0, "left": 0, "reached": 0}
        # (instant, URL or None, requests active) per ask
        self.asks: list[tuple[float, str | None, int]] = []
        crawler.signals.connect(self.opened, signal=signals.spider_opened)
        crawler.signals.connect(self.queued, signal=signals.request_scheduled)
        crawler.signals.connect(self.reached, signal=signals.request_reached_downloader)
        crawler.signals.connect(self.write, signal=signals.spider_closed)

    @classmethod
    def from_crawler(cls, crawler: Any) -> OrderLog:
        return cls(crawler)

    def opened(self) -> None:
        on_pop(self.crawler, self.left)

    def _mark(self, request: scrapy.Request, what: str) -> None:
        record = self.records.setdefault(
            request.url,
            {
                "url": request.url,
                "priority": request.priority,
                "stage": request.meta.get("redislock_stage"),
            },
        )
        if what not in record:
            record[what] = self.counts[what]
            record[f"{what}_at"] = time.monotonic()
            self.counts[what] += 1

    def queued(self, request: scrapy.Request) -> None:
        self._mark(request, "queued")

    def left(self, request: scrapy.Request | None) -> None:
        self.asks.append(
            (
                time.monotonic(),
                None if request is None else request.url,
                len(self.crawler.engine.downloader.active),
            )
        )
        if request is not None:
            self._mark(request, "left")

    def reached(self, request: scrapy.Request) -> None:
        self._mark(request, "reached")

    def write(self) -> None:
        if self.path:
            with open(self.path, "w", encoding="utf-8") as out:
                json.dump({"records": list(self.records.values()), "asks": self.asks}, out)


class HeldProbe:
    """What this process holds out of the scheduler, sampled (see the module's docstring)."""

    def __init__(self, crawler: Any) -> None:
        self.crawler = crawler
        self.path = crawler.settings.get("HELD_PROBE_FILE")
        self.interval = crawler.settings.getfloat("HELD_PROBE_INTERVAL", 0.05)
        self.out: IO[str] | None = open(self.path, "a", encoding="utf-8") if self.path else None  # noqa: SIM115
        self.reached_n = 0
        self.left_n = 0
        self.task: asyncio.Task[None] | None = None
        crawler.signals.connect(self.opened, signal=signals.spider_opened)
        crawler.signals.connect(self.on_reached, signal=signals.request_reached_downloader)
        crawler.signals.connect(self.on_left, signal=signals.request_left_downloader)
        crawler.signals.connect(self.closed, signal=signals.spider_closed)

    @classmethod
    def from_crawler(cls, crawler: Any) -> HeldProbe:
        return cls(crawler)

    def _line(self, data: dict[str, Any]) -> None:
        if self.out is not None:
            self.out.write(json.dumps(data) + "\n")
            self.out.flush()

    def sample(self) -> None:
        stats = self.crawler.stats
        popped = stats.get_value("scheduler/dequeued/redis")
        if popped is None:
            popped = stats.get_value("scheduler/dequeued", 0)
        engine = self.crawler.engine
        active = len(engine.downloader.active) if engine is not None else 0
        self._line(
            {
                "t": time.monotonic(),
                "popped": popped,
                "reached": self.reached_n,
                "left": self.left_n,
                "active": active,
            }
        )

    def opened(self) -> None:
        self._line({"opened": time.monotonic()})
        on_pop(self.crawler, self.popped)
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval)

    def popped(self, request: scrapy.Request | None) -> None:
        if request is not None:
            self.sample()  # just taken from the scheduler: the moment a process holds the most

    def on_reached(self) -> None:
        self.reached_n += 1

    def on_left(self) -> None:
        self.left_n += 1

    def closed(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.sample()
        self._line({"closed": time.monotonic()})
        if self.out is not None:
            self.out.close()
            self.out = None


def held_samples(path: Any) -> tuple[float | None, list[dict[str, Any]]]:
    """A :class:`HeldProbe` file: (when the spider opened, or None; the samples in order)."""
    opened, samples = None, []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, []
    for line in text.splitlines():
        try:
            data = json.loads(line)
        except ValueError:
            continue  # the line being written when the process was killed
        if "opened" in data:
            opened = data["opened"]
        elif "t" in data:
            samples.append(data)
    return opened, samples
