"""Extensions for crawl processes of the harness that watch the reactor thread.

- :class:`ReactorLagProbe`: a 10 ms timer on the reactor, re-armed as it fires, from spider_opened to
  spider_closed; how late each firing came is the reactor's lag (whatever blocked the thread: a
  blocking Redis call, a long callback). Stats ``test/reactor_lag/max_ms``, ``p99_ms``, ``p50_ms``,
  ``samples``, and ``over_<n>ms`` for the firings later than n ms (n of REACTOR_LAG_OVER_MS, default 1).
- :class:`BlockingRedisOnReactor`: counts the commands sent with redis-py's blocking client
  (``redis.connection``, not ``redis.asyncio``) from the reactor thread, from spider_opened until the
  engine has stopped (the scheduler's close included): stat ``test/redis_blocking_on_reactor``, and
  the first few of them (command names) in ``test/redis_blocking_on_reactor_sample``.

    "EXTENSIONS": {"testing.reactorlag.ReactorLagProbe": 0, "testing.reactorlag.BlockingRedisOnReactor": 0}
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

import redis.connection
from scrapy import signals

INTERVAL = 0.01  # s: the probe's timer
SAMPLE = 5  # blocking commands named in the stats


class ReactorLagProbe:
    """How late a 10 ms timer fires on the reactor thread (stats ``test/reactor_lag/*``)."""

    def __init__(self, crawler: Any) -> None:
        self.crawler = crawler
        self.over_ms = crawler.settings.getfloat("REACTOR_LAG_OVER_MS", 1.0)
        self.lags: list[float] = []
        self.task: asyncio.Task[None] | None = None
        crawler.signals.connect(self.opened, signal=signals.spider_opened)
        crawler.signals.connect(self.closed, signal=signals.spider_closed)

    @classmethod
    def from_crawler(cls, crawler: Any) -> ReactorLagProbe:
        return cls(crawler)

    def opened(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            armed = loop.time()
            await asyncio.sleep(INTERVAL)
            self.lags.append(max(0.0, loop.time() - armed - INTERVAL))

    def closed(self) -> None:
        if self.task is not None:
            self.task.cancel()
        lags = sorted(self.lags)
        if not lags:
            return
        stats = self.crawler.stats
        stats.set_value("test/reactor_lag/samples", len(lags))
        stats.set_value("test/reactor_lag/max_ms", round(lags[-1] * 1000, 2))
        stats.set_value("test/reactor_lag/p99_ms", round(_quantile(lags, 0.99) * 1000, 2))
        stats.set_value("test/reactor_lag/p50_ms", round(_quantile(lags, 0.5) * 1000, 2))
        over = self.over_ms / 1000
        stats.set_value(
            f"test/reactor_lag/over_{self.over_ms:g}ms", sum(1 for lag in lags if lag > over)
        )


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class BlockingRedisOnReactor:
    """Counts redis-py blocking-client commands sent from the reactor thread while the spider is
    open (stat ``test/redis_blocking_on_reactor``)."""

    def __init__(self, crawler: Any) -> None:
        self.crawler = crawler
        self.reactor_thread: int | None = None
        self.sample: list[str] = []
        crawler.stats.set_value("test/redis_blocking_on_reactor", 0)
        crawler.signals.connect(self.opened, signal=signals.spider_opened)
        crawler.signals.connect(self.stopped, signal=signals.engine_stopped)
        original = redis.connection.AbstractConnection.send_packed_command
        probe = self

        def send_packed_command(conn: Any, command: Any, check_health: bool = True) -> Any:
            if probe.reactor_thread is not None and threading.get_ident() == probe.reactor_thread:
                probe.count(command)
            return original(conn, command, check_health)

        redis.connection.AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]

    @classmethod
    def from_crawler(cls, crawler: Any) -> BlockingRedisOnReactor:
        return cls(crawler)

    def opened(self) -> None:
        self.reactor_thread = threading.get_ident()

    def stopped(self) -> None:
        self.reactor_thread = None

    def count(self, command: Any) -> None:
        self.crawler.stats.inc_value("test/redis_blocking_on_reactor")
        if len(self.sample) < SAMPLE:
            packed = command if isinstance(command, bytes | str) else b"".join(command)
            text = packed.decode(errors="replace") if isinstance(packed, bytes) else packed
            # the RESP array's first bulk string: the command's name
            parts = text.split("\r\n")
            self.sample.append(parts[2] if len(parts) > 2 else text[:20])
            self.crawler.stats.set_value("test/redis_blocking_on_reactor_sample", list(self.sample))
