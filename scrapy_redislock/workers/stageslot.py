"""StageSlot: taking a stage (and its slot, if capped), leaving it, and obeying its limit.

A worker holds the slot of one capped stage at a time (an AsyncCountingLock named
``workers:<stage>`` of the process's :class:`~scrapy_redislock.crawl.stagelocks.StageLocks`); an
uncapped stage needs none. It learns the stage's limit from its slot's renewals (the lock's own
answer: each ``maintain`` reply carries the limit, ``StageLocks.limits_seen``), which the loop looks
at every step (a working worker steps at least every renewal interval), and from one HGET at a beat
when no renewal reported it: when the limit is lowered under the stage's holders, or set to 0
(paused), the newest holders (:func:`~scrapy_redislock.workers.policy.keeps_slot`: one XPENDING,
only when the limit changed) give back what they took ahead, let what is in progress finish, free
the slot and take another stage or wait. A lost lease (a stall longer than the TTL, an operator's
reset) leaves the stage at once.

Reads no settings. Stats: ``redislock/workers/<stage>/{taken,yielded}``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

from scrapy_redislock._redis import text
from scrapy_redislock.lock.permit import GROUP
from scrapy_redislock.workers.policy import keeps_slot

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

    from scrapy_redislock.crawl.stagelocks import StageLocks
    from scrapy_redislock.lock.core import Clock
    from scrapy_redislock.lock.permit import Permit
    from scrapy_redislock.workers.heartbeat import Heartbeat
    from scrapy_redislock.workers.inflight import InFlight
    from scrapy_redislock.workers.state import WorkerState

logger = logging.getLogger("scrapy_redislock.workers.scheduler")


class StageSlot:
    """The stage a worker works on and its slot (see the module docstring)."""

    def __init__(
        self,
        crawler: Crawler,
        locks: StageLocks,
        state: WorkerState,
        inflight: InFlight,
        heartbeat: Heartbeat,
        clock: Clock,
    ) -> None:
        self.clock = clock  # monotonic seconds (the scheduler's: a fake one in unit tests)
        self.stats: Any = crawler.stats
        self.locks = locks
        self.state = state
        self.inflight = inflight
        self.heartbeat = heartbeat
        self.worker = inflight.queues.worker

    async def take(self, stage: str) -> bool:
        """Work on ``stage`` if its slot (if capped) is free; False if it is not."""
        state, permit = self.state, None
        if self.locks.is_capped(stage):
            # The worker front runs on one Redis (masters are refused by the scheduler): its slots
            # are plain Permits.
            permit = cast("Permit | None", await self.locks.locks[stage].try_acquire())
            if permit is None:
                return False
            # moving up from a capped stage does not happen; be safe anyway
            if state.permit is not None:
                await self.locks.release(state.permit)
        previous = state.took(stage, permit)
        # said and counted before the beat: a beat that fails (an outage) leaves the worker on the
        # stage all the same, and the loop's next steps beat again
        self.stats.inc_value(f"redislock/workers/{stage}/taken")
        logger.info(
            "Worker %s works on stage %r%s",
            self.worker,
            stage,
            f" (was {previous!r})" if previous else "",
        )
        await self.heartbeat.beat(stage)
        return True

    async def leave(self, why: str = "no work left there") -> None:
        stage, permit = self.state.left()
        if permit is not None:
            await self.locks.release(permit)
        await self.heartbeat.beat(None)
        logger.info("Worker %s left stage %r (%s)", self.worker, stage, why)

    async def read_limit_unseen(self) -> None:
        """At a heartbeat: if no renewal reported the stage's limit since the last one, read it (one
        HGET)."""
        stage = self.state.current
        if stage is None or self.state.permit is None:
            return
        seen = self.locks.limits_seen.get(stage)
        since = max(self.state.taken_at, self.clock() - self.heartbeat.ttl / 3)
        if seen is None or seen[1] < since:
            limit = await self._read_limit(stage)
            if limit is not None:
                self.locks.limit_seen(stage, limit)

    async def check_limit(self) -> None:
        """Leave a capped stage whose limit was lowered under its holders (or set to 0: paused) if
        this worker's slot is one of the newest (policy.keeps_slot). One XPENDING each time the
        limit a renewal reported changes (and once after taking the stage); nothing otherwise."""
        state = self.state
        stage, permit, limit = state.current, state.permit, self._limit_to_check()
        if stage is None or permit is None or limit is None:
            return
        oldest = await self._oldest_grants(stage, limit)
        state.checked_limit(limit, permit.grant)
        if (
            not keeps_slot(permit.grant, oldest, limit)
            and state.current == stage
            and state.permit is permit
        ):
            await self._start_leaving(stage, limit)

    async def _oldest_grants(self, stage: str, count: int) -> list[str]:
        """The ``count`` oldest grants held in the stage (ids, oldest first): one XPENDING."""
        if count <= 0:
            return []
        keys = self.locks.locks[stage].keys
        entries = await self.locks.client.xpending_range(keys.slots, GROUP, "-", "+", count)
        return [str(text(entry["message_id"])) for entry in entries]

    async def _read_limit(self, stage: str) -> int | None:
        """The stage's limit in Redis now (one HGET), for when no renewal reported it."""
        value = await self.locks.client.hget(self.locks.locks[stage].keys.meta, "limit")
        return None if value is None else int(text(value))

    def _limit_to_check(self) -> int | None:
        """The stage's limit as a renewal last reported it, if this slot was not checked against it
        yet; None: nothing to check (no capped stage held, leaving already, the lease lost, or not
        reported since the stage was taken: the grant was made under the limit of then)."""
        state = self.state
        stage, permit = state.current, state.permit
        if stage is None or permit is None or state.leaving or permit.lost:
            return None
        seen = self.locks.limits_seen.get(stage)
        if seen is None or seen[1] < state.taken_at:
            return None
        if state.limit_checked == (seen[0], permit.grant):
            return None
        return seen[0]

    async def _start_leaving(self, stage: str, limit: int) -> None:
        """Over the limit: give back what was taken ahead (to the front of the queue), take nothing
        new; the slot is freed once what is in progress here has finished (:meth:`finish_leaving`)."""
        self.state.leave_when_done()
        returned = await self.inflight.give_back_ahead()
        self.stats.inc_value(f"redislock/workers/{stage}/yielded")
        logger.info(
            "Worker %s leaves stage %r: its limit is %d now and this slot is one of the newest; gave %d unstarted requests back, %d in progress finish first",  # noqa: E501
            self.worker,
            stage,
            limit,
            returned,
            len(self.inflight.handed),
        )
        self.state.wake()

    async def finish_leaving(self, stage: str) -> None:
        """Leaving: once nothing of the stage is in progress here, free the slot (then take another
        stage or wait)."""
        if self.state.give_up_signal(stage):  # a token taken meanwhile: the next holder's
            await self.inflight.queues.signal(stage)
        if not self.inflight.settled:
            return
        await self.leave("over its limit: the stage was lowered or paused")

    async def check_lost(self) -> None:
        """A lost slot lease (stalled longer than the TTL, or an operator's reset): leave the stage
        at once."""
        state, permit = self.state, self.state.permit
        if permit is None or not permit.lost or state.current is None:
            return
        stage = state.current
        # StageLocks counted it: redislock/workers/<stage>/lost
        returned = await self.inflight.give_back_ahead()
        logger.warning(
            "Worker %s lost its slot of stage %r; gave %d unstarted requests back, %d in progress finish here",
            self.worker,
            stage,
            returned,
            len(self.inflight.handed),
        )
        state.left()
        await self.heartbeat.beat(None)


__all__ = ["StageSlot"]
