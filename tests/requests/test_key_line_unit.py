"""KeyLine in-process (scrapy.utils.test.get_crawler, a real Redis behind a proxy, no crawl): what
happens to a request held back for its key slot when the engine closes. The real crawls are in
test_key_line.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from testing.inprocess import front, request
from testing.netproxy import LatencyProxy
from testing.waiting import until

pytestmark = pytest.mark.integration


def test_a_request_held_back_for_a_take_when_the_engine_closes_stays_queued(
    redis_proxy: Callable[[], LatencyProxy],
) -> None:
    """Redis does not answer the take of a request's key slot (out of reach) when the engine
    closes: the renewal tick's stand-down cancels the take, and the request goes back into its
    key's queue (JOBDIR keeps it), not lost (it once was: 1 request queued, 0 after)."""
    proxy = redis_proxy()

    async def scenario() -> None:
        async with front(
            proxy.url,
            {"detail": None},
            REDISLOCK_STAGE_KEY="domain",
            REDISLOCK_KEY_LIMIT=1,
        ) as f:
            scheduler = f.scheduler
            assert scheduler is not None and scheduler.keyline is not None
            line = scheduler.keyline
            held_back = request(None, 0)
            scheduler.enqueue_request(held_back)
            assert len(scheduler) == 1
            proxy.blackhole()  # the take goes nowhere and no answer comes
            assert scheduler.next_request() is None  # held back for one take in Redis
            assert list(line.looking) == [held_back]
            await until(lambda: bool(line.locks._taking))  # the take is under way
            f.crawler.engine.start_time = time.time()  # type: ignore[union-attr]  # it stopped: closing
            await scheduler.tick()  # the engine closes: the line stands down
            await until(lambda: not line.tasks)
            # back in its key's queue (once: 0, the take's end forgot it), where close() leaves it
            assert scheduler.has_pending_requests() and len(scheduler) == 1, len(scheduler)
            assert not line.looking and not line.ready
            proxy.heal()

    asyncio.run(scenario())
