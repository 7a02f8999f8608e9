"""An XMLFeedSpider, for ``scrapy runspider``: the feed ``<base>/feed/0`` lists ``/detail/<n>``
URLs.

``parse_node`` (the spider's default callback, through XMLFeedSpider.parse) carries
``@stage("feed")``, so the feed download itself is capped; the detail requests it yields go to
``parse_detail``, ``@stage("detail")``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import scrapy
from scrapy.spiders import XMLFeedSpider

from scrapy_redislock import stage


class FeedSpider(XMLFeedSpider):
    name = "feed"
    itertag = "item"

    def __init__(self, base: str = "", plan: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.start_urls = [f"{base}/feed/0"]

    @stage("feed")
    def parse_node(self, response: scrapy.http.Response, selector: Any) -> Iterator[scrapy.Request]:
        yield response.follow(selector.xpath("link/text()").get(), callback=self.parse_detail)

    @stage("detail")
    def parse_detail(self, response: scrapy.http.Response) -> Iterator[dict[str, str]]:
        yield {"detail": response.url}
