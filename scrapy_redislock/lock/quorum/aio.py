"""The quorum lock for asyncio code: masters asked all at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any, TypeVar

import redis.asyncio

from scrapy_redislock._loop import every, stop
from scrapy_redislock.errors import LockLost
from scrapy_redislock.lock.aio import AsyncCountingLock
from scrapy_redislock.lock.base import TaskContext
from scrapy_redislock.lock.permit import Permit
from scrapy_redislock.lock.protocol import Operation, adrive
from scrapy_redislock.lock.quorum.base import QuorumBase
from scrapy_redislock.lock.quorum.core import (
    ANSWER_WITHIN,
    MASTER_ERRORS,
)
from scrapy_redislock.lock.quorum.protocol import (
    LeadWait,
    Pause,
    Pending,
    QuorumOperation,
    QuorumPermit,
)

logger = logging.getLogger("scrapy_redislock.lock.quorum")
T = TypeVar("T")


class AsyncQuorumCountingLock(TaskContext[QuorumPermit], QuorumBase[AsyncCountingLock]):
    """A counting lock held on a safe quorum of N independent ``redis.asyncio.Redis`` masters;
    masters are asked all at once."""

    client_types = (redis.asyncio.Redis,)
    master_class = AsyncCountingLock

    def __init__(self, masters: Sequence[redis.asyncio.Redis], *args: Any, **kwargs: Any) -> None:
        super().__init__(masters, *args, **kwargs)
        self._context: dict[asyncio.Task[Any] | None, list[QuorumPermit]] = {}
        self._renewer: asyncio.Task[None] | None = None
        self._closed = False
        # master index -> the PING in flight (see _answers)
        self._pings: dict[int, asyncio.Future[bool]] = {}

    async def _one(self, index: int, op: Operation[object]) -> object:
        try:
            return await adrive(op, self._runners[index], self.name)
        except MASTER_ERRORS as exc:
            return exc

    async def _run(self, op: QuorumOperation[T], pending: Pending | None = None) -> T:
        reply: Any = None
        try:
            while True:
                try:
                    command = op.send(reply)
                except StopIteration as stop:
                    result: T = stop.value
                    return result
                if isinstance(command, Pause):
                    await asyncio.sleep(command.seconds)
                    reply = None
                elif isinstance(command, LeadWait):
                    try:
                        reply = {command.index: await self._lead_wait(command, pending)}
                    except MASTER_ERRORS as exc:
                        reply = {command.index: exc}
                else:
                    indexes = list(command.ops)
                    tasks = [asyncio.ensure_future(self._one(i, command.ops[i])) for i in indexes]
                    try:
                        results = await asyncio.gather(*tasks)
                    except asyncio.CancelledError:
                        # Masters that answered before the cancellation may have granted: those
                        # grants are the interrupted acquire's too (the generator never saw them).
                        await asyncio.gather(*tasks, return_exceptions=True)
                        if pending is not None:
                            pending.extend(
                                (i, got)
                                for i, t in zip(indexes, tasks, strict=True)
                                if not t.cancelled() and isinstance(got := t.result(), Permit)
                            )
                        raise
                    reply = dict(zip(indexes, results, strict=True))
        finally:
            op.close()

    async def _lead_wait(
        self, command: LeadWait, pending: Pending | None
    ) -> Permit | BaseException:
        """The lead master's blocking acquire; with ``command.watch``, in a task of its own, given
        up (cancelled: its consumer abandoned, freed by the next maintain there) when the master
        stops answering: LeadSilent then."""
        master = self._locks[command.index]
        if command.watch is None:
            return await master.acquire(command.timeout)
        wait = asyncio.ensure_future(master.acquire(command.timeout))
        try:
            while True:
                done, _ = await asyncio.wait({wait}, timeout=command.watch)
                if done:
                    break
                if await self._answers(command.index):
                    continue  # the lead is up: the wait keeps its place in the FIFO
                if wait.done():
                    break
                wait.cancel()
                await asyncio.wait({wait})
                if wait.cancelled():
                    return self._silent(command.index)
                break  # it ended as the cancel came: its outcome stands (a grant is used as any other)
        except asyncio.CancelledError:
            # The acquire itself was cancelled: so is the wait; a grant it got first is the
            # acquire's to sweep.
            wait.cancel()
            await asyncio.wait({wait})
            if not wait.cancelled() and wait.exception() is None and pending is not None:
                pending.append((command.index, wait.result()))
            raise
        return wait.result()

    async def _answers(self, index: int) -> bool:
        """Whether master ``index`` answers a PING within ANSWER_WITHIN (or its socket timeout); one
        PING per master and renewal interval, shared by every wait of this object that asks
        meanwhile."""
        recent = self._recent_answer(index)
        if recent is not None:
            return recent
        ping = self._pings.get(index)
        if ping is None or ping.done():
            ping = self._pings[index] = asyncio.ensure_future(self._ping(index))
        return await asyncio.shield(ping)

    async def _ping(self, index: int) -> bool:
        try:
            await asyncio.wait_for(self._masters[index].ping(), ANSWER_WITHIN)
            answered = True
        except MASTER_ERRORS:  # a redis error, or TimeoutError (an OSError) from wait_for
            answered = False
        self._answered[index] = (self._core.clock(), answered)
        return answered

    async def _acquire(self, timeout: float | None, blocking: bool) -> QuorumPermit | None:
        pending: Pending = []
        try:
            return await self._run(
                self._core.acquire(timeout, blocking, asyncio.current_task(), pending), pending
            )
        except asyncio.CancelledError:
            # Cut short: give back what it held that no permit owns, and free cancelled waits'
            # grants, now.
            with contextlib.suppress(Exception):
                await asyncio.shield(self._run(self._core.sweep(pending)))
            raise

    async def acquire(self, timeout: float | None = None) -> QuorumPermit:
        """A permit on >= quorum masters; AcquireTimeout after ``timeout`` s."""
        permit = await self._acquire(timeout, True)
        assert permit is not None
        self._start_loop()
        return permit

    async def try_acquire(self) -> QuorumPermit | None:
        """One round: a permit if >= quorum masters grant one now, else None."""
        permit = await self._acquire(None, False)
        if permit is not None:
            self._start_loop()
        return permit

    async def release(self, permit: QuorumPermit) -> bool:
        """Give the slot back on every master: True if >= quorum still held it."""
        return bool(await self._run(self._core.release(permit)))

    async def renew(self, permit: QuorumPermit) -> None:
        """Renew on every master; LockLost when fewer than ``quorum`` renewed."""
        if await self.maintain([permit]):
            raise LockLost(
                f"quorum lock {self.name!r}: fewer than {self.quorum} masters renewed {permit.token}"
            )

    async def maintain(self, permits: list[QuorumPermit] | None = None) -> list[QuorumPermit]:
        """Renew held permits (default: all) on every master; returns the lost ones."""
        lost: list[QuorumPermit] = await self._run(self._core.maintain(permits))
        self._report_lost(lost)
        return lost

    async def set_limit(self, limit: int) -> int | None:
        """Write this object's limit to every master at once (the newest process's settings win):
        the previous limit of the first master that had one; :class:`~scrapy_redislock.errors.QuorumNotReached` (naming
        the masters that failed) when fewer than q took it. Only the limit the object was made
        with: its quorum was computed from it (another limit needs a new object). A master missing
        then gets the lock with this limit when it is first used.

        Never creates free slots on a master that lost the lock while another has it: until this
        object has seen the lock, it first asks every master whether it has it (one EXISTS each),
        and a master without it gets it with every slot reserved for one lease (see
        :meth:`~scrapy_redislock.lock.quorum.core.QuorumCore.set_limit`)."""
        self._check_limit(limit)
        previous: int | None = await self._run(self._core.set_limit(limit))
        return previous

    async def get_limit(self) -> int | None:
        """The limit most answering masters hold; QuorumNotReached when fewer than q answer."""
        limit: int | None = await self._run(self._core.get_limit())
        return limit

    async def aclose(self, retire: bool = False) -> int:
        """Stop renewing and free everything this object holds on every master; returns how many
        permits. ``retire=True``: each master deletes the lock when nobody else uses it there."""
        self._closed = True
        if self._renewer is not None and self._renewer is not asyncio.current_task():
            await stop(self._renewer)
        self._renewer = None
        for ping in self._pings.values():
            ping.cancel()
        count = self._core.forget_all()
        await asyncio.gather(
            *(master.aclose(retire=retire) for master in self._locks), return_exceptions=True
        )
        return count

    def _start_loop(self) -> None:
        if (
            not self.auto_renew
            or self._closed
            or (self._renewer is not None and not self._renewer.done())
        ):
            return
        self._renewer = asyncio.get_running_loop().create_task(
            every(
                lambda: self.renew_interval, self._tick, what=f"renewing quorum lock {self.name!r}"
            ),
            name=f"redislock-quorum-{self.name}",
        )

    async def _tick(self) -> bool:
        if not self._core.held:
            return False
        await self.maintain()
        return True
