"""The process's one renewal loop (one per event loop): its members are the request front (which
runs its registries' ticks after its own upkeep) and the worker front's StageLocks, and every
``ttl/3`` (at most 1 s) it runs each member's tick at once.

When the loop is torn down with members still open (a forced shutdown without a Twisted reactor
cancels every task), it frees their slots (``close_unclean``) before it goes: the TTL would keep
them from the others otherwise.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable
from typing import Any, Protocol

from scrapy_redislock._loop import every


class Member(Protocol):
    """What the loop runs (a front's registries' renewals)."""

    @property
    def renew_interval(self) -> float: ...

    async def tick(self) -> None: ...

    async def close_unclean(self) -> None: ...


class Renewer:
    """The process's one renewal loop: runs the tick of every member that joined, all at once."""

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Renewer] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self) -> None:
        self.members: set[Member] = set()
        self.task: asyncio.Task[None] | None = None

    @classmethod
    def current(cls) -> Renewer:
        loop = asyncio.get_running_loop()
        renewer = cls._by_loop.get(loop)
        if renewer is None:
            renewer = cls._by_loop[loop] = cls()
        return renewer

    def join(self, member: Member) -> None:
        self.members.add(member)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(
                self._run(), name="redislock-renewer"
            )

    def leave(self, member: Member) -> None:
        self.members.discard(member)
        if not self.members and self.task is not None:
            self.task.cancel()
            self.task = None

    def _interval(self) -> float:
        return min((m.renew_interval for m in self.members), default=1.0)

    async def _tick(self) -> bool:
        if not self.members:
            return False
        await asyncio.gather(*(m.tick() for m in list(self.members)), return_exceptions=True)
        return bool(self.members)

    async def _run(self) -> None:
        try:
            await every(self._interval, self._tick, what="renewing stage locks")
        except asyncio.CancelledError:
            if self.task is not asyncio.current_task():
                raise  # the last member left (leave()); one may have joined since, with a new task
            # Cancelled with members still open: the loop is being torn down (a forced shutdown
            # without a Twisted reactor cancels every task). Free their slots now; the TTL would
            # keep them for others otherwise.
            self.task = None  # their close() must not cancel this task again
            await asyncio.gather(
                *(m.close_unclean() for m in list(self.members)), return_exceptions=True
            )
            raise


async def gather_bounded(coros: list[Awaitable[Any]], limit: int | None) -> list[Any]:
    """Await all, at most ``limit`` at once (a client's connection pool is finite); exceptions are
    returned."""
    if limit is None:
        return await asyncio.gather(*coros, return_exceptions=True)
    gate = asyncio.Semaphore(limit)

    async def one(coro: Awaitable[Any]) -> Any:
        async with gate:
            return await coro

    return await asyncio.gather(*(one(coro) for coro in coros), return_exceptions=True)


__all__ = ["Member", "Renewer", "gather_bounded"]
