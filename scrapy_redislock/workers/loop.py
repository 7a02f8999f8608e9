"""WorkerLoop: one step when woken (the engine wants requests, a signal, an ack), else at the beat.

A step beats when the heartbeat is due (naming and requeueing the dead), pulses while the worker has
work, checks its slot (lost, or its stage's limit lowered under it), acknowledges what finished,
turns start URLs into requests, and then either works on its stage (pops when the engine runs short,
leaves a drained stage) or, with no stage, looks at every queue and takes the first stage in
preference order with work and a free slot; last, it blocks in Redis on what it could take next
(:class:`~scrapy_redislock.workers.listener.SignalListener`). Which stage and what to wait for are
the pure decisions of :mod:`~scrapy_redislock.workers.policy`.

Redis going away is not an error: a step that fails in an outage is retried after a back-off, with
one WARNING per outage and one INFO when Redis answers again
(:class:`~scrapy_redislock.workers.outage.OutageLog`); the worker never idle-closes on what it could
not read. Reads no settings (the scheduler passes what it read). Stats:
``redislock/workers/{start_urls,start_urls_unusable,redis_errors}``,
``redislock/workers/<stage>/dequeued``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from scrapy_redislock._redis import Backoff
from scrapy_redislock.crawl.engine import finish_uncleanly, wake_engine
from scrapy_redislock.crawl.reach import OUTAGE_ERRORS, REDIS_ERRORS, REFUSED
from scrapy_redislock.crawl.stages import stage_of
from scrapy_redislock.workers.policy import next_wake

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

    from scrapy_redislock.crawl.settings import RedisLockSettings
    from scrapy_redislock.lock.core import Clock
    from scrapy_redislock.workers.heartbeat import Heartbeat
    from scrapy_redislock.workers.inflight import InFlight
    from scrapy_redislock.workers.listener import SignalListener
    from scrapy_redislock.workers.outage import OutageLog
    from scrapy_redislock.workers.outbox import Outbox
    from scrapy_redislock.workers.policy import StagePolicy
    from scrapy_redislock.workers.queue import StageQueues
    from scrapy_redislock.workers.stageslot import StageSlot
    from scrapy_redislock.workers.state import WorkerState

# seconds the loop waits past a due heartbeat for the blocked wait to end (a fallback)
WAIT_GRACE = 1.0


logger = logging.getLogger("scrapy_redislock.workers.scheduler")


class WorkerLoop:
    """The steps of one worker (see the module docstring)."""

    def __init__(
        self,
        crawler: Crawler,
        settings: RedisLockSettings,
        policy: StagePolicy,
        queues: StageQueues,
        parts: tuple[WorkerState, InFlight, Outbox, Heartbeat, StageSlot, SignalListener],
        outage: OutageLog,
        clock: Clock,
    ) -> None:
        self.crawler = crawler
        self.stats: Any = crawler.stats
        self.settings = settings
        self.policy = policy
        self.queues = queues
        self.state, self.inflight, self.outbox, self.heartbeat, self.slot, self.listener = parts
        self.outage = outage
        self.clock = clock  # monotonic seconds (the scheduler's: a fake one in unit tests)
        self.idle_close: float | None = None  # the scheduler decides when the spider opens
        self.retry_at = (
            0.0  # after a failed step: the next try (its own back-off, logged once per outage)
        )
        self.retry_backoff = Backoff()

    def may_close(self) -> bool:
        """No work anywhere in the cluster for REDISLOCK_IDLE_CLOSE seconds."""
        state = self.state
        # Redis cannot be asked (down, failing over): the queues may well hold work
        if state.failing:
            return False
        # work somewhere, paused or full: wait for it, never close
        if state.work_seen or state.current is not None:
            return False
        return self.idle_close is not None and self.clock() - state.busy_at >= self.idle_close

    def interval(self) -> float:
        """Seconds until the next step unless woken: the beat (or pulse), the idle close, or the
        back-off after a failed step."""
        if self.state.closing:
            return 0.0
        now = self.clock()
        if self.retry_at > now:  # a step failed in an outage: its back-off first
            return self.retry_at - now
        beats = self.heartbeat.beats
        beat_due = beats.beat_due
        if self.listener.running:
            beat_due += WAIT_GRACE  # the blocked wait ends at the beat and wakes the loop; this is a fallback
        if self.heartbeat.working():
            beat_due = min(beat_due, beats.pulse_due)
        return next_wake(now, beat_due, self.state.quiet_since, self.idle_close)

    async def step(self) -> bool:
        """One step; False once the worker closes."""
        state = self.state
        if state.closing:
            return False
        if self.clock() < self.retry_at:  # woken during the back-off of an outage: wait it out
            return True
        try:
            await self._run()
        except REDIS_ERRORS as exc:
            self.stats.inc_value("redislock/workers/redis_errors")
            state.failed()
            # the others may not reach Redis either: reap nobody until beats run again
            self.heartbeat.beats.broken()
            if not self._outage_step(exc):
                raise  # not an outage (Redis refused a command): logged with its traceback by the loop, retried
            return not state.closing
        # Redis answers again: idle time counts from now, not from before the outage
        if state.answered():
            self._outage_over()
        return not state.closing

    async def _run(self) -> None:
        state = self.state
        await self._beat_if_due(self.clock())
        await self.slot.check_lost()
        await self.slot.check_limit()
        self.inflight.ack_finished()
        if state.take_fed():
            await self.feed()
        if state.current is not None:
            await self._work()
        if state.current is None and state.look_due and not state.closing:
            await self._look()
        self.listener.listen()

    async def _beat_if_due(self, now: float) -> None:
        """The heartbeat (then look at the queues: a token lost on the way is found so), else a
        pulse of a worker with work; and the idle-close deadline, which makes the step look again."""
        state, heartbeat = self.state, self.heartbeat
        if now >= heartbeat.beats.beat_due:
            state.look_soon()
            await self._beat_and_reap()
        elif now >= heartbeat.beats.pulse_due and heartbeat.working():
            await heartbeat.pulse()
        state.idle_due(now, self.idle_close)  # still quiet? then close

    async def _beat_and_reap(self) -> None:
        dead = await self.heartbeat.beat(self.state.current)
        await self.heartbeat.reap(dead)
        await self.slot.read_limit_unseen()
        await self._move_up()

    async def _work(self) -> None:
        """On a stage: pop when the engine runs short; leave the stage once it is drained here and
        in Redis."""
        state = self.state
        stage = state.current
        assert stage is not None
        if state.leaving:
            await self.slot.finish_leaving(stage)
            return
        woken = state.take_signal(stage)
        if stage not in state.empty:
            await self.fill(pass_on=woken)
            if stage in state.empty and stage in state.start_stages:
                await self.feed()  # its queue ran empty: the start URLs may have more for it
        if state.current == stage and stage in state.empty and self.inflight.settled:
            await self.slot.leave()

    async def _look(self) -> None:
        """With no stage: read the feed, look at every queue and the cluster's in-flight counter,
        take a stage."""
        state, inflight = self.state, self.inflight
        state.looking()
        await self.feed()
        lengths, in_flight = await self.queues.look()
        state.looked(lengths)
        for stage in self.policy.to_try(None, lengths):
            if await self.slot.take(stage):
                await self.fill(pass_on=stage in state.signalled)
                break
            state.found_full(stage)
        for stage in sorted(state.signalled):
            # a token for a stage with work this worker did not take (no free slot: its holders',
            # who may wait; or one it did not try, having taken another): passed on
            if stage != state.current and lengths.get(stage):
                await self.queues.signal(stage)
        state.tokens_passed()
        busy = any(lengths.values()) or inflight.holding or self.outbox.local or self.outbox.pushes
        # a paused stage's queue is work: wait, never close
        state.saw_work(bool(busy or in_flight > inflight.own))
        if state.work_seen:
            return
        # looks again when it has been quiet for REDISLOCK_IDLE_CLOSE
        if self.may_close():
            # the engine's idle check (every 5 s) closes the spider from here
            state.idle_reported()
            # the engine checks for idleness at its next round, not in 5 s
            wake_engine(self.crawler)

    async def _move_up(self) -> None:
        """From an uncapped stage, take a preferred capped stage that has work and a free slot (at
        each beat).

        Requests of the uncapped stage already taken finish here (no cap to break); no new ones are
        taken.
        """
        current = self.state.current
        if current is None or current in self.policy.capped or current == self.policy.preference[0]:
            return
        lengths, _ = await self.queues.look()
        self.state.saw_lengths(lengths)
        for stage in self.policy.to_try(current, lengths, self.inflight.holding):
            if await self.slot.take(stage):
                return

    async def fill(self, pass_on: bool = False) -> int:
        """Pop requests of the current stage so that about twice CONCURRENT_REQUESTS are taken."""
        state, inflight = self.state, self.inflight
        stage = state.current
        if stage is None:
            return 0
        inflight.ack_finished()
        want = inflight.wanted()
        if not want:
            return 0
        permit, locks = state.permit, self.slot.locks
        if permit is not None and not permit.usable(self.clock() + locks.renew_interval):
            # the slot's lease ran out here unrenewed (Redis out of reach, a stall): what is popped
            # now would not be handed out, and the slot's next holder would find the queue emptier
            return 0
        popped = await inflight.pop(stage, want, pass_on)
        # taken for dead since the last beat: the beat says so and drops the buffer, then pop
        if popped is None:
            await self.heartbeat.beat(stage)
            popped = await inflight.pop(stage, want, pass_on) or 0
        if popped < want:
            state.ran_empty(stage)
        if popped:
            self.stats.inc_value(f"redislock/workers/{stage}/dequeued", popped)
            state.busy()
            wake_engine(self.crawler)
        return popped

    async def feed(self) -> None:
        """Take a batch of start URLs and turn them into queued requests."""
        feed, state = self.listener.feed, self.state
        if feed is None or not feed.enabled:
            return
        losses = feed.losses_before = self.outbox.losses
        entries = await feed.read()
        if not entries:
            return
        made, failed = feed.requests(entries)
        for data, exc in failed:
            self._unusable_start_url(data, exc)
        for request in made:
            stage = stage_of(request, self.settings, self.crawler.spider)
            if stage is not None:
                state.start_urls_to(stage)
            self.stats.inc_value("redislock/workers/start_urls")
            self.crawler.engine.crawl(request)
        # in their queues before this step looks at the lengths; waited, not gathered: a step
        # cancelled at close must not cancel them (close waits for them, and says what never went)
        pushes = set(self.outbox.pushes)
        if pushes:
            await asyncio.wait(pushes)
        if self.outbox.losses == losses:  # else close gives the take back to the feed
            feed.landed()
        state.busy()
        state.look_again()

    def _unusable_start_url(self, data: Any, exc: Exception) -> None:
        """An entry of the start-URL feed the spider's ``make_request_from_data`` failed on: taken
        from Redis, it is lost; said at ERROR with the entry, counted, and the crawl does not finish
        cleanly (``redislock_start_urls_lost``)."""
        feed = self.listener.feed
        logger.error(
            "Start URL entry %r from %s made no request, and is dropped: %r",
            data,
            feed.key if feed is not None else "the feed",
            exc,
        )
        self.stats.inc_value("redislock/workers/start_urls_unusable")
        finish_uncleanly(self.crawler, "redislock_start_urls_lost", lambda: None)

    def _outage_step(self, exc: BaseException) -> bool:
        """A step failed on a Redis error. An outage (down, paused, restarting, failing over): one
        WARNING for the whole outage (:class:`~scrapy_redislock.workers.outage.OutageLog`), the next
        step after a back-off; True. Anything else (Redis refused a command): False, for the loop to
        log with its traceback."""
        if isinstance(exc, REFUSED) or not isinstance(exc, OUTAGE_ERRORS):
            return False
        delay = self.retry_backoff.next()
        self.retry_at = self.clock() + delay
        self.outage.failed("the worker loop", exc, delay)
        return True

    def _outage_over(self) -> None:
        """A step went through after failing: one INFO line if that ends an outage."""
        self.retry_at = 0.0
        self.retry_backoff.reset()
        self.outage.answered()


__all__ = ["WAIT_GRACE", "WorkerLoop"]
