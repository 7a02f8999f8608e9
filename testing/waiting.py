"""Wait for a condition with a timeout: the tests' one poll loop (a test waits for what it needs,
never for a fixed time).

    wait_until(lambda: blocked(client) == 2, 10, "both waiters blocked")   # seconds it took
    wait_until(cond, 60, "the pages", ended=lambda: None if worker.poll() is None else "it exited")
    await until(lambda: leftover(client) == 0)                             # on an asyncio loop
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(
    condition: Callable[[], object],
    timeout: float,
    what: str,
    *,
    step: float = 0.01,
    ended: Callable[[], str | None] | None = None,
    detail: Callable[[], object] | None = None,
    ignore: tuple[type[Exception], ...] = (),
) -> float:
    """Poll ``condition()`` every ``step`` s until it is truthy; the seconds that took.

    After ``timeout`` s, AssertionError naming ``what`` and the timeout, with ``detail()`` (say a
    process's output, computed only then). ``ended()``, asked at every poll, returns why waiting
    is pointless (the process waited on exited, with its output) to fail at once rather than at
    the timeout. An exception of ``ignore`` from ``condition()`` means "not yet" (a page element
    re-rendered while it was read)."""
    began = time.monotonic()
    while True:
        try:
            if condition():
                return time.monotonic() - began
        except ignore:
            pass
        if ended is not None and (why := ended()) is not None:
            raise AssertionError(f"gave up waiting for {what}: {why}")
        if time.monotonic() - began > timeout:
            more = "" if detail is None else f"\n{detail()}"
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{more}")
        time.sleep(step)


async def until(
    condition: Callable[[], object],
    timeout: float = 10.0,
    what: str = "the condition",
    *,
    step: float = 0.005,
) -> float:
    """:func:`wait_until` on an asyncio loop: it sleeps with ``asyncio.sleep``, so the loop's other
    tasks (the code under test) run meanwhile."""
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(step)
    return time.monotonic() - began
