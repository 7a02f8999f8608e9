"""A spider whose items carry ``file_urls`` for Scrapy's FilesPipeline, for ``scrapy runspider``.

``-a plan=N:M``: N uncapped list pages ``/list/<n>``, each giving one item with M files
``/files/<n>-<m>``. The file downloads (media requests, ``engine.download_async``) get their stage
from REDISLOCK_DEFAULT_STAGE.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import scrapy


class FilesSpider(scrapy.Spider):
    name = "files"

    def __init__(self, base: str = "", plan: str = "1:1", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base = base
        pages, files = plan.split(":")
        self.pages, self.files = int(pages), int(files)

    async def start(self) -> AsyncIterator[scrapy.Request]:
        for n in range(self.pages):
            yield scrapy.Request(
                f"{self.base}/list/{n}", meta={"dont_redislock": True}, cb_kwargs={"n": n}
            )

    def parse(self, response: scrapy.http.Response, n: int) -> Iterator[dict[str, Any]]:
        yield {"page": n, "file_urls": [f"{self.base}/files/{n}-{m}" for m in range(self.files)]}
