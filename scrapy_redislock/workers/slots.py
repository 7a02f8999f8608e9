"""The worker front's stage slots: :class:`~scrapy_redislock.crawl.stagelocks.StageLocks` that also
learn each stage's limit from the lock's own renewals, so that lowering a worker stage's limit (or
pausing it: limit 0) moves workers off it within a renewal interval, at no cost in Redis commands.

The process's renewal loop maintains every held slot every ttl/3 (at most every second); the reply
of the lock's ``maintain`` script carries the stage's limit. StageLocks reads it there
(:class:`~scrapy_redislock.crawl.limits.LimitWatch`, for both fronts) and calls
``on_limit(stage, limit)`` (the scheduler wakes up when the limit of the stage it holds
changed). The scheduler then reads the stage's oldest grants (:meth:`WorkerSlots.oldest_grants`: one
XPENDING, only when the limit changed) and leaves the stage if its slot is not among the ``limit``
oldest (:func:`~scrapy_redislock.workers.policy.keeps_slot`): the newest holders leave, exactly as
many as the stage is over its limit.

Reads no settings; imports no Twisted.
"""

from __future__ import annotations

from scrapy_redislock._redis import text
from scrapy_redislock.crawl.stagelocks import StageLocks
from scrapy_redislock.lock.permit import GROUP


class WorkerSlots(StageLocks):
    """StageLocks of the worker slots (``workers:<stage>``) that watch each stage's limit (module
    docstring)."""

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


__all__ = ["WorkerSlots"]
