"""Start URLs pushed to a RedisSpider's ``redis_key`` (scrapy-redis's feed), read with
redis.asyncio.

scrapy-redis reads them in ``spider_idle`` with blocking calls on the reactor thread. Here the
worker scheduler reads a batch when it has no work (at its heartbeat, or when woken) or when its
stage queue has run empty; an idle worker also blocks on a list feed itself (BLPOP with the signal
lists, not on Redis Cluster where the keys sit on other nodes), so that a start URL pushed to an
idle cluster is taken within milliseconds, not at the next poll.

Settings read (via :mod:`scrapy_redislock.crawl.settings`): REDIS_START_URLS_AS_SET / _AS_ZSET (the
feed's type); the spider's ``redis_key``, ``redis_batch_size`` (default CONCURRENT_REQUESTS) and
``make_request_from_data``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

from scrapy import Request

if TYPE_CHECKING:
    from scrapy import Spider

    from scrapy_redislock._redis import AsyncRedisClient


class StartUrlFeed:
    """One spider's start-URL feed; ``enabled`` is False for a spider without ``redis_key``."""

    def __init__(
        self, client: AsyncRedisClient, spider: Spider | None, how: str, batch: int
    ) -> None:
        self.client = client
        self.spider = spider
        self.how = how
        self.key: str | None = getattr(spider, "redis_key", None) or None
        self.make = getattr(spider, "make_request_from_data", None)
        self.batch = int(getattr(spider, "redis_batch_size", None) or batch)
        self.enabled = bool(self.key) and self.make is not None

    @property
    def blocking_key(self) -> str | None:
        """The key an idle worker may BLPOP beside its signal lists: a list feed on a single Redis,
        else None."""
        if not self.enabled or self.how != "list" or hasattr(self.client, "get_node_from_key"):
            return None
        return self.key

    async def read(self) -> list[Any]:
        """Pop up to a batch of entries (one command)."""
        key = self.key
        if not self.enabled or key is None:  # (enabled has a key)
            return []
        if self.how == "set":
            return list(await self.client.spop(key, self.batch) or [])
        if self.how == "zset":
            # with a count: (member, score) pairs (redis-py's return type is a union that also has
            # plain members)
            pairs = cast(list[Sequence[Any]], await self.client.zpopmax(key, self.batch))
            return [member for member, _score in pairs]
        return list(await self.client.lpop(key, self.batch) or [])

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
