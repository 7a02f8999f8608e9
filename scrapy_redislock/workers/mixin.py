"""StageWorkerMixin: cap the number of *workers* per stage, cluster-wide, for scrapy-redis spiders.

```python
class ShopSpider(StageWorkerMixin, RedisSpider):
    name = "shop"
    worker_stages = {"list": 1, "detail": 3, "comments": None}
```

The mixin sets SCHEDULER to :class:`~scrapy_redislock.workers.scheduler.StageWorkerScheduler`, which
does the work (per-stage queues in Redis, one stage slot per worker). It also replaces the parts of
scrapy-redis's RedisSpider that block the reactor or do not fit Scrapy 2.19:

- RedisSpider reads its start URLs in ``start_requests()``, which Scrapy 2.19 never calls, and in
  its ``spider_idle`` handler, with blocking redis calls on the reactor thread, one batch per idle
  signal. Here the scheduler reads ``redis_key`` with redis.asyncio
  (:mod:`~scrapy_redislock.workers.feed`: when it has no work or its stage queue ran empty; an idle
  worker blocks on a list feed), and the idle handler only decides whether to close;
  ``make_request_from_data`` (JSON or plain URLs) is used as it is.
- ``start()`` yields ``start_urls`` *filtered* (Scrapy's default sets ``dont_filter``): every worker
  yields them, the shared dupefilter lets one copy through.
- RedisSpider's ``max_idle_time`` (attribute or ``-a max_idle_time=N``; else
  MAX_IDLE_TIME_BEFORE_CLOSE; 0 = never) is honoured by the idle handler below, unless
  REDISLOCK_IDLE_CLOSE is set, which wins; idle means no work anywhere in the cluster (a paused or
  full stage's queue is work), counted from the last work seen.

On a plain ``scrapy.Spider`` it works the same minus the ``redis_key`` feed: work enters through
``start()`` (every worker's, deduplicated) and through what callbacks yield.

At start (``from_crawler``) it checks the stage names known before any request against
REDISLOCK_WORKER_STAGES (the spider's ``worker_stages``): its ``@stage`` callbacks,
REDISLOCK_CALLBACK_STAGES, REDISLOCK_DEFAULT_STAGE; a name that is not a worker stage is a
ConfigError naming it and the callback (else every request of that callback would be dropped with an
error, and the crawl finish with exit status 0). It also checks ``max_idle_time`` (a number of
seconds >= 0). A ConfigError ends the crawl as one log line, exit status 1.

Settings read: those of :func:`~scrapy_redislock.crawl.settings.read_settings` and
:func:`~scrapy_redislock.crawl.settings.read_worker_settings`, for the checks above (the scheduler
reads them again).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, ClassVar

from scrapy import Request, signals
from scrapy.exceptions import CloseSpider, DontCloseSpider

from scrapy_redislock.crawl.engine import engine_scheduler, one_line_config_errors
from scrapy_redislock.crawl.settings import read_settings, read_worker_settings
from scrapy_redislock.crawl.stages import check_stage_names
from scrapy_redislock.workers.policy import idle_close_for

SCHEDULER_PATH = "scrapy_redislock.StageWorkerScheduler"

# a mixin for spiders: type-checked as one (at run time its base is object, as before)
if TYPE_CHECKING:
    from scrapy import Spider as _SpiderBase
else:
    _SpiderBase = object


class StageWorkerMixin(_SpiderBase):
    """Mixin for a RedisSpider (or a plain Spider) whose workers take stages; see the module
    docstring.

    ``worker_stages``: stage -> max workers on it cluster-wide (None = unlimited), i.e.
    REDISLOCK_WORKER_STAGES at spider priority (``-s`` on the command line overrides it).
    ``stage_preference``: the order in which a free worker takes stages
    (REDISLOCK_STAGE_PREFERENCE), default the order of ``worker_stages``.
    """

    worker_stages: ClassVar[dict[str, int | None] | None] = None
    stage_preference: ClassVar[list[str] | None] = None

    @classmethod
    def update_settings(cls, settings: Any) -> None:
        """SCHEDULER, and the class attributes as settings (so the command line can still override
        them)."""
        super().update_settings(settings)
        settings.set("SCHEDULER", SCHEDULER_PATH, priority="spider")
        if cls.worker_stages is not None:
            settings.set("REDISLOCK_WORKER_STAGES", dict(cls.worker_stages), priority="spider")
        if cls.stage_preference is not None:
            settings.set(
                "REDISLOCK_STAGE_PREFERENCE", list(cls.stage_preference), priority="spider"
            )

    @classmethod
    def from_crawler(cls, crawler: Any, *args: Any, **kwargs: Any) -> Any:
        one_line_config_errors()  # a ConfigError of ours (here or in the scheduler) ends the crawl as one line
        checked = read_settings(crawler.settings)
        if checked.worker_stages:  # none: the scheduler says what is missing
            check_stage_names(cls, checked, checked.worker_stages, "REDISLOCK_WORKER_STAGES")
        spider = super().from_crawler(crawler, *args, **kwargs)
        fallback = read_worker_settings(crawler.settings, checked).idle_close
        # a ConfigError now
        idle_close_for(checked.idle_close, getattr(spider, "max_idle_time", None), fallback)
        # RedisSpider.setup_redis connected spider.spider_idle, which is ours (below); a plain
        # Spider needs it too.
        if getattr(spider, "server", None) is None:
            crawler.signals.connect(spider.spider_idle, signal=signals.spider_idle)
        return spider

    def spider_idle(self) -> None:
        """Idle like a RedisSpider (stay open, waiting for work) until REDISLOCK_IDLE_CLOSE, else
        ``max_idle_time``, else MAX_IDLE_TIME_BEFORE_CLOSE says otherwise
        (:func:`~scrapy_redislock.workers.policy.idle_close_for`).

        Replaces RedisMixin.spider_idle, which pops start URLs with blocking calls; the scheduler
        feeds them. The scheduler may name a finish reason of its own (``redislock_queue_lost``:
        Redis lost the queues under it).
        """
        scheduler = engine_scheduler(self.crawler)
        may_close = getattr(scheduler, "may_close", None)
        if may_close is not None and may_close():
            reason = getattr(scheduler, "close_reason", None)
            if reason:
                raise CloseSpider(reason)
            return
        raise DontCloseSpider

    def schedule_next_requests(self) -> None:
        """RedisMixin's blocking batch read; the scheduler reads start URLs with redis.asyncio
        instead."""

    def next_requests(self) -> Any:
        """RedisMixin's blocking batch read, not used (RedisMixin.start_requests would call it)."""
        return iter(())

    async def start(self) -> AsyncIterator[Any]:
        """``start_urls``, filtered by the shared dupefilter so that N workers fetch each of them
        once."""
        for url in getattr(self, "start_urls", ()) or ():
            yield Request(url)


__all__ = ["StageWorkerMixin"]
