"""A CrawlSpider whose stages come only from its Rule callbacks, run by ``scrapy runspider``
(testing.crawlproc).

The start page ``<base>/list/0`` links to ``/detail/<n>`` and ``/comments/<n>`` (see
test_fail_closed). Rule callbacks are given by name, as CrawlSpider users do: ``parse_detail``
carries ``@stage("detail")``, ``parse_comment`` is mapped by REDISLOCK_CALLBACK_STAGES;
``parse_start_url`` (CrawlSpider's default callback) carries ``@stage("list")``. Nothing sets
``meta``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import scrapy
from scrapy.linkextractors import LinkExtractor
from scrapy.spiders import CrawlSpider, Rule

from scrapy_redislock import stage


class RuleSpider(CrawlSpider):
    name = "rules"
    rules = (
        Rule(LinkExtractor(allow=r"/detail/"), callback="parse_detail"),
        Rule(LinkExtractor(allow=r"/comments/"), callback="parse_comment"),
    )

    def __init__(self, base: str = "", plan: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.start_urls = [f"{base}/list/0"]

    @stage("list")
    def parse_start_url(
        self, response: scrapy.http.Response, **kwargs: Any
    ) -> Iterator[dict[str, str]]:
        yield {"list": response.url}

    @stage("detail")
    def parse_detail(self, response: scrapy.http.Response) -> Iterator[dict[str, str]]:
        yield {"detail": response.url}

    def parse_comment(self, response: scrapy.http.Response) -> Iterator[dict[str, str]]:
        yield {"comment": response.url}
