"""The start's log counter (crawl/engine.py StartLogCount) on a fake clock (testing/clock.py), built
with ``scrapy.utils.test.get_crawler``, no Redis: a failed start's stats count what was logged and
span the whole wait for Redis."""

from __future__ import annotations

import logging

from scrapy import Spider
from scrapy.utils.test import get_crawler

from scrapy_redislock.crawl.engine import StartLogCount
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
