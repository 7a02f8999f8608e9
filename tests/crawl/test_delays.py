"""Delays in-process (scrapy.utils.test.get_crawler, a real Redis, no crawl): starts a delay apart
and rate windows on Redis's clock, and the end of the delays with their registry on every close
path. The delays as a site sees them across processes are in tests/requests/test_keys.py and
tests/requests/test_scopes.py."""

from __future__ import annotations

import asyncio

import pytest
import redis

from scrapy_redislock.crawl.delays import RATE_PRUNE_AT, Delays
from scrapy_redislock.lock.delay import confirm_start, delay_keys
from scrapy_redislock.lock.protocol import adrive
from testing.inprocess import front
from testing.netproxy import LatencyProxy
from testing.waiting import until

pytestmark = pytest.mark.integration

# starts are confirmed on Redis's clock, in whole microseconds, against the previous confirmed one:
# exact but for the float division of microseconds to seconds
TOLERANCE = 0.001


def test_starts_keep_their_delay_and_rates_their_window_and_a_forced_shutdown_ends_them(
    redis_url: str,
) -> None:
    """Two starts of one name are at least its delay apart, and three with room for two per window
    are a window apart, on Redis's clock. A forced shutdown (the renewal loop's unclean close)
    closes the keys' registry, and the delays with it (they retry no Redis error after)."""

    async def scenario() -> None:
        async with front(redis_url, {"detail": None}, REDISLOCK_STAGE_KEY="domain") as f:
            throttle = f.middleware.throttle
            assert throttle is not None
            delays = throttle.delays
            first = await delays.wait_start("key:a", 0.2)
            second = await delays.wait_start("key:a", 0.2)
            assert second.at - first.at >= 0.2 - TOLERANCE
            starts = [(await delays.wait_rate("key:r", 2, 0.3)).at for _ in range(3)]
            assert starts[2] - starts[0] >= 0.3 - TOLERANCE
            assert not delays.closed
            await f.slots.close_unclean()
            assert delays.closed and throttle.locks.closed

    asyncio.run(scenario())


def test_a_request_queued_behind_another_for_a_rate_window_holds_its_earlier_starts(
    redis_url: str,
) -> None:
    """One start per 2 s on ``key:r``. R1 takes it; R2 waits for the window (this process's one
    wait for it); R3, whose host start ``key:h`` (gap 0.5 s) is confirmed, queues behind R2. While
    it waits, its host start is moved ahead: another process confirming the host 0.6 s later is
    told to wait (before, it was let through while R3 still waited, and R3 then went out right
    after it)."""

    async def scenario() -> None:
        async with front(redis_url, {"detail": None}, REDISLOCK_STAGE_KEY="domain") as f:
            throttle = f.middleware.throttle
            assert throttle is not None
            delays, stats = throttle.delays, f.crawler.stats
            await delays.wait_rate("key:r", 1, 2.0)  # R1
            second = asyncio.ensure_future(delays.wait_rate("key:r", 1, 2.0))  # R2
            host = await delays.wait_start("key:h", 0.5)
            third = asyncio.ensure_future(delays.wait_rate("key:r", 1, 2.0, [host]))  # R3
            await until(lambda: delays.clock() - host.confirmed > 0.6)
            assert not second.done()  # R3 still queued behind R2's wait
            keys = delay_keys("redislock", "key:h")
            wait, _ = await adrive(confirm_start(keys, 0.5), delays.runner, "key:h")
            assert wait > 0  # held for R3
            assert stats.get_value("redislock/delay/held_back_starts") >= 2
            third.cancel()
            second.cancel()
            await asyncio.gather(second, third, return_exceptions=True)

    asyncio.run(scenario())


def test_a_full_rate_window_stays_held_for_a_window_while_its_freed_places_are_taken(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Five starts per 4 s on ``key:r``, its window filled by five other processes' starts that
    pass at the same moment (1.5 s on), as a burst's do. C is told to wait (the window is found
    full); D, lined up behind C, and E, after both, find room at once, with places left, when C's
    wait freed all five: the window stays held (before, D's or E's try lifted it, and every
    request queued in StageScheduler left to wait in the downloader, each window). A window of
    two per 0.3 s whose last place a start took is held, till a try a window later finds room and
    leaves some. A stage's window found full is held too (an uncapped stage's requests wait in
    StageScheduler, as a key's do)."""

    async def scenario() -> None:
        async with front(redis_url, {"detail": None}, REDISLOCK_STAGE_KEY="domain") as f:
            throttle = f.middleware.throttle
            assert throttle is not None
            delays = throttle.delays
            seconds, micros = redis_client.time()
            passing = seconds * 1_000_000 + micros - 2_500_000  # they leave the window in 1.5 s
            log = delay_keys("redislock", "key:r").rate
            redis_client.zadd(log, {f"other-{n}": passing for n in range(5)})
            redis_client.pexpire(log, 10_000)
            c = asyncio.ensure_future(delays.wait_rate("key:r", 5, 4.0))
            d = asyncio.ensure_future(delays.wait_rate("key:r", 5, 4.0))
            c_start, d_start = await asyncio.gather(c, d)
            assert c_start.waited > 0 and d_start.waited == 0  # D found room at once
            assert delays.rate_full("key:r")
            e_start = await delays.wait_rate("key:r", 5, 4.0)
            assert e_start.waited == 0 and delays.rate_full("key:r")  # E too, not lined up
            await delays.wait_rate("key:s", 2, 0.3)
            assert not delays.rate_full("key:s")  # a place left
            await delays.wait_rate("key:s", 2, 0.3)
            assert delays.rate_full("key:s")  # the last place taken
            await until(lambda: delays._passed("key:s"))
            assert not (await delays.wait_rate("key:s", 2, 0.3)).waited
            assert not delays.rate_full("key:s")  # room, and a place left, a window later
            while not (await delays.wait_rate("detail", 1, 1.0)).waited:
                pass  # a stage's window, till a try is told to wait
            assert delays.rate_full("detail")

    asyncio.run(scenario())


def test_the_windows_found_full_that_have_passed_are_dropped_once_the_table_doubles() -> None:
    """Pure: a crawl of many rate-limited sites keeps no entry per site for ever; a window still
    within its time stays held."""
    now = [0.0]
    delays = Delays(None, "redislock", None, randomize=False, clock=lambda: now[0])  # type: ignore[arg-type]
    for n in range(RATE_PRUNE_AT - 1):
        delays._found_full(f"key:site{n}", 1.0)
    now[0] = 5.0
    delays._found_full("key:late", 10.0)  # the table is full: the passed ones go
    assert delays.rate_full("key:late") and not delays.rate_full("key:site0")
    assert delays.rate_waiting() and not delays.rate_waiting("key:late")  # no try waits for it


def test_a_start_whose_reply_was_held_up_counts_as_sent_late(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Redis confirms a start, but its reply takes 0.5 s to come back (a slow network, a stall
    before it is read). The request goes out as soon as the reply came: 0.5 s after Redis confirmed
    it. That counts as a late send, and the name's next start keeps its whole gap (1 s) after it;
    before, lateness was counted from the reply, and another process could start 0.5 s after it."""
    with LatencyProxy(redis_client.connection_pool.connection_kwargs["port"]) as proxy:

        async def scenario() -> None:
            async with front(proxy.url, {"detail": None}, REDISLOCK_STAGE_KEY="domain") as f:
                throttle = f.middleware.throttle
                assert throttle is not None
                delays, stats = throttle.delays, f.crawler.stats
                proxy.down = 0.5
                start = await delays.wait_start("key:a", 1.0)
                proxy.down = 0.0
                delays.went_out(start)  # out the moment the reply came
                assert stats.get_value("redislock/delay/late_sends") == 1
                await until(lambda: not delays._pushes)
                keys = delay_keys("redislock", "key:a")
                wait, now = await adrive(confirm_start(keys, 1.0), delays.runner, "key:a")
                assert now + wait >= start.at + 0.5 + 1.0 - TOLERANCE

        asyncio.run(scenario())
