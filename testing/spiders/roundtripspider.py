"""A worker spider whose requests carry every field ``Request.to_dict`` has, for the request-format
crawl test.

Run with ``scrapy runspider testing/spiders/roundtripspider.py -a base=http://127.0.0.1:PORT``.
Every request goes through the worker queue in Redis (the worker mixin queues even start requests);
the callback or errback compares the request it got back with the one it yielded and counts
``test/roundtrip/{same,different}`` (a difference is logged). One request has a meta value that is
not plain data: it must be refused when it is queued.
"""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator, Iterator
from typing import Any

import scrapy
from scrapy.http import FormRequest, JsonRequest

from scrapy_redislock import StageWorkerMixin

# Fields downloader middlewares add to or change on the way (headers, meta): compared as "what we
# set is there".
SUPERSETS = ("headers", "meta")


class RoundTripSpider(StageWorkerMixin, scrapy.Spider):
    name = "roundtrip"
    worker_stages = {"a": 1}
    custom_settings = {"RETRY_ENABLED": False}

    def __init__(self, base: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base = base
        self.sent: dict[str, dict[str, Any]] = {}

    def build(self) -> list[scrapy.Request]:
        meta = {
            "redislock_stage": "a",
            "tags": ("a", "b"),
            "raw": b"\xfe\xff\x00",
            "by_id": {1: "one", (2, 3): [None, True, 0.5]},
            "looks_tagged": {"$b": "a user's dict"},
        }
        return [
            scrapy.Request(
                f"{self.base}/a/post",
                method="POST",
                headers={"X-Token": "abc", "Accept-Language": ["de", "en"]},
                cookies={"session": "s1"},
                body=b"\x00\x01binary\xff",
                meta=meta,
                encoding="latin-1",
                priority=-3,
                dont_filter=True,
                callback=self.check,
                errback=self.failed,
                flags=["mine"],
                cb_kwargs={"page": 3, "seen": (1, 2), "label": b"bytes"},
            ),
            FormRequest(
                f"{self.base}/a/form", formdata={"q": "shoes"}, meta=meta, callback=self.check
            ),
            JsonRequest(
                f"{self.base}/a/json",
                data={"q": [1, 2]},
                meta=meta,
                callback=self.check,
                priority=5,
            ),
            scrapy.Request(
                "http://127.0.0.1:1/a/refused", meta=meta, errback=self.failed, cb_kwargs={"k": 1}
            ),
            scrapy.Request(
                f"{self.base}/a/bad",
                meta={"redislock_stage": "a", "when": datetime.datetime(2024, 1, 1)},
            ),
        ]

    async def start(self) -> AsyncIterator[scrapy.Request]:
        for request in self.build():
            self.sent[request.url] = request.to_dict(spider=self)
            yield request

    def compare(self, request: scrapy.Request, **cb_kwargs: Any) -> None:
        sent, got = self.sent[request.url], request.to_dict(spider=self)
        different = [
            field
            for field, value in sent.items()
            if (got.get(field) != value and field not in SUPERSETS)
            or (field in SUPERSETS and any(got[field].get(k) != v for k, v in value.items()))
        ]
        if cb_kwargs != sent["cb_kwargs"]:
            different.append("the callback's keyword arguments")
        if different:
            self.logger.error(
                "Round trip changed %s of %s: %r != %r", different, request.url, got, sent
            )
        self.crawler.stats.inc_value(f"test/roundtrip/{'different' if different else 'same'}")

    def check(self, response: scrapy.http.Response, **cb_kwargs: Any) -> Iterator[dict[str, Any]]:
        self.compare(response.request, **cb_kwargs)
        yield {"url": response.url}

    def failed(self, failure: Any) -> None:
        self.compare(failure.request, **failure.request.cb_kwargs)
        self.crawler.stats.inc_value("test/roundtrip/errback")
