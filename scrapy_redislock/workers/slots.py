"""The worker front's stage slots: :class:`~scrapy_redislock.crawl.stagelocks.StageLocks` that also
learn each stage's limit from the lock's own renewals, so that lowering a worker stage's limit (or
pausing it: limit 0) moves workers off it within a renewal interval, at no cost in Redis commands.

The process's renewal loop maintains every held slot every ttl/3 (at most every second); the reply
of the lock's ``maintain`` script carries the stage's limit. :class:`WorkerSlots` reads it there and
calls ``on_limit(stage, limit)`` (the scheduler wakes up when the limit of the stage it holds
changed). The scheduler then reads the stage's oldest grants (:meth:`WorkerSlots.oldest_grants`: one
XPENDING, only when the limit changed) and leaves the stage if its slot is not among the ``limit``
oldest (:func:`~scrapy_redislock.workers.policy.keeps_slot`): the newest holders leave, exactly as
many as the stage is over its limit.

Reads no settings; imports no Twisted.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

from scrapy_redislock._redis import text
from scrapy_redislock.crawl.stagelocks import StageLock, StageLocks
from scrapy_redislock.lock.aio import AsyncCountingLock
from scrapy_redislock.lock.permit import GROUP
from scrapy_redislock.lock.protocol import Command, RunScript


class LimitWatch:
    """Wraps a lock's command runner: passes every command on unchanged, and hands the limit in each
    reply of the ``maintain`` script (``{lost, limit, lease, freed, adopted}``) to ``seen``. A reply
    it cannot read is passed on as it is (the scheduler then reads the limit itself at its
    heartbeat)."""

    def __init__(self, runner: Callable[[Command], Any], seen: Callable[[int], None]) -> None:
        self.runner = runner
        self.seen = seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def __call__(self, command: Command) -> Any:
        result = self.runner(command)
        if isinstance(command, RunScript) and command.name == "maintain":
            return self._watch(result)
        return result

    async def _watch(self, result: Awaitable[Any]) -> Any:
        reply = await result
        try:
            limit = int(reply[1])
        except (TypeError, ValueError, IndexError, KeyError):
            return reply
        self.seen(limit)
        return reply


class WorkerSlots(StageLocks):
    """StageLocks of the worker slots (``workers:<stage>``) that watch each stage's limit (module
    docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # stage -> (limit, time.monotonic() when seen)
        self.limits_seen: dict[str, tuple[int, float]] = {}
        self.on_limit: Callable[[str, int], None] | None = None
        super().__init__(*args, **kwargs)

    def _make_lock(self, name: str, limit: int) -> StageLock:
        lock = super()._make_lock(name, limit)
        # the worker front runs on one Redis (no quorum lock)
        if isinstance(lock, AsyncCountingLock):
            stage = name.removeprefix(self.lock_prefix)
            lock.runner = LimitWatch(lock.runner, functools.partial(self._seen, stage))
        return lock

    def _seen(self, stage: str, limit: int) -> None:
        self.limits_seen[stage] = (limit, time.monotonic())
        if self.on_limit is not None:
            self.on_limit(stage, limit)

    async def oldest_grants(self, stage: str, count: int) -> list[str]:
        """The ``count`` oldest grants held in the stage (ids, oldest first): one XPENDING."""
        if count <= 0:
            return []
        lock = self.locks[stage]
        entries = await self.client.xpending_range(lock.keys.slots, GROUP, "-", "+", count)
        return [str(text(entry["message_id"])) for entry in entries]

    async def read_limit(self, stage: str) -> int | None:
        """The stage's limit in Redis now (one HGET), for when no renewal reported it."""
        value = await self.client.hget(self.locks[stage].keys.meta, "limit")
        return None if value is None else int(text(value))


__all__ = ["LimitWatch", "WorkerSlots"]
