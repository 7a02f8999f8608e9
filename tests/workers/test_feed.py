"""The start-URL feed of a worker (scrapy_redislock/workers/feed.py) against a real redis-server behind
the user-space proxy (testing/netproxy.py), whose replies can be lost while the commands still run:
a take whose reply was lost answers the same entries when asked again, or goes back to the feed at
close; the wait for start URLs takes nothing, so a wait whose reply was lost loses nothing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from scrapy import Request, Spider, signals
from scrapy.utils.test import get_crawler

from scrapy_redislock.crawl.reach import REDIS_ERRORS
from scrapy_redislock.crawl.stages import STAGE_META
from scrapy_redislock.workers import scheduler as worker_scheduler
from scrapy_redislock.workers.feed import StartUrlFeed
from scrapy_redislock.workers.mixin import StageWorkerMixin
from scrapy_redislock.workers.queue import StageQueues
from scrapy_redislock.workers.scheduler import StageWorkerScheduler
from testing.netproxy import LatencyProxy
from testing.waiting import until

pytestmark = pytest.mark.integration

FEED = "shop:start_urls"
ENTRIES = [f"http://shop.test/list/{n}".encode() for n in range(5)]


class FeedSpider(StageWorkerMixin, Spider):
    name = "shop"
    redis_key = FEED
    worker_stages = {"list": 1}

    def make_request_from_data(self, data: bytes) -> Request:
        return Request(data.decode())


def proxied(redis_url: str, proxy: LatencyProxy) -> redis.asyncio.Redis:
    """A client through ``proxy``: one try, and a timeout no busy machine's reply reaches once the
    network is back."""
    port = urlsplit(redis_url).port
    return redis.asyncio.Redis.from_url(
        redis_url.replace(f":{port}", f":{proxy.port}", 1),
        socket_timeout=2.0,
        retry=Retry(NoBackoff(), 0),
    )


async def through(
    proxy: LatencyProxy, redis_url: str, crawler: Any
) -> tuple[StageWorkerScheduler, StartUrlFeed]:
    """A worker scheduler whose feed and outbox reach Redis through ``proxy`` (worker ``w1``, the
    feed's take script loaded: the network may go silent from now on)."""
    scheduler = StageWorkerScheduler(crawler)
    queues = StageQueues(proxied(redis_url, proxy), "shop", ["list"], worker="w1")
    scheduler.outbox.queues = queues
    scheduler.listener.feed = feed = StartUrlFeed(queues, crawler.spider, "list", 3)
    assert await feed.give_back() == 0
    return scheduler, feed


def fill(client: redis.Redis, how: str) -> None:
    if how == "list":
        client.rpush(FEED, *ENTRIES)
    elif how == "set":
        client.sadd(FEED, *ENTRIES)
    else:
        client.zadd(FEED, {entry: n for n, entry in enumerate(ENTRIES)})


def left(client: redis.Redis, how: str) -> Any:
    """What the feed holds: in order for a list, with scores for a sorted set."""
    if how == "list":
        return client.lrange(FEED, 0, -1)
    if how == "set":
        return client.smembers(FEED)
    return client.zrange(FEED, 0, -1, withscores=True)


def blocked_waits(client: redis.Redis) -> int:
    """Connections blocked in a BLMOVE now (the wait for start URLs)."""
    listed = client.execute_command("CLIENT", "LIST", "TYPE", "normal").decode().splitlines()
    fields = [dict(part.split("=", 1) for part in line.split() if "=" in part) for line in listed]
    return sum(1 for f in fields if f.get("cmd") == "blmove" and "b" in f.get("flags", ""))


@pytest.mark.parametrize("how", ["list", "set", "zset"])
@pytest.mark.parametrize("then", ["asked-again", "closed"])
def test_a_take_whose_reply_was_lost_answers_the_same_entries_or_goes_back_at_close(
    redis_url: str,
    redis_client: redis.Redis,
    redis_proxy: Callable[[], LatencyProxy],
    how: str,
    then: str,
) -> None:
    """Five start URLs, taken three at a time through a network that carries the take and loses
    its reply: three are out of the feed, and the worker has none. Asked again, the take answers
    those three (not the next two, which scrapy-redis's pop would have answered, the three lost);
    closed instead, the three go back to the feed, a list's in their order, a sorted set's with
    their scores. Either way the record goes at close."""
    fill(redis_client, how)
    before = left(redis_client, how)

    async def main() -> None:
        proxy = redis_proxy()
        client = proxied(redis_url, proxy)
        queues = StageQueues(client, "shop", ["list"], worker="w1")
        feed = StartUrlFeed(queues, FeedSpider(), how, 3)
        assert await feed.give_back() == 0  # connected, the script loaded
        proxy.blackhole("down")
        with pytest.raises(REDIS_ERRORS):
            await feed.read()
        assert feed.unanswered
        assert redis_client.exists(feed.record)
        proxy.heal()
        await client.aclose()  # the connection the lost reply left behind
        if then == "asked-again":
            taken = await feed.read()
            assert len(taken) == 3 and set(taken) <= set(ENTRIES)
            rest = await feed.read()
            assert sorted(taken + rest) == sorted(ENTRIES)
            assert await feed.read() == []
            assert await feed.give_back() == 0  # answered: nothing goes back
            assert redis_client.exists(FEED) == 0
        else:
            assert await feed.give_back() == 3
            assert left(redis_client, how) == before
        assert not redis_client.keys("redislock:feed:*")
        await client.aclose()

    asyncio.run(main())


def test_the_wait_for_start_urls_takes_nothing_so_a_lost_reply_loses_nothing(
    redis_url: str, redis_client: redis.Redis, redis_proxy: Callable[[], LatencyProxy]
) -> None:
    """An idle worker waits on a list feed; a start URL pushed while the wait's reply is lost on
    the way stays in the feed, for the take (BLPOP, which the wait was before, had taken it out of
    Redis and lost it); a wait on a feed with an entry returns at once and leaves the entry."""

    async def main() -> None:
        proxy = redis_proxy()
        client = proxied(redis_url, proxy)
        queues = StageQueues(client, "shop", ["list"], worker="w1")
        waiting = asyncio.create_task(queues.blocking.wait_for_entry(FEED, 30.0))
        await asyncio.sleep(0)
        await until(lambda: blocked_waits(redis_client) == 1, 10, "the wait to block in Redis")
        proxy.blackhole("down")
        redis_client.rpush(FEED, ENTRIES[0])
        await until(lambda: blocked_waits(redis_client) == 0, 10, "the wait to be served")
        # its reply is lost on the way
        waiting.cancel()
        assert redis_client.lrange(FEED, 0, -1) == [ENTRIES[0]]
        proxy.heal()
        assert await queues.blocking.wait_for_entry(FEED, 5.0)
        assert redis_client.lrange(FEED, 0, -1) == [ENTRIES[0]]
        await queues.aclose()
        await client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("redis_answers", [True, False], ids=["given-back", "redis-out"])
def test_at_close_an_unanswered_take_goes_back_or_the_crawl_does_not_finish_cleanly(
    redis_url: str,
    redis_client: redis.Redis,
    redis_proxy: Callable[[], LatencyProxy],
    caplog: pytest.LogCaptureFixture,
    redis_answers: bool,
) -> None:
    """The worker scheduler's close gives the start URLs of a take whose reply never came back to
    the feed (INFO, counted); if Redis does not answer then either, they are lost to this crawl:
    ERROR naming the record they may be in, counted, and the finish reason is not ``finished``."""
    redis_client.rpush(FEED, *ENTRIES)
    crawler = get_crawler(FeedSpider, {"REDISLOCK_URL": redis_url})
    crawler.spider = spider = FeedSpider()
    stats: Any = crawler.stats

    async def main() -> None:
        proxy = redis_proxy()
        scheduler, feed = await through(proxy, redis_url, crawler)
        client = feed.queues.client
        proxy.blackhole("down")
        with pytest.raises(REDIS_ERRORS):
            await feed.read()
        if redis_answers:
            proxy.heal()
            await client.aclose()
        else:
            proxy.blackhole()  # nothing reaches Redis any more
        with caplog.at_level(logging.INFO):
            await scheduler._give_back_start_urls()
        proxy.heal()
        await client.aclose()

    asyncio.run(main())
    if redis_answers:
        assert redis_client.lrange(FEED, 0, -1) == ENTRIES
        assert stats.get_value("redislock/workers/start_urls_returned") == 3
        assert (
            "3 start URL(s) of a take that got no reply, or whose requests may not have reached"
            f" Redis, went back to {FEED}" in caplog.text
        )
    else:
        assert redis_client.lrange(FEED, 0, -1) == ENTRIES[3:]
        assert stats.get_value("redislock/workers/start_urls_unreturned") == 1
        assert (
            "Closing: a take of up to 3 start URLs from shop:start_urls that got no reply, or whose"
            " requests may not have reached Redis, could not be given back" in caplog.text
        )
        assert (
            "is in redislock:feed:{shop:start_urls}:taken:w1:shop:start_urls for a day"
            in caplog.text
        )
        stats.set_value("finish_reason", "finished")  # as CoreStats sets it on spider_closed
        crawler.signals.send_catch_log(
            signal=signals.spider_closed, spider=spider, reason="finished"
        )
        assert stats.get_value("finish_reason") == "redislock_start_urls_lost"


class StagedFeedSpider(FeedSpider):
    def make_request_from_data(self, data: bytes) -> Request:
        return Request(data.decode(), meta={STAGE_META: "list"})


@pytest.mark.parametrize("network", ["back", "still-out"])
def test_a_take_whose_requests_never_reached_their_queue_is_said_lost_and_goes_back_to_the_feed(
    redis_url: str,
    redis_client: redis.Redis,
    redis_proxy: Callable[[], LatencyProxy],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    network: str,
) -> None:
    """A take answered, the network goes silent while its requests are on their way to their
    stage's queue, and close cuts the worker loop's step off: the sends are not cancelled with it.
    Back within close's bounded wait, they all reach the queue, and the take's record goes. Still
    out, they are cancelled (nothing writes to Redis once close moved on), said at ERROR, counted,
    the crawl finishes as ``redislock_queue_lost``, and the take's start URLs go back to the feed
    once Redis answers."""
    monkeypatch.setattr(worker_scheduler, "CLOSE_STEP_TIMEOUT", 20.0 if network == "back" else 1.0)
    redis_client.rpush(FEED, *ENTRIES)
    crawler = get_crawler(StagedFeedSpider, {"REDISLOCK_URL": redis_url})
    crawler.spider = spider = StagedFeedSpider()
    stats: Any = crawler.stats

    async def main() -> None:
        proxy = redis_proxy()
        scheduler, feed = await through(proxy, redis_url, crawler)
        client = feed.queues.client

        class Engine:
            """What the worker loop asks of Scrapy's engine: crawl() schedules."""

            def crawl(self, request: Request) -> None:
                proxy.blackhole()  # silent from the take's reply on
                scheduler.enqueue_request(request)

        crawler.engine = Engine()  # type: ignore[assignment]
        step = asyncio.get_running_loop().create_task(scheduler.loop.feed())
        await until(lambda: scheduler.outbox.sending == 3)
        step.cancel()  # close cuts a step that hangs off
        await asyncio.wait({step})
        pushes = set(scheduler.outbox.pushes)
        assert pushes and not any(task.done() for task in pushes)
        if network == "back":
            proxy.heal()
        with caplog.at_level(logging.INFO):
            await scheduler._last_pushes()
            assert all(task.done() for task in pushes) and not scheduler.outbox.pushes
            # the network stays cut (what it held never arrives); Redis answers the worker again
            proxy.close()
            await client.aclose()
            direct = redis.asyncio.Redis.from_url(redis_url)
            feed.queues = queues = StageQueues(direct, "shop", ["list"], worker="w1")
            await scheduler._give_back_start_urls()
        lengths, _ = await queues.look()
        if network == "back":
            assert lengths == {"list": 3}
            assert redis_client.lrange(FEED, 0, -1) == ENTRIES[3:]
        else:
            assert lengths == {"list": 0}
            assert redis_client.lrange(FEED, 0, -1) == ENTRIES
        assert not redis_client.keys("redislock:feed:*")
        await direct.aclose()

    asyncio.run(main())
    said = "request(s) yielded by callbacks or start requests may not have reached Redis"
    stats.set_value("finish_reason", "finished")  # as CoreStats sets it on spider_closed
    crawler.signals.send_catch_log(signal=signals.spider_closed, spider=spider, reason="finished")
    if network == "back":
        assert said not in caplog.text
        assert stats.get_value("finish_reason") == "finished"
    else:
        assert f"Closing: 3 {said}" in caplog.text
        assert stats.get_value("redislock/workers/unqueued") == 3
        assert stats.get_value("finish_reason") == "redislock_queue_lost"
