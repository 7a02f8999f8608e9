"""Spiders for tests/crawl/test_start_checks.py, run with ``scrapy runspider`` (the file's last
spider class).

:class:`CommentsWorkerSpider` is the worker test spider (:mod:`testing.spiders.workerspider`) with a
callback staged ``@stage("comments")``: its requests name no stage in ``meta``, the decorator does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import scrapy

from scrapy_redislock import stage
from testing.spiders.workerspider import StagedSpider


class CommentsWorkerSpider(StagedSpider):
    name = "comments_worker"

    async def start(self) -> AsyncIterator[scrapy.Request]:
        for stage_name, count in self.plan:
            for n in range(count):
                callback = self.parse_comments if stage_name == "comments" else self.parse
                meta = {} if stage_name == "comments" else {"redislock_stage": stage_name}
                yield scrapy.Request(f"{self.base}/{stage_name}/{n}", callback=callback, meta=meta)

    @stage("comments")
    def parse_comments(self, response: scrapy.http.Response) -> Iterator[dict[str, Any]]:
        yield {"url": response.url}
