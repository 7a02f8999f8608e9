"""Why a crawl's requests wait, said in the log; and when a close should stop waiting.

At start, and whenever a stage's waits have had no grant for 5 s (then 10, 20, ... at most every
5 min), the stage's lock is read (:func:`~scrapy_redislock.lock.status.astage_status`, read-only,
one MULTI/EXEC) and its :class:`~scrapy_redislock.lock.status.WaitReason` logged: at INFO when
every slot is held by live holders (the ordinary state of a capped stage), else as a warning
(paused, a recovery window after a data loss, a holder that stopped renewing, a master
unreachable). A quorum lock waits when fewer than q masters have a free slot: said master by
master.

At close, :meth:`WaitReports.stalled` says why to give up the waits of a stage: paused, or no slot
freed anywhere for a while.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from scrapy_redislock.crawl.reach import REDIS_ERRORS, masters_said
from scrapy_redislock.lock.interface import AsyncLock
from scrapy_redislock.lock.status import (
    KEY_LOCK_PREFIX,
    StageStatus,
    WaitReason,
    astage_status,
    wait_reason,
)

if TYPE_CHECKING:
    from scrapy_redislock.crawl.deployment import Deployment
    from scrapy_redislock.crawl.settings import RedisLockSettings
    from scrapy_redislock.lock.core import Clock

logger = logging.getLogger(__name__)

REPORT_FIRST = 5.0  # seconds without a grant while requests wait before the log says why
REPORT_MAX = 300.0  # the pause between two reports doubles up to this


class WaitReports:
    """The waits of one StageLocks: when each began, the last grant per stage, and what to say.
    Given what it reads: the locks by stage (the registry's own mapping: keys' locks come and go in
    it), the deployment (the clients, a quorum's needs), the settings and the names' prefixes."""

    def __init__(
        self,
        locks: Mapping[str, AsyncLock[Any]],
        deployment: Deployment,
        settings: RedisLockSettings,
        *,
        lock_prefix: str,
        key_prefix: str,
        clock: Clock = time.monotonic,
    ) -> None:
        self.by_stage = locks
        self.clock = clock
        self.deployment = deployment
        self.settings = settings
        self.lock_prefix = lock_prefix
        self.key_prefix = key_prefix
        # wait (the acquire() call's task) -> stage, since
        self.started: dict[Any, tuple[str, float]] = {}
        # stage -> when this process last got a slot (monotonic)
        self.last_grant: dict[str, float] = {}
        # stage -> seconds without a grant at which to say why next
        self._report_after: dict[str, float] = {}
        # at close: stage -> (grants seen, since when)
        self._progress: dict[str, tuple[Any, float]] = {}

    def wait_began(self, wait: Any, stage: str) -> None:
        self.started[wait] = (stage, self.clock())

    def wait_ended(self, wait: Any) -> None:
        self.started.pop(wait, None)

    def granted(self, stage: str) -> None:
        self.last_grant[stage] = self.clock()

    def forget(self, stage: str) -> None:
        """A stage (a key's) that is gone: nothing more to report on it."""
        self.last_grant.pop(stage, None)
        self._report_after.pop(stage, None)
        self._progress.pop(stage, None)

    async def read_statuses(self, stage: str) -> list[StageStatus | BaseException | None]:
        """The stage's lock as each master (or the one Redis) holds it now, at once (read-only): its
        status, None when it is not there, or the master's error."""
        name = f"{self.lock_prefix}{stage}"
        prefix = self.key_prefix
        replies = await asyncio.gather(
            *(astage_status(client, prefix, name) for client in self.deployment.clients),
            return_exceptions=True,
        )
        for reply in replies:
            if isinstance(reply, BaseException) and not isinstance(reply, REDIS_ERRORS):
                raise reply
        return list(replies)

    async def why(self, stage: str) -> WaitReason:
        """Why a request of ``stage`` waits now (false when a slot is free); a Redis error is left
        to the caller.

        A quorum lock waits when fewer than q masters have a free slot: said master by master, calm
        only when every master without a free slot is held by live holders."""
        lock = self.by_stage[stage]
        statuses = await self.read_statuses(stage)
        if len(statuses) == 1:
            if isinstance(statuses[0], BaseException):
                raise statuses[0]
            return WaitReason("free") if statuses[0] is None else wait_reason(statuses[0])
        said: dict[int, str] = {}
        calm = True
        for index, status in enumerate(statuses):
            if isinstance(status, BaseException):
                said[index], calm = f"unreachable ({status})", False
                continue
            reason = WaitReason("free") if status is None else wait_reason(status)
            if reason:
                said[index], calm = reason.text, calm and reason.calm
        masters, needed = len(statuses), self.deployment.needed(lock)
        free = masters - len(said)
        if free >= needed:
            return WaitReason("free")
        return WaitReason(
            "held" if calm else "quorum",
            f"{free} of {masters} masters have a free slot, {needed} needed; {masters_said(self.settings.redis.masters, said)}",  # noqa: E501
        )

    async def say_why(self, stage: str, when: str) -> None:
        """Log why a request of ``stage`` waits (nothing when a slot is free): INFO when every slot
        is held by live holders, else a warning; a Redis error is left to the waits."""
        try:
            reason = await self.why(stage)
        except REDIS_ERRORS:
            return
        if reason:
            logger.log(
                logging.INFO if reason.calm else logging.WARNING,
                "Key %r has no free slot %s: %s"
                if self.lock_prefix == KEY_LOCK_PREFIX
                else "Stage %r has no free slot %s: %s",
                stage,
                when,
                reason,
            )

    def _no_grant_for(self, stage: str, now: float) -> float | None:
        """Seconds since this process's waits for ``stage`` last saw a grant; None when none
        waits."""
        starts = [since for waited, since in self.started.values() if waited == stage]
        if not starts:
            return None
        return now - max(min(starts), self.last_grant.get(stage, 0.0))

    async def report(self) -> None:
        """Say why, for each stage whose waits have had no grant for REPORT_FIRST s, then with
        back-off."""
        now = self.clock()
        for stage in list(self.by_stage):  # keys may come and go meanwhile (KeyLocks)
            idle = self._no_grant_for(stage, now)
            if idle is None or idle < REPORT_FIRST:
                self._report_after.pop(stage, None)
                continue
            due = self._report_after.get(stage, REPORT_FIRST)
            if idle >= due:
                self._report_after[stage] = due * 2 if due * 2 <= REPORT_MAX else idle + REPORT_MAX
                await self.say_why(stage, f"after {idle:.0f} s of waiting")

    async def stalled(self, stage: str, window: float) -> str:
        """At close: why to give up the waits for ``stage`` (paused, or no slot freed anywhere for
        ``window`` s), else "". Progress is a grant to this process, or any change in the stage's
        grants in Redis."""
        now = self.clock()
        try:
            statuses = await self.read_statuses(stage)
        except REDIS_ERRORS:
            statuses = []
        needed = self.deployment.needed(self.by_stage[stage])
        live = [status for status in statuses if isinstance(status, StageStatus)]
        paused = [status for status in live if status.limit == 0]
        if paused and len(statuses) - len(paused) < needed:
            return wait_reason(paused[0]).text
        seen = [
            None if not isinstance(s, StageStatus) else sorted(g.grant for g in s.grants)
            for s in statuses
        ] or None
        previous, since = self._progress.get(stage, (seen, now))
        if seen != previous or stage not in self._progress:
            since = now
        since = max(since, self.last_grant.get(stage, 0.0))
        self._progress[stage] = (seen, since)
        if now - since > window:
            return f"no slot was freed anywhere for {window:.0f} s"
        return ""


__all__ = ["REPORT_FIRST", "REPORT_MAX", "WaitReports"]
