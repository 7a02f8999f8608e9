"""Heartbeat: a worker's beats in Redis, what they tell it, and requeueing the dead.

Each beat is one script (``scripts/queue_beat.lua``, its reply a
:class:`~scrapy_redislock.workers.queue.BeatReply`) that promises the next beat within a
grace (:func:`~scrapy_redislock.workers.policy.liveness`), names the workers past their promise and
tells this worker whether it was registered. A worker that finds itself unregistered was taken for
dead after a stall (it drops what it took ahead: the others have it), or Redis lost the crawl state
(the queues' epoch changed: said loudly, see :meth:`Heartbeat.queues_lost`). A beat that finds more
in this worker's in-flight record than it knows of reclaims the rest (a pop whose reply was lost).

Reads no settings (the scheduler passes REDISLOCK_TTL). Stats:
``redislock/workers/{presumed_dead,reclaimed,requeued,queue_lost}``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from scrapy import Request

from scrapy_redislock._redis import printable
from scrapy_redislock.crawl.engine import finish_uncleanly
from scrapy_redislock.workers.policy import BeatClock, liveness

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

    from scrapy_redislock.lock.core import Clock
    from scrapy_redislock.workers.inflight import InFlight
    from scrapy_redislock.workers.outbox import Outbox
    from scrapy_redislock.workers.queue import StageQueues
    from scrapy_redislock.workers.state import WorkerState

logger = logging.getLogger("scrapy_redislock.workers.scheduler")


class Heartbeat:
    """One worker's beats and what it does with their replies (see the module docstring)."""

    def __init__(
        self,
        crawler: Crawler,
        queues: StageQueues,
        state: WorkerState,
        inflight: InFlight,
        outbox: Outbox,
        *,
        ttl: float,
        requeue: Callable[[Request], bool],
        clock: Clock,
    ) -> None:
        self.crawler = crawler
        self.stats: Any = crawler.stats
        self.queues = queues
        self.state = state
        self.inflight = inflight
        self.outbox = outbox
        self.ttl = ttl
        self.requeue = requeue  # queue a request in Redis again (the scheduler's enqueue_request)
        self.clock = clock  # monotonic seconds (the scheduler's: a fake one in unit tests)
        self.beats = BeatClock(ttl, clock())
        # the queues' epoch this worker saw (changes only when the crawl state is gone)
        self.epoch: str | None = None
        # Redis lost the crawl state while this worker knew of work: close as redislock_queue_lost
        self.lost = False

    def working(self, stage: str | None = None) -> bool:
        """Whether this worker has work whose loss would cost time if it died: a stage, or requests
        in flight."""
        inflight = self.inflight
        return (stage or self.state.current) is not None or inflight.own > 0 or inflight.holding

    async def beat(self, stage: str | None, pulse: bool = False) -> list[str]:
        """Beat (on ``stage``); the workers past their promise."""
        sent = self.clock()
        plan = liveness(self.ttl, self.working(stage))
        inflight = self.inflight
        still, own = self._record_still(), inflight.own
        new, holds, dead = await self.queues.heartbeat(stage, grace=plan.grace, pulse=pulse)
        self.beats.beaten(sent, self.clock(), plan, pulse)
        # Redis lost the crawl state: not taken for dead (see queues_lost)
        if new and await self.queues_lost():
            new = False
        recount = not (new or pulse) and still and self._record_still() and inflight.own == own
        if recount:
            # nothing changed the record meanwhile: its length is what this worker holds (an ack
            # sent again after a lost reply drops nothing, and would leave ``own`` too high)
            inflight.own = holds
        if not new and not pulse and holds > len(self.inflight.known_ids()):
            moved = await self._reclaim()
            if recount:
                inflight.own -= moved  # counted just now; otherwise never counted
        if new and self.inflight.own:
            self._taken_for_dead()
        if new:
            self.inflight.own = 0
        return dead

    def _taken_for_dead(self) -> None:
        # Silent for a TTL (a stall: CPU starvation, a debugger, SIGSTOP, a long blocking call): the
        # others put this worker's in-flight requests back in the queues. The unstarted ones are
        # dropped here; the ones already started (downloads, at most CONCURRENT_REQUESTS, responses
        # waiting for their callback, finished ones not acknowledged yet) get fetched twice.
        inflight = self.inflight
        dropped = len(inflight.drop_ahead())
        self.stats.inc_value("redislock/workers/presumed_dead")
        logger.warning(
            "Worker %s was silent for the TTL and taken for dead: dropped %d requests taken ahead (the others have them), %d started here may get fetched twice",  # noqa: E501
            self.queues.worker,
            dropped,
            len(inflight.handed)
            + len(inflight.unstaged)
            + len(inflight.acks)
            + len(inflight.acking),
        )

    async def pulse(self) -> None:
        """A worker with work beats at least every second (its promise is a few seconds: see
        policy.liveness), so that a killed worker's requests are fetched again within seconds; the
        pulse also names the dead."""
        await self.reap(await self.beat(self.state.current, pulse=True))

    def _record_still(self) -> bool:
        """No call that changes this worker's in-flight record is under way (an ack, a push, a
        keep): a beat's count of the record then is what the worker holds."""
        outbox = self.outbox
        return not (self.inflight.tasks or outbox.pushes or outbox.keeping)

    async def _reclaim(self) -> int:
        """The in-flight record holds more than this worker knows of: a pop (or a keep of requests
        with no stage) ran in Redis but its reply was lost (a connection cut, a failover; a cluster
        client may also have run it again). Those requests go back to the front of their queues,
        for whichever worker comes first. Not while a keep awaits its reply (its entries are in the
        record, not known yet): the next beat looks again. How many went back."""

        def known() -> list[str] | None:
            return None if self.outbox.keeping else self.inflight.known_ids()

        if self.outbox.keeping:
            return 0
        moved = await self.queues.reclaim(known)
        if moved:
            self.stats.inc_value("redislock/workers/reclaimed", moved)
            logger.warning(
                "Worker %s put %d requests back in their queues: popped by a call whose reply was lost",
                self.queues.worker,
                moved,
            )
            self.state.look_again()
        return moved

    async def reap(self, dead: list[str]) -> None:
        """Requeue the requests of the workers a beat named dead, once this worker's own beats have
        reached Redis without a gap for a while (policy.may_reap): right after an outage or a stall
        of its own, the others may not have beaten yet either."""
        if not dead or not self.beats.may_reap(self.clock()):
            return
        reaped = await self.queues.reap(dead)
        for worker, moved in reaped.items():
            logger.warning(
                "Worker %s stopped beating: put %d of its requests back in the queues",
                printable(worker),  # a name read from Redis: any writer chose it
                moved,
            )
            self.stats.inc_value("redislock/workers/requeued", moved)

    def knows_of_work(self) -> bool:
        """Whether this worker knew of queued or in-flight work: its own (popped, in progress, taken
        ahead), its stage's queue not yet found empty, or work anywhere at its last look (paused and
        full stages included)."""
        state = self.state
        return bool(
            self.inflight.own
            or self.inflight.holding
            or state.on_stage_with_work()
            or state.work_seen
        )

    async def queues_lost(self) -> bool:
        """After a beat that found this worker unregistered (its first beat, taken for dead, or
        Redis lost the crawl state): read the queues' epoch (one script, only then). Another epoch
        than the one seen before means the crawl state is gone, not that the others took this worker
        for dead: every request queued in any stage and in flight in any worker, the dupefilter, the
        registry.

        Said loudly when this worker knew of work: ERROR once, stat
        ``redislock/workers/queue_lost``, and its idle close finishes as ``redislock_queue_lost``
        (another finish reason is kept), exit status 1.
        What it still holds is kept: the requests it had taken ahead go back to the (new) queues,
        the ones in progress finish here and queue what they yield. True if lost."""
        epoch = await self.queues.epoch()
        seen, self.epoch = self.epoch, epoch
        if seen is None or seen == epoch:
            return False
        knew, queued = self.knows_of_work(), sum(self.state.lengths.values())
        ahead = self.inflight.drop_ahead()
        self.inflight.detach()  # their ids name entries of the new record now
        # the shared dupefilter went with the rest: what this worker sent is no longer there
        self.outbox.known.clear()
        for request in ahead:
            # into the new queues (their in-flight record is gone with the rest)
            self.requeue(request)
        self.inflight.own = 0
        self.state.look_again()
        spider = self.crawler.spidercls.name
        if not knew:
            logger.warning(
                "Worker %s: the worker queues of spider %r were emptied in Redis (a restart without persistence, or FLUSHALL); this worker knew of no queued or in-flight work. The dupefilter went with them: pages fetched before may be fetched again",  # noqa: E501
                self.queues.worker,
                spider,
            )
            return True
        self.lost = True
        self.stats.inc_value("redislock/workers/queue_lost")
        # exit status 1 (the idle close's reason is redislock_queue_lost; another is kept)
        finish_uncleanly(self.crawler, "redislock_queue_lost", lambda: None)
        logger.error(
            "Worker %s: Redis lost the worker queues of spider %r (restarted without persistence, flushed, or a replica without them promoted): every request queued in any stage (%d at this worker's last look) and in flight in any other worker is gone, the dupefilter with them; they cannot be recovered. This worker queues again the %d requests it had taken ahead and finishes the %d in progress; once idle it closes as redislock_queue_lost (REDISLOCK_IDLE_CLOSE). Keep the queues with Redis persistence (appendonly yes), or use the request front, whose queue lives in each process",  # noqa: E501
            self.queues.worker,
            spider,
            queued,
            len(ahead),
            len(self.inflight.handed),
        )
        return True


__all__ = ["Heartbeat"]
