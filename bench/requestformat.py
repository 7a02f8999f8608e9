"""Request format benchmark: size and encode/decode time per request, the safe JSON format against
pickle.

    ./run.sh bench requestformat [--number 2000] [--repeat 7]

For four request shapes (a bare GET with its stage; a GET as a crawl makes it, with the meta
Scrapy's middlewares add; a form POST with headers and cookies; a request with every field and a
meta of tuples, bytes and int keys): bytes in Redis, and microseconds per request to encode
(``request.to_dict`` + ``dumps``) and to decode (``loads`` + checks + ``request_from_dict``), as the
worker scheduler does them, for :mod:`scrapy_redislock.crawl.requestformat` and scrapy-redis's
``picklecompat``. Times are the median of ``--repeat`` runs of ``--number`` requests each
(``timeit``), in this process; no Redis involved (the format alone). Prints what it measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import timeit
from collections.abc import Callable
from typing import Any

import scrapy
from scrapy.http import FormRequest
from scrapy.utils.request import request_from_dict
from scrapy_redis import picklecompat

from bench import RESULTS, add_smoke
from scrapy_redislock.crawl import requestformat
from scrapy_redislock.crawl.requestformat import request_from_data


class ShopSpider(scrapy.Spider):
    name = "shop"

    def parse_detail(self, response: Any, **kwargs: Any) -> None: ...

    def failed(self, failure: Any) -> None: ...


def shapes(spider: ShopSpider) -> dict[str, scrapy.Request]:
    crawl_meta = {
        "redislock_stage": "detail",
        "depth": 3,
        "download_slot": "shop.example.com",
        "download_latency": 0.2314,
        "redirect_times": 1,
        "redirect_urls": ["http://shop.example.com/p/123"],
        "redirect_reasons": [301],
    }
    return {
        "bare GET": scrapy.Request(
            "http://shop.example.com/p/123", meta={"redislock_stage": "detail"}
        ),
        "crawled GET": scrapy.Request(
            "https://shop.example.com/products/123-blue-shoes?ref=list&page=4",
            meta=crawl_meta,
            callback=spider.parse_detail,
            errback=spider.failed,
            priority=2,
        ),
        "form POST": FormRequest(
            "https://shop.example.com/search",
            formdata={"q": "blue shoes", "page": "4", "sort": "price"},
            headers={"Referer": "https://shop.example.com/", "X-Requested-With": "XMLHttpRequest"},
            cookies={"session": "3f6a1c0e9b", "currency": "EUR"},
            meta={"redislock_stage": "list"},
            callback=spider.parse_detail,
        ),
        "every field": scrapy.Request(
            "https://shop.example.com/api/items",
            method="POST",
            headers={"Accept-Language": ["de", "en"], "X-Token": "abc"},
            cookies={"session": "s1"},
            body=bytes(range(256)),
            meta={
                **crawl_meta,
                "tags": ("a", "b"),
                "raw": b"\xfe\xff",
                "by_id": {1: "one", 2: (3, 4)},
            },
            encoding="utf-8",
            priority=-3,
            dont_filter=True,
            callback=spider.parse_detail,
            errback=spider.failed,
            flags=["mine"],
            cb_kwargs={"page": 3, "seen": (1, 2)},
        ),
    }


def per_request_us(call: Callable[[], Any], number: int, repeat: int) -> float:
    return statistics.median(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e6


def measure(number: int, repeat: int) -> list[dict[str, Any]]:
    spider = ShopSpider()
    formats: dict[str, tuple[Callable[[bytes], Any], Callable[[dict[str, Any]], bytes]]] = {
        "json (default)": (
            lambda data: request_from_data(data, requestformat, spider),
            requestformat.dumps,
        ),
        "pickle": (
            lambda data: request_from_dict(picklecompat.loads(data), spider=spider),
            picklecompat.dumps,
        ),
    }
    rows = []
    for shape, request in shapes(spider).items():
        for name, (decode, dumps) in formats.items():
            data = dumps(request.to_dict(spider=spider))
            assert decode(data).to_dict(spider=spider) == request.to_dict(spider=spider)
            rows.append(
                {
                    "shape": shape,
                    "format": name,
                    "bytes": len(data),
                    "encode_us": per_request_us(
                        lambda r=request, d=dumps: d(r.to_dict(spider=spider)), number, repeat
                    ),
                    "decode_us": per_request_us(lambda b=data, f=decode: f(b), number, repeat),
                }
            )
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'request':<13} {'format':<15} {'bytes':>6} {'encode µs':>10} {'decode µs':>10}"]
    for row in rows:
        lines.append(
            f"{row['shape']:<13} {row['format']:<15} {row['bytes']:>6} {row['encode_us']:>10.1f} "
            f"{row['decode_us']:>10.1f}"
        )
    lines.append("")
    by_shape: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_shape.setdefault(row["shape"], {})[row["format"]] = row
    for shape, pair in by_shape.items():
        safe, pickled = pair["json (default)"], pair["pickle"]
        lines.append(
            f"{shape}: json/pickle size {safe['bytes'] / pickled['bytes']:.2f}x, "
            f"encode {safe['encode_us'] / pickled['encode_us']:.2f}x, "
            f"decode {safe['decode_us'] / pickled['decode_us']:.2f}x"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--number", type=int, default=2000, help="requests per timed run (default 2000)"
    )
    parser.add_argument(
        "--repeat", type=int, default=7, help="timed runs; the median is reported (default 7)"
    )
    add_smoke(parser)
    opts = parser.parse_args()
    if opts.smoke:
        opts.number, opts.repeat = 100, 1
    rows = measure(opts.number, opts.repeat)
    print(
        f"Python {platform.python_version()}, Scrapy {scrapy.__version__}; median of {opts.repeat} "
        f"x {opts.number}"
    )
    print(report(rows))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "requestformat.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
