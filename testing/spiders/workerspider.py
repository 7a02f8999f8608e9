"""A plain ``scrapy.Spider`` with StageWorkerMixin, for the worker crawl tests (run with ``scrapy
runspider``).

``-a base=http://127.0.0.1:PORT -a plan=a:10,b:5`` yields GET <base>/<stage>/<n> for each stage of
the plan in ``start()`` (every worker yields them; the shared dupefilter lets one copy of each
through). ``-a unstaged=/other/1?sleep=5``: the first page of the plan yields a request for
<base><unstaged> that names no stage (its callback has none). Stages and caps come from
REDISLOCK_WORKER_STAGES, the order from REDISLOCK_STAGE_PREFERENCE.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import scrapy

from scrapy_redislock import StageWorkerMixin


class StagedSpider(StageWorkerMixin, scrapy.Spider):
    name = "staged"

    def __init__(self, base: str = "", plan: str = "", unstaged: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base = base
        self.unstaged = unstaged
        self.plan = [
            (part.split(":")[0], int(part.split(":")[1])) for part in plan.split(",") if part
        ]

    async def start(self) -> AsyncIterator[scrapy.Request]:
        for stage, count in self.plan:
            for n in range(count):
                yield scrapy.Request(f"{self.base}/{stage}/{n}", meta={"redislock_stage": stage})

    def parse(self, response: scrapy.http.Response) -> Iterator[Any]:
        yield {"url": response.url, "ts": time.time()}
        if self.unstaged and self.plan and response.url.endswith(f"/{self.plan[0][0]}/0"):
            yield scrapy.Request(f"{self.base}{self.unstaged}", callback=self.parse_unstaged)

    def parse_unstaged(self, response: scrapy.http.Response) -> Iterator[dict[str, Any]]:
        yield {"url": response.url, "ts": time.time()}
