"""AckAfterOutput: a worker's in-flight record of a request is dropped only after its callback's output is queued.

Dropping it when the download ends would lose the requests the callback yields if the worker dies in between.
Added by :class:`~scrapy_redislock.StageWorkerMixin`; reads no settings.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import Self

    from scrapy.crawler import Crawler
    from scrapy.http import Response


class AckAfterOutput:
    """Spider middleware: tell the worker scheduler when a response's output has been fully handed over."""

    def __init__(self, crawler: Crawler) -> None:
        self.crawler = crawler

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        return cls(crawler)

    def _done(self, response: Response) -> None:
        scheduler = getattr(getattr(self.crawler.engine, "_slot", None), "scheduler", None)
        done = getattr(scheduler, "output_done", None)
        if done is not None:
            done(response.request)

    def process_spider_output(self, response: Response, result: Iterable[Any], spider: Any = None) -> Iterable[Any]:
        yield from result
        self._done(response)

    async def process_spider_output_async(
        self, response: Response, result: AsyncIterator[Any], spider: Any = None
    ) -> AsyncIterator[Any]:
        async for item in result:
            yield item
        self._done(response)
