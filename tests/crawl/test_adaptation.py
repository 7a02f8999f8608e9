"""The crawl side of an adaptive limit (crawl/adaptive.py) against a real redis-server: when a
process reports what it saw of a lock. At every renewal tick; at once on an overload; and while
the lock's controller may be in its slow start, at once too, once its recorder holds half the
outcomes a window needs (a start's windows are due at a quarter of their length), until this
process commits one of its windows past the start."""

from __future__ import annotations

import asyncio

import pytest
import redis
from scrapy.settings import Settings

from scrapy_redislock.crawl.adaptive import Adaptation
from scrapy_redislock.crawl.connection import parse_url
from scrapy_redislock.crawl.settings import DEFAULT_CLIENT_PARAMS, read_settings
from scrapy_redislock.lock.adaptive import Recorder
from scrapy_redislock.lock.permit import LockKeys
from testing.waiting import until

pytestmark = pytest.mark.integration

KEYS = LockKeys.of("redislock", "detail")


def redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_a_slow_start_is_reported_early_until_this_process_commits_past_it(
    redis_client: redis.Redis, redis_url: str
) -> None:
    settings = read_settings(
        Settings(
            {
                "REDISLOCK_URL": redis_url,
                "REDISLOCK_STAGES": {"detail": 8},
                "REDISLOCK_ADAPTIVE": ["detail"],
            }
        )
    )
    now = [0.0]

    async def run() -> None:
        client = parse_url(redis_url, "REDISLOCK_URL").async_client(**DEFAULT_CLIENT_PARAMS)
        adaptation = Adaptation(client, settings, lambda name: 8, key_prefix="redislock")
        try:
            adaptation.recorders["detail"] = Recorder(clock=lambda: now[0])
            now[0] = 1.0  # the recorder is a window old: past a quarter of one
            for _ in range(4):  # 4 of the 10 outcomes a window needs: not yet
                adaptation.response("detail", 0.1, False)
            assert not adaptation.reporting
            adaptation.response("detail", 0.1, False)  # half of them: reported at once
            assert "detail" in adaptation.reporting
            await until(lambda: not adaptation.reporting, what="the early report")
            assert redis_client.hget(KEYS.adapt, "responses") == b"5"
            # a controller past its start (as after a probe), whose window this process commits
            redis_client.hset(KEYS.adapt, mapping={"limit": 4.0, "applied": 4, "version": 9})
            start = int(redis_client.hget(KEYS.adapt, "start") or 0)
            await until(lambda: redis_ms(redis_client) >= start + 1000, what="the window's time")
            adaptation.recorders["detail"] = Recorder(clock=lambda: now[0])
            for _ in range(10):
                adaptation.response("detail", 0.1, False)
            await adaptation.tick()  # the window, due, closes here: past the start
            assert redis_client.hget(KEYS.adapt, "version") == b"10"
            now[0] = 2.0
            adaptation.recorders["detail"] = Recorder(clock=lambda: now[0])
            now[0] = 3.0
            for _ in range(10):  # a whole window's outcomes: they wait for the tick
                adaptation.response("detail", 0.1, False)
            assert not adaptation.reporting
            adaptation.response("detail", 0.1, True)  # an overload still goes at once
            assert "detail" in adaptation.reporting
            await until(lambda: not adaptation.reporting, what="the overload's report")
        finally:
            adaptation.close()
            await client.aclose()

    asyncio.run(run())
