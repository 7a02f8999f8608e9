"""SignalListener: a worker with nothing to pop blocks in Redis until there is work.

It blocks (BLPOP, on its own connection) on the signal lists the policy names
(:meth:`~scrapy_redislock.workers.policy.StagePolicy.listens_to`) and the crawl's wake list, until
a token arrives or until its heartbeat is due; then it wakes the loop. Meanwhile, with no stage or
on a stage start URLs went to, it waits on a list feed of start URLs (BLMOVE onto itself, on a
second connection: no entry taken, so none lost to a cancelled wait or a reply the network lost),
and an entry there makes the loop take a batch (:mod:`~scrapy_redislock.workers.feed`). One BLPOP,
and one BLMOVE with a list feed, per heartbeat period while nothing happens. Reads no settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from redis.exceptions import NoPermissionError

from scrapy_redislock.crawl.reach import REDIS_ERRORS

if TYPE_CHECKING:
    from scrapy_redislock.lock.core import Clock
    from scrapy_redislock.workers.feed import StartUrlFeed
    from scrapy_redislock.workers.policy import BeatClock, StagePolicy
    from scrapy_redislock.workers.queue import StageQueues
    from scrapy_redislock.workers.state import WorkerState

logger = logging.getLogger("scrapy_redislock.workers.scheduler")

# seconds a blocked wait lasts past the due heartbeat (Redis's timeouts count whole milliseconds)
BEAT_MARGIN = 0.01


class SignalListener:
    """The blocked waits of a worker, for a token and for start URLs (see the module docstring)."""

    def __init__(
        self,
        queues: StageQueues,
        state: WorkerState,
        policy: StagePolicy,
        beats: BeatClock,
        clock: Clock,
    ) -> None:
        self.queues = queues
        self.state = state
        self.policy = policy
        self.beats = beats  # the heartbeat's schedule: a wait lasts until the next beat is due
        self.clock = clock  # monotonic seconds (the scheduler's: a fake one in unit tests)
        self.feed: StartUrlFeed | None = None  # set when the spider opens
        self.task: asyncio.Task[None] | None = None
        self.listening: list[str] = []  # the keys the running wait blocks on
        self.feed_task: asyncio.Task[None] | None = None  # the wait for start URLs
        # Redis refused it (an ACL role without BLMOVE): said once, and not sent again this run
        self.feed_wait_refused = False

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def cancel(self) -> None:
        for task in (self.task, self.feed_task):
            if task is not None:
                task.cancel()

    def _keys(self) -> list[str]:
        state = self.state
        if state.closing:
            return []
        stages = self.policy.listens_to(
            state.current, state.empty, state.full, leaving=state.leaving
        )
        if not stages:
            return []
        return [self.queues.keys.signal(stage) for stage in stages] + [self.queues.keys.wake]

    def listen(self) -> None:
        """Block in Redis (in a task) on the signal lists the policy names, unless a wait on them
        already runs; and on the start-URL feed, where the loop would read it (see the module
        docstring)."""
        keys = self._keys()
        state, feed = self.state, self.feed
        feed_key = feed.blocking_key if feed is not None else None
        if (
            keys
            and feed_key
            and (state.current is None or state.current in state.start_stages)
            and (self.feed_task is None or self.feed_task.done())
            and not self.feed_wait_refused  # the heartbeat's reads serve it then
        ):
            self.feed_task = asyncio.get_running_loop().create_task(
                self._wait_for_start_urls(feed_key)
            )
        if self.running and (keys == self.listening or not keys):
            return  # a wait no longer needed ends at its timeout; a token it takes meanwhile is handled or put back
        if self.running and self.task is not None:
            # a stage change: the old wait's keys are stale (costs a reconnect); the wait for start
            # URLs goes on
            self.task.cancel()
        self.listening = keys
        self.task = None
        if keys:
            self.task = asyncio.get_running_loop().create_task(self._wait_for_work(keys))

    async def _wait_for_work(self, keys: list[str]) -> None:
        """Block until a token arrives, or until the heartbeat is due; then wake the loop
        (one BLPOP per heartbeat period while nothing happens)."""
        state, queue_keys = self.state, self.queues.keys
        try:
            # Just past the beat: a wait that ended a moment before it would find nothing due and
            # wait again.
            timeout = max(0.0, self.beats.beat_due - self.clock()) + BEAT_MARGIN
            reply = await self.queues.blocking.wait(keys, timeout)
        except REDIS_ERRORS as exc:
            # Not woken: the loop's next step (at the beat, or after its back-off) waits again.
            logger.debug(
                "Waiting for work: Redis error (%s); the loop waits again at its next step", exc
            )
            self.beats.broken()  # the others may not reach Redis either: reap nobody until beats run again
            return
        if reply is not None:
            key, _value = reply
            state.look_soon()
            if key == queue_keys.wake:
                state.idle_from_now()  # the crawl has just ended
            else:
                stage = next(s for s in self.policy.preference if queue_keys.signal(s) == key)
                if state.current is not None and stage != state.current:
                    with contextlib.suppress(*REDIS_ERRORS):
                        await self.queues.signal(stage)  # not for us any more: the next worker's
                else:
                    state.signal_came(stage)
        state.wake()

    async def _wait_for_start_urls(self, key: str) -> None:
        """Block until the feed has an entry, or until the heartbeat is due; then wake the loop to
        take a batch."""
        try:
            timeout = max(0.0, self.beats.beat_due - self.clock()) + BEAT_MARGIN
            if not await self.queues.blocking.wait_for_entry(key, timeout):
                return  # the heartbeat's step arms it again
        except REDIS_ERRORS as exc:
            # the command refused (an ACL), not a passing AUTH failure (a restart, a failover)
            if isinstance(exc, NoPermissionError) and not self.feed_wait_refused:
                self.feed_wait_refused = True  # said once
                logger.warning(
                    "Waiting for start URLs at %s: Redis refused BLMOVE (%s); for the rest of this run they are read at each heartbeat instead. A crawler ACL user needs +blmove: set its rules again with python -m scrapy_redislock.cli.acl crawler",  # noqa: E501
                    key,
                    exc,
                )
            elif not self.feed_wait_refused:
                logger.debug(
                    "Waiting for start URLs: Redis error (%s); waits again at the next step", exc
                )
            return
        self.state.start_urls_came()
        self.state.wake()


__all__ = ["BEAT_MARGIN", "SignalListener"]
