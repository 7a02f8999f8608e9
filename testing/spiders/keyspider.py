"""A spider over many "domains" on one local site, for the key benchmark (bench/keys.py).

``-a base=http://127.0.0.1:PORT -a pages=2000 -a domains=100 -a part=0 -a parts=3``: this process
fetches pages ``part, part + parts, ...`` of ``pages``; page ``n`` belongs to domain ``d<n %
domains>``, is fetched at ``/d<k>/<n>`` (the site counts each domain as a stage) and carries
``meta["download_slot"] = "d<k>"``, so Scrapy's per-domain settings and REDISLOCK_STAGE_KEY =
"download_slot" both treat each as a domain of its own. ``-a slow=5 -a slow_pages=20`` first yields
``slow_pages`` pages of each of ``slow`` more domains ``s0, s1, ...`` (``/s<k>/<n>``), shared out
between the processes the same way (the site can be told to answer those slowly). ``-a stage=page``
names that stage in every request's meta (a request carrying a stage and a domain scope).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import scrapy


class KeySpider(scrapy.Spider):
    name = "keys"

    def __init__(
        self,
        base: str = "",
        pages: str = "100",
        domains: str = "10",
        part: str = "0",
        parts: str = "1",
        slow: str = "0",
        slow_pages: str = "0",
        stage: str = "",
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.base, self.pages, self.domains = base, int(pages), int(domains)
        self.part, self.parts = int(part), int(parts)
        self.slow, self.slow_pages = int(slow), int(slow_pages)
        self.stage = stage

    async def start(self) -> AsyncIterator[scrapy.Request]:
        for n in range(self.part, self.slow * self.slow_pages, self.parts):
            domain = f"s{n % self.slow}"
            yield scrapy.Request(
                f"{self.base}/{domain}/{n}",
                meta={"download_slot": domain},
                callback=self.parse,
                dont_filter=True,
            )
        for n in range(self.part, self.pages, self.parts):
            domain = f"d{n % self.domains}"
            meta = {"download_slot": domain}
            if self.stage:
                meta["redislock_stage"] = self.stage
            yield scrapy.Request(
                f"{self.base}/{domain}/{n}", meta=meta, callback=self.parse, dont_filter=True
            )

    def parse(self, response: scrapy.http.Response) -> None:
        self.crawler.stats.inc_value("test/pages")
