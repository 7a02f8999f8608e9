"""The worker's beats and idle close on a fake clock (testing/clock.py), with no Redis: the
scheduler built with ``scrapy.utils.test.get_crawler``, as Scrapy's own component tests, its loop
stepped by hand. What Redis answers is scripted (:class:`ScriptedQueues`: the replies of the beat
and look scripts, which test_queue.py runs against a real redis-server), so these tests time the
worker's own decisions: when it beats and pulses, when it may take others for dead, when it
closes, and how it tells an outage."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest
import redis.exceptions
from scrapy import Request, Spider
from scrapy.utils.test import get_crawler

from scrapy_redislock.lock.permit import Permit
from scrapy_redislock.workers.heartbeat import Heartbeat
from scrapy_redislock.workers.listener import SignalListener
from scrapy_redislock.workers.loop import WAIT_GRACE, WorkerLoop
from scrapy_redislock.workers.mixin import StageWorkerMixin
from scrapy_redislock.workers.outage import STRAGGLERS, OutageLog
from scrapy_redislock.workers.policy import liveness
from scrapy_redislock.workers.queue import BeatReply, QueueKeys
from scrapy_redislock.workers.scheduler import StageWorkerScheduler
from scrapy_redislock.workers.stageslot import StageSlot
from testing.clock import FakeClock

T = TypeVar("T")

TTL = 30.0  # REDISLOCK_TTL: an idle worker beats every 10 s, one with work pulses every second
IDLE_CLOSE = 5.0  # REDISLOCK_IDLE_CLOSE


class WorkerSpider(StageWorkerMixin, Spider):
    name = "beats"
    worker_stages = {"list": 1, "detail": None}


class ScriptedWait:
    """The blocked waits (BLPOP for a token, BLMOVE for start URLs): nothing arrives; with ``hold``
    a wait lasts until it is cancelled."""

    def __init__(self) -> None:
        self.waits: list[float] = []  # the timeout of each wait
        self.feed_waits: list[str] = []  # the key of each wait for start URLs
        self.hold = False
        self.refuse_feed = False  # a crawler role without +blmove

    async def wait(self, keys: list[str], timeout: float) -> tuple[str, bytes] | None:
        self.waits.append(timeout)
        if self.hold:
            await asyncio.Event().wait()
        return None

    async def wait_for_entry(self, key: str, timeout: float) -> bool:
        self.feed_waits.append(key)
        if self.refuse_feed:
            raise redis.exceptions.NoPermissionError(
                "User crawler has no permissions to run the 'blmove' command"
            )
        await asyncio.Event().wait()
        return False


class ListFeed:
    """A RedisSpider's list feed on a single Redis, as the listener sees it."""

    key = blocking_key = "beats:start_urls"


class ScriptedQueues:
    """Answers the worker's beats and looks as the queue scripts would, from what the test sets:
    ``dead`` (the workers a beat names past their promise), ``lengths`` and ``in_flight`` (what a
    look reads), ``down`` (every call fails as in an outage). Each beat is recorded as (when on the
    fake clock, stage, grace promised, pulse), and its reply takes ``latency`` seconds of that
    clock."""

    worker = "w1"

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.keys = QueueKeys.of("redislock", WorkerSpider.name)
        self.blocking = ScriptedWait()
        self.beats: list[tuple[float, str | None, float | None, bool]] = []
        self.reaped: list[list[str]] = []
        self.looks = 0
        self.dead: list[str] = []
        self.lengths = {"list": 0, "detail": 0}
        self.in_flight = 0
        self.latency = 0.0
        self.down = False
        self.signals: list[str] = []  # the tokens passed on (LPUSH), in order

    def _answer(self) -> None:
        if self.down:
            raise redis.exceptions.ConnectionError("Error 111 connecting to localhost:6379.")

    async def heartbeat(
        self,
        stage: str | None,
        dead_max: int = 8,
        *,
        grace: float | None = None,
        pulse: bool = False,
    ) -> BeatReply:
        self._answer()
        self.beats.append((self.clock.now, stage, grace, pulse))
        self.clock.advance(self.latency)
        return BeatReply(False, 0, list(self.dead))

    async def reap(self, silent: list[str]) -> dict[str, int]:
        self._answer()
        self.reaped.append(list(silent))
        return dict.fromkeys(silent, 2)  # two requests of each put back

    async def look(self) -> tuple[dict[str, int], int]:
        self._answer()
        self.looks += 1
        return dict(self.lengths), self.in_flight

    async def signal(self, stage: str) -> None:
        self._answer()
        self.signals.append(stage)


class Worker:
    """One worker's scheduler on the fake clock, and its loop driving the scripted queues."""

    def __init__(self, clock: FakeClock) -> None:
        crawler = get_crawler(
            WorkerSpider, {"REDISLOCK_TTL": TTL, "REDISLOCK_IDLE_CLOSE": IDLE_CLOSE}
        )
        self.crawler = crawler
        self.scheduler = scheduler = StageWorkerScheduler(crawler, clock=clock)
        self.queues = queues = ScriptedQueues(clock)
        fake: Any = queues  # stands in for StageQueues
        state, inflight, outbox = scheduler.state, scheduler.inflight, scheduler.outbox
        self.heartbeat = Heartbeat(
            crawler,
            fake,
            state,
            inflight,
            outbox,
            ttl=TTL,
            requeue=scheduler.enqueue_request,
            clock=clock,
        )
        slot = StageSlot(crawler, scheduler.locks, state, inflight, self.heartbeat, clock)
        listener = SignalListener(fake, state, scheduler.policy, self.heartbeat.beats, clock)
        parts = (state, inflight, outbox, self.heartbeat, slot, listener)
        self.loop = WorkerLoop(
            crawler, scheduler.settings, scheduler.policy, fake, parts, scheduler.outage, clock
        )
        self.loop.idle_close = scheduler.loop.idle_close
        self.state = state

    def stat(self, name: str) -> Any:
        return self.crawler.stats.get_value(f"redislock/workers/{name}", 0)  # type: ignore[union-attr]


def run(test: Callable[[FakeClock, Worker], Coroutine[Any, Any, T]]) -> T:
    """Run ``test`` on an asyncio loop (the loop's wake-up event and its wait task need one) with a
    fresh worker on a fake clock at 100 s."""

    async def main() -> T:
        clock = FakeClock(100.0)
        return await test(clock, Worker(clock))

    return asyncio.run(main())


# -- beats -----------------------------------------------------------------------------------------


def test_beats_and_pulses_are_due_from_when_the_last_one_was_sent() -> None:
    async def test(clock: FakeClock, worker: Worker) -> None:
        queues, beats, loop = worker.queues, worker.heartbeat.beats, worker.loop
        queues.latency = 0.25  # each reply comes a quarter second after the beat was sent
        await loop._beat_if_due(clock.now)  # never beaten: due at once
        # idle: promises the next beat within the ttl, beats every ttl/3
        assert queues.beats == [(100.0, None, TTL, False)]
        assert (beats.beat_at, beats.replied_at, beats.beat_due) == (100.0, 100.25, 110.0)
        assert beats.pulse_due == 110.0 and not worker.heartbeat.working()

        worker.state.took("list", None)  # work: a pulse every second, dead after 5 s of silence
        await worker.heartbeat.beat("list")
        assert queues.beats[-1] == (100.25, "list", 5.0, False)
        assert (beats.beat_due, beats.pulse_due) == (110.25, 101.25)
        # the pulse (a second after the beat was sent, 0.75 s after its reply), not the heartbeat
        assert clock.now == 100.5 and loop.interval() == pytest.approx(0.75)

        clock.advance(0.75)  # 101.25: the pulse is due
        assert loop.interval() == 0.0
        await loop._beat_if_due(clock.now)
        assert queues.beats[-1] == (101.25, "list", 5.0, True)
        assert (beats.beat_due, beats.pulse_due) == (110.25, 102.25)  # a pulse moves no heartbeat

        clock.advance(0.5)  # 102.0: nothing due
        await loop._beat_if_due(clock.now)
        assert len(queues.beats) == 3 and loop.interval() == pytest.approx(0.25)

        clock.advance(8.25)  # 110.25: the heartbeat (not a pulse) is due, and looks again
        worker.state.looking()
        await loop._beat_if_due(clock.now)
        assert queues.beats[-1] == (110.25, "list", 5.0, False)
        assert beats.beat_due == 120.25 and worker.state.look_due

    run(test)


def test_a_worker_silent_for_most_of_its_promise_hands_out_nothing_it_took_ahead() -> None:
    async def test(clock: FakeClock, worker: Worker) -> None:
        scheduler = worker.scheduler
        scheduler.state.took("detail", None)  # uncapped: no slot lease to check
        beats = scheduler.heartbeat.beats
        beats.beaten(clock.now, clock.now, liveness(TTL, working=True))  # promises 5 s
        first, second = Request("https://shop.test/1"), Request("https://shop.test/2")
        scheduler.inflight.buffer.extend([(first, "1"), (second, "2")])
        clock.advance(4.0)  # 104: 0.8 of the promise, not more
        assert scheduler.next_request() is first
        clock.advance(0.1)  # 104.1: stalled; the others may have requeued what it took ahead
        assert scheduler.next_request() is None
        assert list(scheduler.inflight.buffer) == [(second, "2")]
        beats.beaten(
            clock.now, clock.now, liveness(TTL, working=True)
        )  # the next beat went through
        assert scheduler.next_request() is second

    run(test)


def test_a_worker_whose_slot_lease_ran_out_here_pops_no_more_of_its_stage() -> None:
    """The capped stage's slot was not renewed within its lease on this worker's clock (Redis out of
    reach, the renewal still backing off): the loop pops nothing more of the stage, which it could
    not hand out, and which the slot's next holder would then find missing from the queue."""

    async def test(clock: FakeClock, worker: Worker) -> None:
        permit = Permit("workers:list", "w1", "1-1", 1, clock.now)
        permit.leased(clock.now, TTL)
        worker.state.took("list", permit)
        pops: list[int] = []

        async def pop(stage: str, want: int, pass_on: bool) -> int:
            pops.append(want)
            return 0

        worker.scheduler.inflight.pop = pop  # type: ignore[method-assign]
        interval = worker.scheduler.locks.renew_interval
        clock.advance(TTL - interval - 0.5)  # more than a renewal interval of lease left: pops
        await worker.loop.fill()
        assert len(pops) == 1
        clock.advance(0.6)  # less than that left, unrenewed: no pop
        assert await worker.loop.fill() == 0
        assert len(pops) == 1

    run(test)


def test_a_stage_taken_as_an_outage_begins_is_said_and_counted() -> None:
    """The beat that follows a take fails (Redis just went out of reach): the worker works on the
    stage all the same, so the take is said and counted, not left out."""

    async def test(clock: FakeClock, worker: Worker) -> None:
        worker.queues.down = True
        with pytest.raises(redis.exceptions.ConnectionError):
            await worker.loop.slot.take("detail")
        assert worker.state.current == "detail"
        assert worker.stat("detail/taken") == 1

    run(test)


def test_a_token_for_a_stage_this_worker_did_not_take_is_passed_on() -> None:
    """Idle, the worker is woken by tokens for both stages, which both have work; it takes the one
    it prefers. The other's token goes on to another idle worker (before, it was dropped, and that
    stage waited for an idle worker's next heartbeat); a token for a stage with no work is not."""

    async def test(clock: FakeClock, worker: Worker) -> None:
        queues, state = worker.queues, worker.state
        queues.lengths = {"list": 5, "detail": 5}
        state.signal_came("list")
        state.signal_came("detail")
        taken: list[str] = []

        async def take(stage: str) -> bool:
            taken.append(stage)
            state.took(stage, None)
            return True

        worker.loop.slot.take = take  # type: ignore[method-assign]
        worker.loop.fill = lambda pass_on=False: asyncio.sleep(0, 0)  # type: ignore[method-assign,assignment]
        await worker.loop._look()
        assert len(taken) == 1
        other = ({"list", "detail"} - set(taken)).pop()
        assert queues.signals == [other]
        state.left()
        queues.lengths = {"list": 0, "detail": 5}
        state.signal_came("list")
        queues.signals.clear()
        worker.loop.slot.take = lambda stage: asyncio.sleep(0, False)  # type: ignore[method-assign]
        await worker.loop._look()
        assert queues.signals == []  # list has no work; detail was tried, and is not signalled

    run(test)


def test_the_dead_are_requeued_only_after_six_seconds_of_beats_without_a_gap() -> None:
    async def test(clock: FakeClock, worker: Worker) -> None:
        queues, loop = worker.queues, worker.loop
        worker.state.took("list", None)  # working: pulses every second
        queues.dead = ["w2"]  # every beat names w2 past its promise
        await loop._beat_if_due(clock.now)  # 100: the first beat starts the streak
        for _ in range(5):  # pulses at 101 .. 105: beating for less than RECOVERY (6 s)
            clock.advance(1.0)
            await loop._beat_if_due(clock.now)
        assert len(queues.beats) == 6 and queues.reaped == []
        clock.advance(1.0)  # 106: six seconds of beats without a gap
        await loop._beat_if_due(clock.now)
        assert queues.reaped == [["w2"]] and worker.stat("requeued") == 2

        clock.advance(1.0)  # 107: an outage; the step's beat fails
        queues.down = True
        assert await loop.step()
        assert worker.state.failing and worker.heartbeat.beats.streak_since is None
        assert worker.stat("redis_errors") == 1
        assert 107.05 <= loop.retry_at <= 107.1  # the first back-off: 0.1 s, jittered
        assert loop.interval() == pytest.approx(loop.retry_at - clock.now)
        assert await loop.step() and len(queues.beats) == 7  # within the back-off: no step

        queues.down = False  # back: beats again from 108, reaps nobody for six seconds
        for _ in range(6):  # 108 .. 113
            clock.advance(1.0)
            await loop._beat_if_due(clock.now)
        assert len(queues.reaped) == 1
        clock.advance(1.0)  # 114: beating again for six seconds
        await loop._beat_if_due(clock.now)
        assert queues.reaped == [["w2"], ["w2"]] and worker.stat("requeued") == 4

        clock.advance(4.0)  # 118: four seconds of silence (a stall) break the streak
        await loop._beat_if_due(clock.now)
        assert worker.heartbeat.beats.streak_since == 118.0 and len(queues.reaped) == 2

    run(test)


def test_the_wait_for_start_urls_goes_on_when_the_worker_leaves_its_stage() -> None:
    """A worker on the stage its start URLs went to, its queue found empty, waits for a token and
    for start URLs. It leaves the stage: the wait for a token starts again on the new keys, the
    wait for start URLs goes on (it was cancelled with the other, and not started again until the
    next heartbeat)."""

    async def test(clock: FakeClock, worker: Worker) -> None:
        listener, state, blocking = worker.loop.listener, worker.state, worker.queues.blocking
        listener.feed = ListFeed()  # type: ignore[assignment]
        blocking.hold = True
        state.took("list", None)
        state.start_urls_to("list")
        state.ran_empty("list")
        listener.listen()
        await asyncio.sleep(0)
        feed_wait, token_wait = listener.feed_task, listener.task
        assert feed_wait is not None and token_wait is not None and listener.running
        state.current = None  # it left the stage
        listener.listen()
        await asyncio.sleep(0)
        assert token_wait.cancelled() and listener.task is not token_wait and listener.running
        assert listener.feed_task is feed_wait and not feed_wait.done()
        assert blocking.feed_waits == [ListFeed.key]
        listener.cancel()
        await asyncio.sleep(0)
        assert feed_wait.cancelled()

    run(test)


def test_a_refused_wait_for_start_urls_is_said_once_and_not_sent_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Redis refuses BLMOVE (a crawler role without +blmove): one WARNING naming the fix, and no
    wait for start URLs at the steps after it (the heartbeat's reads serve the feed), where each
    step sent one more refused command."""

    async def test(clock: FakeClock, worker: Worker) -> None:
        listener, state, blocking = worker.loop.listener, worker.state, worker.queues.blocking
        listener.feed = ListFeed()  # type: ignore[assignment]
        blocking.refuse_feed = True
        for _ in range(5):
            listener.listen()
            await asyncio.sleep(0)
            assert listener.feed_task is None or listener.feed_task.done()
        assert blocking.feed_waits == [ListFeed.key]
        assert state.current is None  # it was where the feed is read

    with caplog.at_level(logging.WARNING, logger="scrapy_redislock.workers.listener"):
        run(test)
    said = [r.getMessage() for r in caplog.records if "refused BLMOVE" in r.getMessage()]
    assert len(said) == 1 and "acl crawler" in said[0], said


# -- idle close ------------------------------------------------------------------------------------


def test_an_idle_worker_closes_once_nothing_was_seen_for_the_idle_close() -> None:
    async def test(clock: FakeClock, worker: Worker) -> None:
        queues, loop, state, scheduler = worker.queues, worker.loop, worker.state, worker.scheduler
        state.opened()  # 100: idle time counts from the open
        assert await loop.step()  # beats, looks: nothing anywhere
        await asyncio.sleep(0)  # the blocked wait the step started runs
        assert queues.looks == 1 and state.quiet_since == 100.0 and not scheduler.may_close()
        # then waits in Redis until the beat, and wakes for the idle close before that
        assert queues.blocking.waits == [pytest.approx(10.0 + 0.01)]  # the beat and BEAT_MARGIN
        assert loop.interval() == pytest.approx(IDLE_CLOSE)

        clock.advance(4.9)  # 104.9: not idle long enough, no look
        assert await loop.step()
        assert queues.looks == 1 and not loop.may_close()
        assert loop.interval() == pytest.approx(0.1)

        clock.advance(0.1)  # 105: idle for REDISLOCK_IDLE_CLOSE: looks once more, then may close
        assert await loop.step()
        assert queues.looks == 2 and scheduler.may_close()
        assert state.quiet_since is None  # told the engine: nothing more to time
        assert loop.interval() == pytest.approx(110.0 + WAIT_GRACE - 105.0)  # the beat only

    run(test)


def test_work_seen_anywhere_starts_the_idle_time_again() -> None:
    async def test(clock: FakeClock, worker: Worker) -> None:
        queues, loop, state = worker.queues, worker.loop, worker.state
        state.opened()
        queues.in_flight = 3  # another worker's requests in flight
        assert await loop.step()
        assert state.work_seen and not loop.may_close()
        clock.advance(60.0)  # 160: a minute later, still work in flight: never closes
        state.look_soon()
        assert await loop.step() and not loop.may_close()
        assert state.busy_at == 160.0

        queues.in_flight = 0  # 163: the work is gone; idle since it was last seen (160)
        clock.advance(3.0)
        state.look_soon()
        assert await loop.step()
        assert state.quiet_since == 160.0 and not loop.may_close()
        clock.advance(2.0)  # 165: idle for 5 s since the last work seen
        assert await loop.step() and loop.may_close()

    run(test)


def test_an_outage_never_closes_an_idle_worker_and_idle_time_counts_from_its_end() -> None:
    async def test(clock: FakeClock, worker: Worker) -> None:
        queues, loop, state = worker.queues, worker.loop, worker.state
        state.opened()
        assert await loop.step()  # 100: nothing anywhere
        clock.advance(4.0)
        queues.down = True
        clock.advance(6.0)  # 110: the beat's step fails; idle for 10 s, but Redis cannot be asked
        assert await loop.step()
        assert state.failing and not loop.may_close()
        clock.advance(20.0)  # 130: still down
        assert await loop.step() and not loop.may_close()

        queues.down = False  # 140: Redis answers; the idle time counts from now
        clock.advance(10.0)
        assert await loop.step()
        assert not state.failing and state.busy_at == 140.0 and loop.retry_at == 0.0
        assert not loop.may_close()
        clock.advance(IDLE_CLOSE)  # 145
        assert await loop.step() and loop.may_close()

    run(test)


# -- outages ---------------------------------------------------------------------------------------


def test_an_outage_is_said_once_with_how_long_it_lasted_and_its_stragglers_are_not_a_new_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock(100.0)
    outage = OutageLog("w1", clock=clock)
    refused = redis.exceptions.ConnectionError("Error 111 connecting to localhost:6379.")

    def said() -> list[tuple[int, str]]:
        lines = [
            (r.levelno, r.getMessage())
            for r in caplog.records
            if r.name == "scrapy_redislock.workers.scheduler"  # not asyncio's, say
        ]
        caplog.clear()
        return lines

    with caplog.at_level(logging.DEBUG, logger="scrapy_redislock.workers.scheduler"):
        outage.failed("the worker loop", refused, 0.1)  # 100: the outage starts
        assert [level for level, _ in said()] == [logging.WARNING] and outage.since == 100.0
        clock.advance(1.0)
        outage.failed("an ack", refused, 0.2)  # the same outage: DEBUG
        assert [level for level, _ in said()] == [logging.DEBUG]
        clock.advance(6.5)  # 107.5: an answer ends it
        outage.answered()
        assert said() == [
            (
                logging.INFO,
                "Worker w1: Redis answers again after 7.5 s (2 failed calls retried); going on",
            )
        ]
        clock.advance(STRAGGLERS - 0.1)  # a call sent before the end fails just after it
        outage.failed("a push", refused)
        assert [level for level, _ in said()] == [logging.DEBUG] and not outage.down
        clock.advance(0.1)  # STRAGGLERS after the end: a new outage
        outage.failed("a push", refused)
        assert [level for level, _ in said()] == [logging.WARNING] and outage.down
