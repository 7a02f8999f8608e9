"""The shop crawl in three stages: category list pages -> product details -> comment pages.

Start URLs come from Redis, as with any RedisSpider: ``shop:start_urls`` holds ``{"url": ...}`` JSON
(the runner pushes the category index, which links every list page). ``ShopBaselineSpider`` is the
same crawl as plain scrapy-redis runs it (for the comparison in the demo and the benchmark).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import scrapy
from scrapy_redis.spiders import RedisSpider

from scrapy_redislock import StageWorkerMixin, stage


class ShopCallbacks:
    """What both spiders do with a page; only the scheduling differs."""

    @stage("list")
    def parse(self, response: scrapy.http.Response, **kwargs: Any) -> Iterator[Any]:
        pages = response.css("a.list::attr(href)").getall()
        if pages:  # the category index: the list pages, all at once
            for href in pages:
                yield response.follow(href, callback=self.parse)
            return
        yield {"stage": "list", "url": response.url, "ts": time.time()}
        for href in response.css("a.detail::attr(href)").getall():
            yield response.follow(href, callback=self.parse_detail)

    @stage("detail")
    def parse_detail(self, response: scrapy.http.Response) -> Iterator[Any]:
        yield {"stage": "detail", "url": response.url, "ts": time.time()}
        for href in response.css("a.comments::attr(href)").getall():
            yield response.follow(href, callback=self.parse_comments)

    @stage("comments")
    def parse_comments(self, response: scrapy.http.Response) -> Iterator[Any]:
        yield {"stage": "comments", "url": response.url, "ts": time.time()}


class ShopSpider(ShopCallbacks, StageWorkerMixin, RedisSpider):
    """Workers capped per stage: at most 1 on list, 3 on detail, the rest on comments."""

    name = "shop"
    worker_stages = {"list": 1, "detail": 3, "comments": None}


class ShopBaselineSpider(ShopCallbacks, RedisSpider):
    """The same crawl as scrapy-redis runs it: one FIFO queue, every worker goes through the stages
    in order."""

    name = "shop_baseline"
    custom_settings = {
        "SCHEDULER": "scrapy_redis.scheduler.Scheduler",
        "DUPEFILTER_CLASS": "scrapy_redis.dupefilter.RFPDupeFilter",
        "SCHEDULER_QUEUE_CLASS": "scrapy_redis.queue.FifoQueue",
        # True: with False, the first worker to close would delete the queue of all the others.
        "SCHEDULER_PERSIST": True,
    }
