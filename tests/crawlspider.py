"""A test spider: ``-a plan=detail:300,comments:300`` yields that many requests per stage, in that order.

``-a base=http://127.0.0.1:PORT``; stages named ``free`` get ``dont_redislock``. Run with ``scrapy runspider``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import scrapy


class PlanSpider(scrapy.Spider):
    name = "plan"

    def __init__(self, base: str = "", plan: str = "", direct: str = "0", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.direct = int(direct)  # downloads that bypass the scheduler, as media pipelines make
        self.base = base
        self.plan = [(part.split(":")[0], int(part.split(":")[1])) for part in plan.split(",") if part]

    async def start(self) -> AsyncIterator[scrapy.Request]:
        for stage, count in self.plan:
            for n in range(count):
                meta = {"dont_redislock": True} if stage == "free" else {"redislock_stage": stage}
                yield scrapy.Request(f"{self.base}/{stage}/{n}", meta=meta, callback=self.parse, dont_filter=True)

    async def parse(self, response: scrapy.http.Response) -> AsyncIterator[dict[str, str]]:
        while self.direct > 0:
            self.direct -= 1
            request = scrapy.Request(f"{self.base}/direct/{self.direct}", meta={"redislock_stage": "detail"})
            await self.crawler.engine.download_async(request)
        yield {"url": response.url}
