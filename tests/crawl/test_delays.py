"""Delays in-process (scrapy.utils.test.get_crawler, a real Redis, no crawl): starts a delay apart
and rate windows on Redis's clock, and the end of the delays with their registry on every close
path. The delays as a site sees them across processes are in tests/requests/test_keys.py and
tests/requests/test_scopes.py."""

from __future__ import annotations

import asyncio

import pytest

from testing.inprocess import front

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
