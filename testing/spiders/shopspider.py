"""A spider that crawls the test shop (:class:`testing.site.ShopSite`) the way a user's would: list
pages give detail pages, detail pages give comment pages; stages come from ``@stage`` on the
callbacks. Run by ``scrapy runspider`` (testing.crawlproc) with ``-a base=<site> -a plan=<list page
numbers, comma-separated>``, so that several processes can share the shop's list pages.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import scrapy

from scrapy_redislock import stage


class ShopCrawlSpider(scrapy.Spider):
    name = "shopcrawl"

    def __init__(self, base: str = "", plan: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base = base
        self.lists = [int(n) for n in plan.split(",") if n]

    async def start(self) -> AsyncIterator[scrapy.Request]:
        for n in self.lists:
            yield scrapy.Request(f"{self.base}/list/{n}", callback=self.parse_list)

    @stage("list")
    def parse_list(self, response: scrapy.http.Response) -> Iterator[scrapy.Request]:
        for href in response.css("a.detail::attr(href)").getall():
            yield response.follow(href, callback=self.parse_detail)

    @stage("detail")
    def parse_detail(self, response: scrapy.http.Response) -> Iterator[scrapy.Request]:
        for href in response.css("a.comments::attr(href)").getall():
            yield response.follow(href, callback=self.parse_comments)

    @stage("comments")
    def parse_comments(self, response: scrapy.http.Response) -> Iterator[dict[str, str]]:
        yield {"url": response.url}
