"""StageWorkerMixin: cap the number of *workers* per stage, cluster-wide, over scrapy-redis.

```python
class ShopSpider(StageWorkerMixin, RedisSpider):
    name = "shop"
    worker_stages = {"list": 1, "detail": 3, "comments": None}
```

The work is done by :class:`~scrapy_redislock.workerscheduler.StageWorkerScheduler` (set as SCHEDULER, which
the mixin does through ``custom_settings`` defaults): per-stage queues in Redis, one stage slot per worker.
The mixin replaces scrapy-redis's blocking parts: RedisSpider's ``start_requests`` (which Scrapy 2.19 no longer
calls, so scrapy-redis 0.9.1's first batch would only arrive at the first idle signal) and its ``spider_idle``
handler (blocking ``LLEN``/``LPOP`` on the reactor thread) are not used; start URLs are read with
``redis.asyncio`` in ``async def start()``. It works on a plain ``scrapy.Spider`` too (without the start-URL
key); it needs Scrapy's asyncio reactor either way.

Settings read: REDISLOCK_IDLE_CLOSE (through the scheduler), REDISLOCK_URL via config.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar

from scrapy import Request
from scrapy.exceptions import DontCloseSpider

SCHEDULER_PATH = "scrapy_redislock.workerscheduler.StageWorkerScheduler"


class StageWorkerMixin:
    """Mixin for a Spider or scrapy-redis RedisSpider whose workers take stages (see module docstring)."""

    worker_stages: ClassVar[dict[str, int | None] | None] = None
    stage_preference: ClassVar[list[str] | None] = None

    @classmethod
    def update_settings(cls, settings: Any) -> None:
        super().update_settings(settings)  # type: ignore[misc]
        settings.set("SCHEDULER", SCHEDULER_PATH, priority="spider")
        middlewares = dict(settings.getdict("SPIDER_MIDDLEWARES"))
        middlewares.setdefault("scrapy_redislock.workeroutput.AckAfterOutput", 1000)
        settings.set("SPIDER_MIDDLEWARES", middlewares, priority="spider")

    def setup_redis(self, crawler: Any = None) -> None:
        """RedisSpider's set-up, minus its blocking idle handler (ours is connected below)."""
        from scrapy import signals

        crawler = crawler or self.crawler  # type: ignore[attr-defined]
        parent = getattr(super(), "setup_redis", None)
        if parent is not None:
            parent(crawler)
            crawler.signals.disconnect(self.spider_idle, signal=signals.spider_idle)
        crawler.signals.connect(self._redislock_idle, signal=signals.spider_idle)

    @classmethod
    def from_crawler(cls, crawler: Any, *args: Any, **kwargs: Any) -> Any:
        spider = super().from_crawler(crawler, *args, **kwargs)  # type: ignore[misc]
        if not hasattr(spider, "server"):  # a plain scrapy.Spider: no scrapy-redis set-up to hook into
            spider.setup_redis(crawler)
        return spider

    def spider_idle(self) -> None:
        """Replaces scrapy-redis's (blocking) idle handler."""
        self._redislock_idle()

    def _redislock_idle(self) -> None:
        scheduler = getattr(getattr(self.crawler.engine, "_slot", None), "scheduler", None)  # type: ignore[attr-defined]
        idle_close = getattr(scheduler, "idle_close", None)
        if idle_close is not None and scheduler.cluster_idle_for() >= idle_close:
            return  # no work anywhere for long enough: let the spider close
        raise DontCloseSpider

    def schedule_next_requests(self) -> None:
        """scrapy-redis would pop start URLs with blocking calls here; the mixin reads them in start()."""

    async def start(self) -> AsyncIterator[Any]:
        for url in getattr(self, "start_urls", ()) or ():
            yield Request(url)
        redis_key = getattr(self, "redis_key", None)
        if redis_key:
            import redis.asyncio

            from scrapy_redislock.config import read_settings

            client = read_settings(self.crawler.settings).async_client()  # type: ignore[attr-defined]
            try:
                while data := await client.lpop(redis_key):
                    url = data.decode() if isinstance(data, bytes) else data
                    yield Request(url)
            except redis.exceptions.RedisError as exc:
                self.logger.warning("Could not read start URLs from %r: %s", redis_key, exc)  # type: ignore[attr-defined]
            finally:
                await client.aclose()
