"""crawl/engine.py with ``scrapy.utils.test.get_crawler``, no Redis: the start's log counter
(StartLogCount) on a fake clock (testing/clock.py), whose failed start's stats count what was logged
and span the whole wait for Redis; and when the engine counts as closing (engine_closing)."""

from __future__ import annotations

import asyncio
import logging
import time

from scrapy import Spider
from scrapy.core.engine import _Slot
from scrapy.utils.reactor import CallLaterOnce
from scrapy.utils.test import get_crawler

from scrapy_redislock.crawl.engine import StartLogCount, engine_closing
from testing.clock import FakeClock


def test_a_failed_starts_stats_count_its_warnings_and_span_its_wait() -> None:
    clock = FakeClock(100.0)
    crawler = get_crawler(Spider, {"LOG_LEVEL": "INFO"})
    counter = StartLogCount(crawler, clock)
    counter.install()
    try:
        logging.getLogger("scrapy_redislock.test").warning("Redis does not answer; retrying")
        logging.getLogger("scrapy_redislock.test").debug("below LOG_LEVEL: not counted")
        clock.advance(12.5)  # the start gave up after 12.5 s (REDISLOCK_CONNECT_TIMEOUT)
    finally:
        counter.hand_over()
    counter.timed_from_start()
    stats = crawler.stats
    assert stats is not None and counter not in logging.root.handlers
    assert stats.get_value("log_count/WARNING") == 1 and stats.get_value("log_count/DEBUG") is None
    assert stats.get_value("elapsed_time_seconds") == 12.5
    assert stats.get_value("start_time") == counter.began


class NamedSpider(Spider):
    name = "named"


def test_the_engine_closes_once_it_stops_or_closes_its_spider_and_not_while_it_starts() -> None:
    """engine_closing in each state Scrapy's ExecutionEngine passes through, its attributes set as
    start_async, close_spider_async and stop_async set them. While engine_started's handlers run
    (start_time set, running not yet) it is starting: a renewal round there once stood
    StageScheduler down for good. A spider closed meanwhile (CLOSESPIDER_TIMEOUT) is closing."""

    async def scenario() -> None:
        crawler = get_crawler(NamedSpider)
        crawler.spider = crawler._create_spider()
        engine = crawler.engine = crawler._create_engine()
        # the attributes the engine's start and stop set (a rename in Scrapy fails here, not silently)
        assert engine._starting is False and engine.start_time is None and not engine.running
        assert not engine_closing(crawler)  # before its start
        engine.start_time, engine._starting = time.time(), True  # engine_started's handlers run
        assert not engine_closing(crawler)
        engine._slot = _Slot(False, CallLaterOnce(lambda: None), scheduler=None)  # type: ignore[arg-type]
        assert not engine_closing(crawler)
        await engine._slot.close()  # the spider closes meanwhile
        assert engine_closing(crawler)
        engine._slot.closing = None
        engine.running = True  # it runs
        assert not engine_closing(crawler)
        engine.running = engine._starting = False  # stop_async
        assert engine_closing(crawler)

    asyncio.run(scenario())
