"""The package's one periodic loop and its task stopper (``scrapy_redislock._loop``): pure asyncio,
no Redis."""

from __future__ import annotations

import asyncio

import pytest

from scrapy_redislock._loop import every, stop


def test_a_loop_cancelled_as_it_is_woken_stops() -> None:
    """Python 3.11's ``asyncio.wait_for`` drops a cancel that comes as the awaited thing finishes
    (gh-86296)."""

    async def main() -> None:
        ticks: list[int] = []
        wake = asyncio.Event()

        async def tick() -> bool:
            ticks.append(1)
            return True

        loop = asyncio.create_task(every(lambda: 60.0, tick, what="test loop", wake=wake))
        while not wake._waiters:  # type: ignore[attr-defined]  # the loop waits for its wake-up now
            await asyncio.sleep(0)
        wake.set()
        loop.cancel()  # in the same instant
        done, _ = await asyncio.wait({loop}, timeout=5)
        assert done and loop.cancelled() and ticks == []

    asyncio.run(main())


def test_stopping_a_task_does_not_swallow_the_callers_own_cancellation() -> None:
    async def main() -> None:
        may_end = asyncio.Event()

        async def slow_to_end() -> None:
            try:
                await asyncio.sleep(60)
            finally:
                await may_end.wait()

        target = asyncio.create_task(slow_to_end())
        await asyncio.sleep(0)
        stopper = asyncio.create_task(stop(target))
        while not may_end._waiters:  # type: ignore[attr-defined]  # the target got its cancel and is ending
            await asyncio.sleep(0)
        stopper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopper
        may_end.set()
        await asyncio.wait({target})
        assert target.cancelled()

    asyncio.run(main())
