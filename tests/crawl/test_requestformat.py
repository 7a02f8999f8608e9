"""The safe request format of the worker queues (pure code: no Redis, no crawl; those are in
test_workers_safety)."""

from __future__ import annotations

import datetime
import json
import os
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import scrapy
from hypothesis import given
from hypothesis import strategies as st
from scrapy.http import FormRequest, JsonRequest
from scrapy_redis import picklecompat

from scrapy_redislock.crawl import requestformat
from scrapy_redislock.crawl.requestformat import dumps, loads, request_from_data, serializer_of
from scrapy_redislock.errors import ConfigError, RequestFormatError


class Spider(scrapy.Spider):
    name = "format"

    def parse_item(self, response: Any, **kwargs: Any) -> None: ...

    def failed(self, failure: Any) -> None: ...

    not_a_method = "parse"

    def _private(self, response: Any) -> None: ...

    @staticmethod
    def helper(response: Any) -> None: ...


def rich_request(spider: Spider) -> scrapy.Request:
    """Every field Request.to_dict carries, with values the format must keep exactly."""
    return scrapy.Request(
        "http://shop.test/item?id=7",
        method="POST",
        headers={"X-Token": "abc", "Accept-Language": ["de", "en"]},
        cookies={"session": "s1", "theme": "dark"},
        body=b"\x00\x01binary\xff",
        meta={
            "redislock_stage": "detail",
            "depth": 2,
            "ratio": 0.25,
            "tags": ("a", "b"),
            "raw": b"\xfe\xff",
            "text_bytes": b"plain",
            "by_id": {1: "one", (2, 3): ["x", None, True]},
            "looks_tagged": {"$b": "not bytes"},
            "nested": [{"deep": [1, 2.5, "three", False]}],
        },
        encoding="latin-1",
        priority=-3,
        dont_filter=True,
        callback=spider.parse_item,
        errback=spider.failed,
        flags=["cached", "retry"],
        cb_kwargs={"page": 3, "seen": (1, 2), "label": b"bytes too"},
    )


def assert_same(request: scrapy.Request, back: scrapy.Request, spider: Spider) -> None:
    assert type(back) is type(request)
    assert back.to_dict(spider=spider) == request.to_dict(spider=spider)
    assert back.callback == request.callback and back.errback == request.errback


def test_every_to_dict_field_round_trips_exactly() -> None:
    spider = Spider()
    request = rich_request(spider)
    data = dumps(request.to_dict(spider=spider))
    back = request_from_data(data, requestformat, spider)
    assert_same(request, back, spider)
    assert type(back.meta["tags"]) is tuple and type(back.meta["by_id"][(2, 3)][2]) is bool
    # a user's dict that looks like a tag stays a dict
    assert back.meta["looks_tagged"] == {"$b": "not bytes"}
    json.loads(data)  # plain JSON, readable by any tool


@pytest.mark.parametrize("cls", [FormRequest, JsonRequest])
def test_request_subclasses_round_trip(cls: type[scrapy.Request]) -> None:
    spider = Spider()
    request = cls(
        "http://shop.test/form", method="POST", body=b'{"q": 1}', callback=spider.parse_item
    )
    back = request_from_data(dumps(request.to_dict(spider=spider)), requestformat, spider)
    assert_same(request, back, spider)


plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.text() | st.integers() | st.binary(), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(meta=st.dictionaries(st.text(), plain, max_size=5))
def test_any_plain_meta_round_trips_with_its_exact_types(meta: dict[str, Any]) -> None:
    back = loads(dumps({"url": "http://x.test/", "meta": meta}))["meta"]
    assert back == meta and repr(back) == repr(meta)  # repr tells a tuple from a list, 1 from True


@pytest.mark.parametrize(
    ("meta", "field"),
    [
        ({"when": datetime.datetime(2024, 1, 1)}, "meta['when'] is a datetime.datetime"),
        ({"ids": {1, 2}}, "meta['ids'] is a builtins.set"),
        ({"list": [1, object()]}, "meta['list'][1] is a builtins.object"),
        ({"ordered": OrderedDict(a=1)}, "meta['ordered'] is a collections.OrderedDict"),
        ({"path": Path("/tmp")}, "meta['path'] is a pathlib."),
    ],
)
def test_what_is_not_plain_data_is_refused_naming_the_field(
    meta: dict[str, Any], field: str
) -> None:
    request = scrapy.Request("http://shop.test/", meta=meta)
    with pytest.raises(RequestFormatError, match="not plain data") as error:
        dumps(request.to_dict())
    assert field in str(error.value)


def evil_payload(target: Path) -> bytes:
    class Evil:
        def __reduce__(self) -> Any:
            return (os.mkdir, (str(target),))  # any call: a directory appears

    return pickle.dumps({"url": "http://shop.test/", "x": Evil()})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x80\x05garbage", "not the JSON request format"),
        (b'{"url": "http://x.test/", "meta": {"a": [1, 2', "not the JSON request format"),
        (b"[1, 2]", "not a request"),
        (b'{"meta": {}}', "not a request"),
        (b'{"url": "http://x.test/", "body": {"$b64": "***"}}', "not the JSON request format"),
        (b'{"url": "http://x.test/", "meta": {"$eval": "os.system"}}', "unknown or malformed tag"),
        (
            b'{"url": "http://x.test/", "_class": "os.system"}',
            "_class 'os.system' is not an imported Request",
        ),
        (
            b'{"url": "http://x.test/", "_class": "antigravity.Request"}',
            "is not an imported Request subclass",
        ),
        (b'{"url": "http://x.test/", "meta": {"$d": [[[1], 2]]}}', "not the JSON request format"),
    ],
)
def test_loads_takes_only_the_format_back(data: bytes, message: str) -> None:
    with pytest.raises(RequestFormatError, match=message):
        loads(data)


def test_a_pickle_payload_is_refused_without_running_it(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    data = evil_payload(target)
    with pytest.raises(RequestFormatError):
        request_from_data(data, requestformat, Spider())
    assert not target.exists()
    pickle.loads(data)  # the control: pickle does run it
    assert target.exists()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"callback": "not_a_method"},
            "callback 'not_a_method' is not a public method of the spider (no leading underscore, "
            "not a class or static method)",
        ),
        ({"callback": "__init__"}, "callback '__init__' is not a public method"),
        ({"errback": "nowhere"}, "errback 'nowhere' is not a public method"),
        ({"callback": ["parse"]}, "callback ['parse'] is not a public method"),
        # issue 41: '_set_crawler' replaced spider.crawler with a Response
        ({"callback": "_set_crawler"}, "callback '_set_crawler' is not a public method"),
        ({"callback": "_private"}, "callback '_private' is not a public method"),
        ({"callback": "from_crawler"}, "callback 'from_crawler' is not a public method"),
        ({"errback": "update_settings"}, "errback 'update_settings' is not a public method"),
        ({"callback": "helper"}, "callback 'helper' is not a public method"),
    ],
)
def test_callbacks_must_be_public_methods_of_the_spider(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(RequestFormatError) as error:
        request_from_data(dumps({"url": "http://x.test/", **fields}), requestformat, Spider())
    assert message in str(error.value)


@pytest.mark.parametrize(
    "url", ["file:///etc/passwd", "data:text/plain,hello", "FILE:///etc/passwd", "s3://b/k", "x"]
)
def test_only_the_allowed_schemes_are_fetched(url: str) -> None:
    """Scrapy's file and data handlers are on by default: whoever can push to a queue must not make
    a worker read its files (issue 41)."""
    with pytest.raises(RequestFormatError) as error:
        request_from_data(dumps({"url": url}), requestformat, Spider())
    assert "has a scheme that is not in REDISLOCK_ALLOWED_SCHEMES (http, https)" in str(error.value)
    if url.startswith("s3"):
        back = request_from_data(dumps({"url": url}), requestformat, Spider(), ("http", "s3"))
        assert back.url == url


def test_scheduler_serializer_is_honoured_and_checked() -> None:
    assert serializer_of(None) is requestformat
    assert serializer_of("scrapy_redis.picklecompat") is picklecompat
    assert serializer_of(json) is json
    with pytest.raises(
        ConfigError, match=r"SCHEDULER_SERIALIZER 'no\.such\.module' cannot be imported"
    ):
        serializer_of("no.such.module")
    with pytest.raises(
        ConfigError,
        match=r"SCHEDULER_SERIALIZER 'datetime' must be a module .* with loads and dumps",
    ):
        serializer_of("datetime")
