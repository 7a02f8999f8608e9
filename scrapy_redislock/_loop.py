"""The one periodic loop of the package's asyncio code: tick every interval, at once when woken,
until told to stop;
:func:`start_now`, a task that starts running in the caller's call (from Python 3.12 on); and
:func:`stop`, which ends a task without swallowing the caller's own cancellation.

A tick that raises is logged and the loop goes on (nothing is given up on a Redis error); with a
:class:`~scrapy_redislock._redis.Backoff` the next tick after a failure comes after its delay
instead of the interval. Imports neither Scrapy nor Twisted: the asyncio lock and the Scrapy
glue both use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from scrapy_redislock._redis import Backoff

logger = logging.getLogger(__name__)

Tick = Callable[[], Awaitable[bool | None]]
T = TypeVar("T")


def start_now(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task that runs up to its first real wait at once (asyncio's eager start, Python 3.12+): a
    command it sends leaves in this call, not after every other callback of this loop iteration.
    Python 3.11: a plain task."""
    loop = asyncio.get_running_loop()
    eager = getattr(asyncio, "eager_task_factory", None)
    return eager(loop, coro) if eager is not None else loop.create_task(coro)


async def stop(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has ended; a cancellation of the caller meanwhile is not
    swallowed (as ``suppress(CancelledError)`` around ``await task`` would)."""
    task.cancel()
    await asyncio.wait({task})


async def every(
    interval: Callable[[], float],
    tick: Tick,
    *,
    what: str,
    wake: asyncio.Event | None = None,
    backoff: Backoff | None = None,
) -> None:
    """Await ``tick()`` after each ``interval()`` seconds (or as soon as ``wake`` is set) until it
    returns False.

    ``what`` names the job in the log line of a failed tick.
    """
    delay = interval()
    while True:
        if wake is None:
            await asyncio.sleep(delay)
        else:
            with contextlib.suppress(TimeoutError):
                # not wait_for: on 3.11 it can drop this task's cancellation
                async with asyncio.timeout(delay):
                    await wake.wait()
            wake.clear()
        try:
            if await tick() is False:
                return
        except Exception:
            delay = backoff.next() if backoff is not None else interval()
            logger.exception("%s failed; retrying in %.1f s", what, delay)
            continue
        if backoff is not None:
            backoff.reset()
        delay = interval()
