"""The outbox of a worker (scrapy_redislock/workers/outbox.py) against a real redis-server: requests
Redis refuses to queue are lost, so they are said, counted, keep the requests that yielded them in
the in-flight record, and the crawl does not finish cleanly."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import redis
from scrapy import Request, Spider, signals
from scrapy.utils.test import get_crawler

from scrapy_redislock.crawl.stages import STAGE_META
from scrapy_redislock.workers.mixin import StageWorkerMixin
from scrapy_redislock.workers.scheduler import StageWorkerScheduler

pytestmark = pytest.mark.integration


class ShopSpider(StageWorkerMixin, Spider):
    name = "shop"
    worker_stages = {"list": 1}


def test_requests_redis_refuses_are_said_lost_and_their_parent_stays_in_the_record(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A popped request yields one that Redis refuses to queue (out of memory): ERROR, counted in
    ``redislock/workers/unqueueable``, and the crawl finishes as ``redislock_queue_lost``. The
    parent, acknowledged once that send is over, stays in the worker's in-flight record (it goes
    back to its queue at close, and is fetched again); a request handed out after the loss leaves
    the record when acknowledged. (The parent's acknowledgement once looked only at the sends still
    under way then, and a refused send that ended first let it go.)"""
    crawler = get_crawler(ShopSpider, {"REDISLOCK_URL": redis_url})
    crawler.spider = spider = ShopSpider()
    stats: Any = crawler.stats
    stage = "list"

    async def main() -> None:
        scheduler = StageWorkerScheduler(crawler)
        queues, outbox, inflight = scheduler.queues, scheduler.outbox, scheduler.inflight

        def entry(path: str) -> tuple[str, str, bytes, int, Request]:
            request = Request(f"http://shop.test/{path}", meta={STAGE_META: stage})
            fingerprint = crawler.request_fingerprinter.fingerprint(request).hex()
            return stage, fingerprint, scheduler.encode(request), 0, request

        assert await queues.push(*entry("parent")[:4])
        assert await queues.push(*entry("later")[:4])
        assert await queues.beat(stage)
        popped = await queues.pop(stage, 2) or []
        (parent_id, _), (later_id, _) = popped
        inflight.buffer.append((entry("parent")[4], parent_id))
        assert inflight.hand() is not None  # handed to the engine: its callback runs
        redis_client.config_set("maxmemory", "1")  # every write that may grow memory is refused
        try:
            outbox.put(entry("child"))
            with caplog.at_level(logging.ERROR):
                await outbox.sent()  # refused, and over before the parent is acknowledged
        finally:
            redis_client.config_set("maxmemory", "0")
        inflight.buffer.append((entry("later")[4], later_id))
        assert inflight.hand() is not None  # handed after the loss
        await inflight._ack([parent_id, later_id], set(outbox.pushes))
        assert redis_client.hexists(queues.inflight_key, parent_id)
        assert not redis_client.hexists(queues.inflight_key, later_id)
        await scheduler.locks.close()

    asyncio.run(main())
    assert stats.get_value("redislock/workers/unqueueable") == 1
    assert (
        "Dropped 1 requests: Redis refused to queue them (command not allowed when used memory"
        in caplog.text
    )
    stats.set_value("finish_reason", "finished")  # as CoreStats sets it on spider_closed
    crawler.signals.send_catch_log(signal=signals.spider_closed, spider=spider, reason="finished")
    assert stats.get_value("finish_reason") == "redislock_queue_lost"
