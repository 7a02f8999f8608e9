"""WorkerState: what one worker knows of its stage and of the cluster, shared by the worker's parts.

The scheduler's parts (:mod:`~scrapy_redislock.workers.inflight`,
:mod:`~scrapy_redislock.workers.outbox`, :mod:`~scrapy_redislock.workers.heartbeat`,
:mod:`~scrapy_redislock.workers.stageslot`, :mod:`~scrapy_redislock.workers.listener`,
:mod:`~scrapy_redislock.workers.loop`) read and change one state; the changes that go together are
named methods here, and no part writes a field itself (every change is one of the transitions
below), so no part sets half of one. The clock is injected (``time.monotonic`` by default), so the
transitions are unit-tested with a fake one. No Redis, no Scrapy. Reads no settings.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scrapy_redislock.lock.permit import Permit


class WorkerState:
    """The stage a worker holds, what it last saw of the queues, and why its loop should look."""

    def __init__(self, stages: Iterable[str], clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
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
        self.fed = False  # the wait for start URLs saw entries: the next step takes a batch
        # look at the queues at the next step without a stage: woken, beat, or a stage left
        self.look_due = True
        # the last look found work somewhere (queued, paused or full stages too; in flight)
        self.work_seen = False
        self.busy_at = clock()  # the last time this worker saw work
        # the cluster was found idle at the last look (for REDISLOCK_IDLE_CLOSE)
        self.quiet_since: float | None = None
        # the last loop step met a Redis error: never idle-close on what could not be read
        self.failing = False
        self.closing = False
        self.wakeup: asyncio.Event | None = None  # set: the loop steps now

    # -- the loop's life ---------------------------------------------------------------------------

    def opened(self) -> asyncio.Event:
        """The loop starts: idle time counts from now, and it looks at once; its wake-up event."""
        self.busy_at = self.clock()
        self.wakeup = asyncio.Event()
        self.wakeup.set()
        return self.wakeup

    def begin_close(self) -> None:
        """The spider closes: the loop stops at its next step."""
        self.closing = True

    def failed(self) -> None:
        """A step met a Redis error."""
        self.failing = True

    def answered(self) -> bool:
        """A step went through: whether Redis answers again after an outage (idle time then counts
        from now, not from before the outage)."""
        if not self.failing:
            return False
        self.failing = False
        self.busy_at = self.clock()
        return True

    def wake(self) -> None:
        """Make the loop step now (the engine wants requests, a signal came, an ack went through)."""
        if self.wakeup is not None:
            self.wakeup.set()

    def busy(self) -> None:
        """Work was seen: the idle clock starts again."""
        self.busy_at = self.clock()
        self.quiet_since = None

    def look_soon(self) -> None:
        """Look at the queues at the next step without a stage (a beat, a wake-up)."""
        self.look_due = True

    def looking(self) -> None:
        """The look is under way."""
        self.look_due = False

    def idle_due(self, now: float, idle_close: float | None) -> None:
        """Still quiet REDISLOCK_IDLE_CLOSE after the last look found no work: look again (and
        close)."""
        if self.quiet_since is not None and idle_close is not None:
            self.look_due |= now >= self.quiet_since + idle_close

    def saw_work(self, work: bool) -> None:
        """What the last look found: work somewhere (busy from now), or none (quiet since the last
        work seen)."""
        self.work_seen = work
        if work:
            self.busy()
        else:
            self.quiet_since = self.busy_at

    def idle_reported(self) -> None:
        """The engine was told this worker may close: nothing more to time."""
        self.quiet_since = None

    def idle_from_now(self) -> None:
        """The crawl has just ended elsewhere: idle time counts from now."""
        self.busy_at = self.clock()

    def saw_lengths(self, lengths: dict[str, int]) -> None:
        """Queue lengths read at a beat (no look: empty and full stay as they are)."""
        self.lengths = lengths

    def found_full(self, stage: str) -> None:
        """A capped stage with work had no free slot at this look."""
        self.full.add(stage)

    def ran_empty(self, stage: str) -> None:
        """The stage's queue gave fewer requests than wanted."""
        self.empty.add(stage)

    def queued_again(self, stage: str) -> None:
        """A request reached ``stage``'s queue: if that is this worker's own drained stage, pop it
        when the engine asks."""
        if stage == self.current and stage in self.empty:
            self.empty.discard(stage)
            self.wake()

    # -- signal tokens and the start URLs ---------------------------------------------------------

    def signal_came(self, stage: str) -> None:
        """This worker took ``stage``'s signal token (pass it on when popping)."""
        self.signalled.add(stage)

    def take_signal(self, stage: str) -> bool:
        """Use the current stage's token, if one came: its queue has work again."""
        if stage not in self.signalled:
            return False
        self.signalled.discard(stage)
        self.empty.discard(stage)
        return True

    def give_up_signal(self, stage: str) -> bool:
        """Leaving ``stage``: a token of it that came meanwhile is the next holder's (True: pass it
        on)."""
        if stage not in self.signalled:
            return False
        self.signalled.discard(stage)
        return True

    def tokens_passed(self) -> None:
        """The tokens of this look were used or passed on."""
        self.signalled.clear()

    def start_urls_came(self) -> None:
        """The start-URL feed has entries: take a batch at the next step."""
        self.fed = True

    def take_fed(self) -> bool:
        """Whether the feed had entries since the last step (then the step takes a batch)."""
        fed, self.fed = self.fed, False
        return fed

    def start_urls_to(self, stage: str) -> None:
        """Start URLs from Redis went to ``stage``: when its queue runs empty, read the feed."""
        self.start_stages.add(stage)

    # -- the stage held ---------------------------------------------------------------------------

    def checked_limit(self, limit: int, grant: str) -> None:
        """This slot was checked against the stage's limit as last reported."""
        self.limit_checked = (limit, grant)

    def leave_when_done(self) -> None:
        """Over the stage's limit: take nothing new, free the slot once what is in progress ends."""
        self.leaving = True

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
        self.leaving, self.limit_checked, self.taken_at = False, None, self.clock()
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
