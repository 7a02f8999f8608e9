"""The asyncio counting lock: ``AsyncCountingLock`` over a ``redis.asyncio.Redis`` client.

Same operations as :class:`scrapy_redislock.CountingLock`, as coroutines; the
optional renewal runs as a task on the running loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, TypeVar

import redis.asyncio

from scrapy_redislock._loop import every, stop
from scrapy_redislock.lock.base import LockBase, TaskContext
from scrapy_redislock.lock.permit import Permit
from scrapy_redislock.lock.protocol import Operation, adrive

logger = logging.getLogger(__name__)

T = TypeVar("T")


class AsyncCountingLock(TaskContext[Permit], LockBase):
    """A fair, leased counting lock (semaphore) in Redis, for asyncio code."""

    client_types = (redis.asyncio.Redis, redis.asyncio.RedisCluster)

    def __init__(
        self, client: redis.asyncio.Redis | redis.asyncio.RedisCluster, *args: Any, **kwargs: Any
    ) -> None:
        super().__init__(client, *args, **kwargs)
        self._context: dict[asyncio.Task[Any] | None, list[Permit]] = {}
        self._renewer: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._closed = False

    async def _run(self, op: Operation[T]) -> T:
        return await adrive(op, self.runner, self.name)

    async def acquire(self, timeout: float | None = None) -> Permit:
        """Wait for a slot (first come, first served); AcquireTimeout after ``timeout`` s."""
        self._callers += 1
        self._start_loop()  # a waiter reaps expired leases too, or it could wait for a dead holder forever
        try:
            return await self._run(self._core.acquire(timeout, holder=asyncio.current_task()))
        finally:
            self._callers -= 1
            if self._core.consumers.abandoned and self._wake is not None:
                self._wake.set()  # free what the cancelled wait may have been handed now, not in a lease

    async def try_acquire(self) -> Permit | None:
        """A slot if one is free now (expired leases are freed first), else None."""
        permit = await self._run(
            self._core.acquire(None, blocking=False, holder=asyncio.current_task())
        )
        if permit is not None and self.auto_renew:
            self._start_loop()
        return permit

    async def release(self, permit: Permit) -> bool:
        """Give a slot back: True if it was still held, False for a stale permit."""
        return bool(await self._run(self._core.release(permit)))

    async def renew(self, permit: Permit) -> None:
        """Extend the permit's lease; raises LockLost if the lease is gone."""
        await self._run(self._core.renew(permit))

    async def maintain(self, permits: list[Permit] | None = None) -> list[Permit]:
        """Renew held permits (default: all), free expired leases of others; returns the lost
        permits."""
        lost: list[Permit] = await self._run(self._core.maintain(permits))
        self._report_lost(lost)
        return lost

    async def set_limit(self, limit: int) -> int | None:
        """Change the limit for every process at once; returns the previous limit."""
        return await self._run(self._core.set_limit(limit))

    async def get_limit(self) -> int | None:
        """The limit in Redis now."""
        return await self._run(self._core.get_limit())

    async def aclose(self, retire: bool = False) -> int:
        """Stop renewing and free every slot this object holds; returns how many.

        ``retire=True`` also deletes the lock from Redis when nobody else uses it (a lock made for a
        key met at run time, such as a domain: see :meth:`LockCore.retire
        <scrapy_redislock.lock.core.LockCore.retire>`).
        """
        self._closed = True
        if self._renewer is not None and self._renewer is not asyncio.current_task():
            await stop(self._renewer)
        self._renewer = None
        try:
            if retire:
                freed, _deleted = await self._run(self._core.retire())
            else:
                freed = await self._run(self._core.release_all())
        finally:  # its waiting connections are closed even when Redis could not be told (given ones: their owner's)
            if self._waiting_client is not None and self._owns_waiting_client:
                await self._waiting_client.aclose()
        return int(freed)

    def _start_loop(self) -> None:
        if (
            not self.maintain_loop
            or self._closed
            or (self._renewer is not None and not self._renewer.done())
        ):
            return
        self._wake = asyncio.Event()
        self._renewer = asyncio.get_running_loop().create_task(
            self._loop(), name=f"redislock-renew-{self.name}"
        )

    async def _loop(self) -> None:
        """Maintain every ttl/3 (at once when woken) while needed; errors are logged and retried,
        never dropped."""
        assert self._wake is not None
        await every(
            lambda: self.renew_interval,
            self._tick,
            what=f"renewing lock {self.name!r}",
            wake=self._wake,
        )

    async def _tick(self) -> bool:
        if self._loop_idle():
            return self._idle_ticks < 2
        await self.maintain(self._loop_permits())
        return True
