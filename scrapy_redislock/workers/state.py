"""WorkerState: what one worker knows of its stage and of the cluster, shared by the worker's parts.

The scheduler's parts (:mod:`~scrapy_redislock.workers.inflight`,
:mod:`~scrapy_redislock.workers.outbox`, :mod:`~scrapy_redislock.workers.heartbeat`,
:mod:`~scrapy_redislock.workers.stageslot`, :mod:`~scrapy_redislock.workers.listener`,
:mod:`~scrapy_redislock.workers.loop`) read and change one state; the changes that go together are
named methods here, so no part sets half of one. No Redis, no Scrapy. Reads no settings.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scrapy_redislock.lock.permit import Permit


class WorkerState:
    """The stage a worker holds, what it last saw of the queues, and why its loop should look."""

    def __init__(self, stages: Iterable[str]) -> None:
        self.current: str | None = None  # the stage this worker works on
        self.permit: Permit | None = None  # its slot of that stage (None: uncapped)
        # its capped stage is over its limit: finish what is in progress, then free the slot
        self.leaving = False
        # (limit, grant) its slot was last checked against
        self.limit_checked: tuple[int, str] | None = None
        # when it took its stage (a limit reported before then is not the stage's now)
        self.taken_at = 0.0
        self.lengths: dict[str, int] = dict.fromkeys(stages, 0)  # at the last look
        self.empty: set[str] = set()  # stages whose queue this worker last found empty
        # capped stages with work whose slots were all taken at the last look
        self.full: set[str] = set()
        # stages whose signal token this worker took: pass it on when popping
        self.signalled: set[str] = set()
        self.start_stages: set[str] = set()  # stages that start URLs from Redis went to
        self.fed: list[Any] = []  # start-URL entries a blocked wait took, to turn into requests
        # look at the queues at the next step without a stage: woken, beat, or a stage left
        self.look_due = True
        # the last look found work somewhere (queued, paused or full stages too; in flight)
        self.work_seen = False
        self.busy_at = time.monotonic()  # the last time this worker saw work
        # the cluster was found idle at the last look (for REDISLOCK_IDLE_CLOSE)
        self.quiet_since: float | None = None
        # the last loop step met a Redis error: never idle-close on what could not be read
        self.failing = False
        self.closing = False
        self.wakeup: asyncio.Event | None = None  # set: the loop steps now

    def wake(self) -> None:
        """Make the loop step now (the engine wants requests, a signal came, an ack went through)."""
        if self.wakeup is not None:
            self.wakeup.set()

    def busy(self) -> None:
        """Work was seen: the idle clock starts again."""
        self.busy_at = time.monotonic()
        self.quiet_since = None

    def looked(self, lengths: dict[str, int]) -> None:
        """The queue lengths of a look: which stages are empty; none is known full yet."""
        self.lengths = lengths
        self.empty = {stage for stage, n in lengths.items() if not n}
        self.full = set()

    def look_again(self) -> None:
        """The queues may have changed in ways this worker cannot tell: look at them all again."""
        self.empty.clear()
        self.look_due = True

    def took(self, stage: str, permit: Permit | None) -> str | None:
        """This worker works on ``stage`` now (with its slot, if capped); the previous stage."""
        previous, self.current = self.current, stage
        if permit is not None:
            self.permit = permit
        self.empty.discard(stage)
        self.leaving, self.limit_checked, self.taken_at = False, None, time.monotonic()
        return previous

    def left(self) -> tuple[str | None, Permit | None]:
        """This worker no longer works on a stage; the stage and slot it had."""
        permit, self.permit = self.permit, None
        stage, self.current = self.current, None
        self.look_due = True
        self.leaving = False
        return stage, permit

    def on_stage_with_work(self) -> bool:
        """It holds a stage whose queue it has not found empty."""
        return self.current is not None and self.current not in self.empty


__all__ = ["WorkerState"]
