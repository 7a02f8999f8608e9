"""A SitemapSpider whose stages come from its sitemap_rules callbacks (by name), for ``scrapy
runspider``.

``<base>/sitemap.xml`` lists ``/detail/<n>`` pages (see test_fail_closed); ``parse_detail`` carries
``@stage("detail")``. Nothing sets ``meta``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import scrapy
from scrapy.spiders import SitemapSpider

from scrapy_redislock import stage


class MapSpider(SitemapSpider):
    name = "sitemap"
    sitemap_rules = [("/detail/", "parse_detail")]

    def __init__(self, base: str = "", plan: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sitemap_urls = [f"{base}/sitemap.xml"]

    @stage("detail")
    def parse_detail(self, response: scrapy.http.Response) -> Iterator[dict[str, str]]:
        yield {"detail": response.url}
