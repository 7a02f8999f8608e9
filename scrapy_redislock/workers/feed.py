"""Start URLs pushed to a RedisSpider's ``redis_key`` (scrapy-redis's feed), read with
redis.asyncio.

scrapy-redis reads them in ``spider_idle`` with blocking calls on the reactor thread. Here the
worker scheduler reads a batch when it has no work (at its heartbeat, or when woken) or when its
stage queue has run empty; an idle worker also waits on a list feed (BLMOVE of the feed onto itself,
which takes nothing: not on Redis Cluster, where the keys sit on other nodes), so that a start URL
pushed to an idle cluster is taken within milliseconds, not at the next poll.

A batch is taken by one script (``scripts/feed_take.lua``), which pops as scrapy-redis pops and keeps
the batch under the worker's number for that take: the same take again, after a reply the network
lost or redis-py's own retry, answers the same entries, and at close the entries of a take whose
reply never came go back to the feed. scrapy-redis's pop loses them then.

Settings read (via :mod:`scrapy_redislock.crawl.settings`): REDIS_START_URLS_AS_SET / _AS_ZSET (the
feed's type); the spider's ``redis_key``, ``redis_batch_size`` (default CONCURRENT_REQUESTS) and
``make_request_from_data``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from scrapy import Request

from scrapy_redislock.crawl.epoch import RECORD_KEPT_MS

if TYPE_CHECKING:
    from scrapy import Spider

    from scrapy_redislock.workers.queue import StageQueues


class StartUrlFeed:
    """One spider's start-URL feed; ``enabled`` is False for a spider without ``redis_key``."""

    def __init__(self, queues: StageQueues, spider: Spider | None, how: str, batch: int) -> None:
        self.queues = queues
        self.spider = spider
        self.how = how
        self.key: str | None = getattr(spider, "redis_key", None) or None
        self.make = getattr(spider, "make_request_from_data", None)
        self.batch = int(getattr(spider, "redis_batch_size", None) or batch)
        self.enabled = bool(self.key) and self.make is not None
        # this worker's last take (scripts/feed_take.lua)
        self.record = queues.keys.feed_taken(self.key, queues.worker) if self.key else ""
        self.number = 1  # of the next take; the next once a reply brought entries
        self.unanswered = False  # a take was sent and its reply never came
        # the number of the last take whose requests may not all be in their queues yet, and the
        # outbox's losses before it (the worker loop's: a loss since, and the take goes back)
        self.pending: int | None = None
        self.losses_before = 0

    @property
    def blocking_key(self) -> str | None:
        """The key an idle worker may wait on for start URLs: a list feed on a single Redis, else
        None."""
        if (
            not self.enabled
            or self.how != "list"
            or hasattr(self.queues.client, "get_node_from_key")
        ):
            return None
        return self.key

    async def read(self) -> list[Any]:
        """Take up to a batch of entries (one script; the same entries again if the last take's
        reply was lost)."""
        if not self.enabled:
            return []
        self.unanswered = True
        args = ["take", self.how, self.number, self.batch, RECORD_KEPT_MS]
        reply = await self.queues.scripts["feed_take"](keys=[self.key, self.record], args=args)
        self.unanswered = False
        entries = list(reply or [])
        if entries:
            self.pending = self.number
            self.number += 1
        # of a sorted set, members and scores in turns
        return entries[::2] if self.how == "zset" else entries

    def landed(self) -> None:
        """The requests of the last take are in their queues in Redis."""
        self.pending = None

    async def give_back(self) -> int:
        """At close: the entries of a take whose reply never came, or whose requests did not all
        reach their queues, go back to the feed, and the record goes; how many went back."""
        if not self.enabled:
            return 0
        number = self.number if self.pending is None else self.pending
        args = ["give_back", self.how, number, 0, 0]
        moved = int(await self.queues.scripts["feed_take"](keys=[self.key, self.record], args=args))
        self.unanswered = False
        self.pending = None
        return moved

    def requests(self, entries: Iterable[Any]) -> tuple[list[Request], list[tuple[Any, Exception]]]:
        """The requests ``make_request_from_data`` makes of the entries (JSON or plain URLs), and
        the entries it failed on, with why: one bad entry (a URL with no scheme) costs itself, not
        the batch popped with it."""
        assert self.make is not None
        out: list[Request] = []
        failed: list[tuple[Any, Exception]] = []
        for data in entries:
            try:
                made = self.make(data)
                many = isinstance(made, Iterable) and not isinstance(made, Request)
                out += [r for r in (made if many else [made]) if isinstance(r, Request)]
            except Exception as exc:  # whatever the spider's method raised
                failed.append((data, exc))
        return out, failed
