"""Nothing in Redis runs code in a worker: the safe request format and the dead-letter list, in real
crawls against a real Redis (issue 14). The format's pure-code tests are in test_requestformat."""

from __future__ import annotations

import asyncio
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
import scrapy

from scrapy_redislock.crawl import requestformat
from scrapy_redislock.workers.queue import QueueKeys, StageQueues
from testing.crawlproc import ROOT, settings_args, staged_worker
from testing.site import CrawlSite
from tests.workers.test_mixin import finish, held_slots, stat

pytestmark = [pytest.mark.integration, pytest.mark.crawl]


class CreatesAFile:
    """Unpickling this opens (creates) a file: what an attacker's payload would do, harmlessly."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (str(self.path), "w"))


def push_raw(client: redis.Redis, spider: str, stage: str, entries: list[bytes]) -> None:
    """LPUSH entries onto a stage queue by hand, as anyone with write access to Redis could."""
    client.lpush(QueueKeys.of("redislock", spider).queue(stage), *entries)


def safe_entries(urls: list[str], stage: str) -> list[bytes]:
    return [
        requestformat.dumps(scrapy.Request(u, meta={"redislock_stage": stage}).to_dict())
        for u in urls
    ]


def status(redis_url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "scrapy_redislock", "status", "--url", redis_url, *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_a_pickle_payload_pushed_by_hand_runs_nothing_and_lands_in_the_dead_letter_list(
    redis_url: str, admin_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    target = tmp_path / "created-by-the-payload"
    payload = pickle.dumps({"url": "http://attacker.test/", "meta": {"x": CreatesAFile(target)}})
    truncated = safe_entries(["http://shop.test/a/truncated"], "a")[0][:25]
    with CrawlSite(delay=0.01) as site:
        urls = [f"{site.url}/a/{n}" for n in range(20)]
        good = safe_entries(urls, "a")
        # queued in this order
        push_raw(redis_client, "staged", "a", [*good[:10], payload, truncated, *good[10:]])
        worker = staged_worker(redis_url, site.url, "", {"REDISLOCK_WORKER_STAGES": {"a": 1}})
        output = finish(worker)
    assert not target.exists(), "the payload ran in the worker"
    assert sorted(site.hits) == sorted(f"/a/{n}" for n in range(20)) and set(
        site.hits.values()
    ) == {1}
    assert stat(output, "redislock/workers/dead_letters") == 2

    key = QueueKeys.of("redislock", "staged").deadletter
    letters = redis_client.lrange(key, 0, -1)
    assert len(letters) == 2
    notes = {}
    for letter in letters:
        note, stage, data = letter.split(b"\n", 2)
        assert stage == b"a"
        notes[data] = json.loads(note)
    assert set(notes) == {payload, truncated}  # kept byte for byte, for an operator to look at
    assert "not the JSON request format" in notes[payload]["error"]
    assert notes[payload]["queue"] == "redislock:{staged}:queue:a"
    # Logged once each, with the queue and a short escaped excerpt (no raw bytes, no newline from
    # the payload).
    lines = [line for line in output.splitlines() if "cannot be loaded" in line]
    assert len(lines) == 2, lines
    excerpt = repr(payload[:12])[:-1]  # b'\x80\x04\x95...
    assert any("redislock:{staged}:queue:a" in line and excerpt in line for line in lines), lines
    assert redis_client.llen("redislock:{staged}:queue:a") == 0 and held_slots(redis_client) == 0
    assert redis_client.keys("redislock:{staged}:inflight:*") == []

    shown = status(admin_url)
    assert shown.returncode == 0, shown.stderr
    assert (
        "DEAD LETTERS" in shown.stdout
        and "staged: 2 in redislock:{staged}:deadletter" in shown.stdout
    )
    data = json.loads(status(admin_url, "--json").stdout)
    (spider,) = data["dead_letters"]
    assert spider["spider"] == "staged" and spider["count"] == 2
    assert {d["size"] for d in spider["newest"]} == {len(payload), len(truncated)}


def test_every_to_dict_field_survives_the_queue_in_a_real_crawl(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Method, headers, cookies, body bytes, meta with plain data (tuples, bytes, non-str keys),
    callback and errback, priority, flags, dont_filter, cb_kwargs, Request subclasses: yielded by
    start(), queued in Redis, popped and rebuilt, compared in the callback (or errback) with what
    was yielded. A meta value that is not plain data is refused when queued, naming the request and
    the field; that request is lost, so the crawl does not finish cleanly."""
    with CrawlSite(delay=0) as site:
        settings = {
            "REDIS_URL": redis_url,
            "REDISLOCK_IDLE_CLOSE": 1,
            "TELNETCONSOLE_ENABLED": False,
        }
        spider = ROOT / "testing" / "spiders" / "roundtripspider.py"
        command = [sys.executable, "-m", "scrapy", "runspider", str(spider)]
        command += ["-a", f"base={site.url}", *settings_args(settings)]
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        output, _ = process.communicate(timeout=60)
        assert process.returncode == 1, output[-3000:]
        assert "'finish_reason': 'redislock_queue_lost'" in output
        assert site.bodies["/a/post"] == b"\x00\x01binary\xff"
        assert site.bodies["/a/form"] == b"q=shoes"
    assert stat(output, "test/roundtrip/same") == 4, output[-3000:]
    assert stat(output, "test/roundtrip/different") == 0
    assert stat(output, "test/roundtrip/errback") == 1
    assert (
        stat(output, "redislock/workers/a/enqueued")
        == stat(output, "redislock/workers/a/dequeued")
        == 4
    )
    assert stat(output, "redislock/workers/unqueueable") == 1
    refused = [line for line in output.splitlines() if "Refused <GET" in line]
    assert (
        len(refused) == 1
        and "/a/bad" in refused[0]
        and "meta['when'] is a datetime.datetime" in refused[0]
    )
    assert "/a/bad" not in site.hits
    assert redis_client.exists("redislock:{roundtrip}:deadletter") == 0


def test_a_request_queued_by_this_version_is_json_in_redis(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """What the queue holds is data anyone can read (jq, redis-cli), not pickle."""

    async def push() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        queues = StageQueues(client, "shop", ["a"])
        request = scrapy.Request(
            "http://shop.test/a/1", body=b"k=v", meta={"redislock_stage": "a", "n": (1, 2)}
        )
        await queues.push("a", "", requestformat.dumps(request.to_dict()))
        await client.aclose()

    asyncio.run(push())
    stored = json.loads(redis_client.lindex("redislock:{shop}:queue:a", 0))
    assert stored["url"] == "http://shop.test/a/1" and stored["body"] == {"$b": "k=v"}
    assert stored["meta"] == {"redislock_stage": "a", "n": {"$t": [1, 2]}}


def test_scheduler_serializer_pickle_is_honoured_when_chosen(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """scrapy-redis's setting: a user who needs pickle (meta with arbitrary objects) can choose
    it."""
    with CrawlSite(delay=0) as site:
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 1},
            "SCHEDULER_SERIALIZER": "scrapy_redis.picklecompat",
        }
        output = finish(staged_worker(redis_url, site.url, "a:5", settings))
        assert sorted(site.hits.values()) == [1] * 5
    assert stat(output, "redislock/workers/a/dequeued") == 5


def test_a_bad_scheduler_serializer_stops_the_worker_naming_the_setting(redis_url: str) -> None:
    settings = {"REDISLOCK_WORKER_STAGES": {"a": 1}, "SCHEDULER_SERIALIZER": "no_such_module"}
    worker = staged_worker(redis_url, "http://127.0.0.1:1", "a:1", settings)
    output, _ = worker.communicate(timeout=60)
    assert worker.returncode != 0
    assert re.search(r"SCHEDULER_SERIALIZER 'no_such_module' cannot be imported", output), output[
        -2000:
    ]


def test_a_file_url_or_a_private_callback_pushed_by_hand_lands_in_the_dead_letter_list(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Issue 41: whoever can push to a queue must make a worker neither read its files (Scrapy's
    file handler is on by default) nor call a private method or classmethod of the spider
    (``_set_crawler`` replaced spider.crawler with a Response)."""
    secret = tmp_path / "secret.txt"
    secret.write_text("contents-no-worker-may-read")
    entry = lambda **fields: requestformat.dumps({"meta": {"redislock_stage": "a"}, **fields})  # noqa: E731
    bad = [
        entry(url=secret.as_uri()),
        entry(url="data:text/plain,hello"),
        entry(url="http://shop.test/a/private", callback="_set_crawler"),
        entry(url="http://shop.test/a/cls", callback="from_crawler"),
    ]
    with CrawlSite(delay=0.01) as site:
        good = safe_entries([f"{site.url}/a/{n}" for n in range(5)], "a")
        push_raw(redis_client, "staged", "a", [*good[:2], *bad, *good[2:]])
        worker = staged_worker(redis_url, site.url, "", {"REDISLOCK_WORKER_STAGES": {"a": 1}})
        output = finish(worker)
    assert sorted(site.hits) == sorted(f"/a/{n}" for n in range(5))
    assert stat(output, "redislock/workers/dead_letters") == 4
    letters = redis_client.lrange(QueueKeys.of("redislock", "staged").deadletter, 0, -1)
    errors = sorted(json.loads(letter.split(b"\n", 1)[0])["error"] for letter in letters)
    assert [e.split(" ", 2)[1] for e in errors] == ["callback", "callback", "url", "url"], errors
    assert all("REDISLOCK_ALLOWED_SCHEMES (http, https)" in e for e in errors[2:]), errors
    assert all("is not a public method of the spider" in e for e in errors[:2]), errors
    assert "contents-no-worker-may-read" not in output
