"""The shop crawl in three stages: category list pages -> product details -> comment pages."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import scrapy
from scrapy_redis.spiders import RedisSpider

from scrapy_redislock import StageWorkerMixin, stage


class ShopCallbacks:
    """What both spiders do with a page; only the scheduling differs."""

    def list_urls(self) -> list[str]:
        base = self.settings.get("SHOP_URL")  # type: ignore[attr-defined]
        return [f"{base}/list/{i}" for i in range(self.settings.getint("SHOP_LISTS"))]  # type: ignore[attr-defined]

    @stage("list")
    def parse(self, response: scrapy.http.Response, **kwargs: Any) -> Iterator[Any]:
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

    async def start(self) -> Any:
        for url in self.list_urls():
            yield scrapy.Request(url)


class ShopBaselineSpider(ShopCallbacks, RedisSpider):
    """The same crawl as scrapy-redis runs it: every worker goes through the stages in order."""

    name = "shop_baseline"
    custom_settings = {
        "SCHEDULER": "scrapy_redis.scheduler.Scheduler",
        "DUPEFILTER_CLASS": "scrapy_redis.dupefilter.RFPDupeFilter",
    }


class PlainShopSpider(ShopCallbacks, StageWorkerMixin, scrapy.Spider):
    """The same worker slots on a plain scrapy.Spider (no scrapy-redis spider class needed)."""

    name = "shop_plain"
    worker_stages = {"list": 1, "detail": 3, "comments": None}

    async def start(self) -> Any:
        for url in self.list_urls():
            yield scrapy.Request(url)
