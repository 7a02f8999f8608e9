"""StageWorkerScheduler: per-stage request queues in Redis, served only to workers holding the stage's slot.

Each stage's pending requests live in a Redis list ``<prefix>:{<spider>}:queue:<stage>`` with one shared
dupefilter set; a worker holds a slot of one stage at a time (an AsyncCountingLock named ``workers:<stage>``,
capped by ``worker_stages``) and only pops that stage's queue. Requests it yields for other stages go to their
queues for whichever worker holds them. Popped requests are recorded in the worker's in-flight hash until
their download is over; a worker that stops beating for one TTL (killed) has its in-flight requests put back at
the front of their queues by the others. A request leaves the in-flight record only once the requests its
callback yielded are in Redis (AckAfterOutput); the killed worker's last pages are fetched again (at least
once). Known bug: rarely, the children of one page the killed worker had just parsed are lost (see README).
All Redis calls use ``redis.asyncio``; every state change is one Lua script.

Settings read: REDISLOCK_WORKER_STAGES (or the spider's ``worker_stages``), REDISLOCK_STAGE_PREFERENCE (or the
spider's ``stage_preference``), REDISLOCK_IDLE_CLOSE (seconds with no work anywhere before a worker closes;
None = idle forever like RedisSpider), REDISLOCK_TTL, REDISLOCK_KEY_PREFIX, REDISLOCK_URL (via config).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import socket
import time
import uuid
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import redis.exceptions
from scrapy import Request, signals
from scrapy.utils.request import request_from_dict

from scrapy_redislock.config import check_stage_limits, read_settings
from scrapy_redislock.core import load_scripts
from scrapy_redislock.errors import ConfigError
from scrapy_redislock.scheduler import wake_engine
from scrapy_redislock.stagelocks import StageLocks
from scrapy_redislock.stages import stage_of

if TYPE_CHECKING:
    from scrapy import Spider
    from scrapy.crawler import Crawler

    from scrapy_redislock.core import Permit

logger = logging.getLogger(__name__)

TICK = 0.2


class StageWorkerScheduler:
    """The scheduler of a StageWorkerMixin spider (see the module docstring)."""

    def __init__(self, crawler: Crawler) -> None:
        self.crawler = crawler
        self.settings = read_settings(crawler.settings)
        spidercls = crawler.spidercls
        stages = getattr(spidercls, "worker_stages", None) or self.settings.worker_stages
        if not stages:
            raise ConfigError("StageWorkerScheduler needs REDISLOCK_WORKER_STAGES or a spider.worker_stages dict")
        stages = check_stage_limits(stages, "worker_stages")
        preference = list(getattr(spidercls, "stage_preference", None) or self.settings.stage_preference or stages)
        unknown = sorted(set(preference) - set(stages))
        if unknown:
            raise ConfigError(f"stage_preference names unknown stages {unknown}; known: {sorted(stages)}")
        self.preference = preference + [s for s in stages if s not in preference]
        self.settings = replace(self.settings, worker_stages=stages, stages=stages)
        idle = crawler.settings.get("REDISLOCK_IDLE_CLOSE")
        try:
            self.idle_close = None if idle in (None, "", "None") else float(idle)
        except (TypeError, ValueError):
            raise ConfigError(f"REDISLOCK_IDLE_CLOSE must be None or seconds, got {idle!r}") from None
        self.stages = stages
        self.worker = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        base = f"{self.settings.key_prefix}:{{{spidercls.name}}}"
        self.keys = {
            "dupefilter": f"{base}:dupefilter",
            "alive": f"{base}:alive",
            "ids": f"{base}:ids",
            "inflight": f"{base}:inflight:{self.worker}",
            "working": f"{base}:working",
        }
        self.queue_keys = {stage: f"{base}:queue:{stage}" for stage in stages}
        self.locks = StageLocks(
            crawler, self.settings, stages, lock_prefix="workers:", stats_prefix="redislock/workers"
        )
        self.client = self.locks.client
        self.scripts = {
            n: self.client.register_script(src) for n, src in load_scripts().items() if n.startswith("queue_")
        }
        self.buffer: deque[tuple[Request, bytes]] = deque()
        self.local: deque[Request] = deque()  # requests with no stage: this worker's own
        self.inflight: dict[Request, bytes] = {}
        self.current: str | None = None
        self.permit: Permit | None = None
        self.pushing: set[asyncio.Task[Any]] = set()
        self.lengths: dict[str, int] = dict.fromkeys(stages, 0)
        self.cluster_busy_at = time.monotonic()
        self.loop_task: asyncio.Task[None] | None = None
        self.refill = asyncio.Event()
        self.concurrency = crawler.settings.getint("CONCURRENT_REQUESTS")
        self.spider: Spider | None = None
        self.awaiting_output: set[Request] = set()
        crawler.signals.connect(self.response_in, signal=signals.response_received)
        crawler.signals.connect(self.request_done, signal=signals.request_left_downloader)
        crawler.signals.connect(self.request_done, signal=signals.request_dropped)

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> StageWorkerScheduler:
        return cls(crawler)

    # -- scheduler interface ----------------------------------------------------------------

    def open(self, spider: Spider) -> Any:
        from scrapy.utils.defer import deferred_from_coro

        self.spider = spider
        return deferred_from_coro(self._open())

    async def _open(self) -> None:
        await self.locks.start_once()
        await self._beat()
        self.loop_task = asyncio.get_running_loop().create_task(self._run())

    def close(self, reason: str) -> Any:
        from scrapy.utils.defer import deferred_from_coro

        return deferred_from_coro(self._close())

    async def _close(self) -> None:
        """Hand back what this worker holds; every step is bounded, so a close never hangs."""
        if self.loop_task is not None:
            self.loop_task.cancel()
            await self._bounded("stopping the worker loop", asyncio.wait({self.loop_task}))
        if self.pushing:
            await self._bounded("queueing the last requests", asyncio.wait(set(self.pushing)))
        # Unstarted and unfinished requests go back to the front of their queues for the other workers.
        await self._bounded("requeueing this worker's requests", self._requeue(self.worker, "0"))
        self.buffer.clear()
        await self._bounded("freeing the stage slot", self.locks.close())

    async def _bounded(self, what: str, step: Any, seconds: float = 10.0) -> None:
        try:
            await asyncio.wait_for(step, seconds)
        except (TimeoutError, redis.exceptions.RedisError) as exc:
            logger.warning(
                "On close, %s failed (%s); the other workers recover it after the TTL", what, exc or "timeout"
            )

    def has_pending_requests(self) -> bool:
        return bool(self.buffer or self.local or self.pushing)

    def __len__(self) -> int:
        return len(self.buffer) + len(self.local)

    def enqueue_request(self, request: Request) -> bool:
        stage = stage_of(request, self.settings, self.spider)
        if stage is None:
            self.local.append(request)
            return True
        if stage not in self.stages:
            self.crawler.stats.inc_value("redislock/workers/unknown_stage")
            logger.error(
                "Dropped %s: stage %r is not configured; known stages: %s", request, stage, sorted(self.stages)
            )
            return False
        fingerprint = "" if request.dont_filter else self.crawler.request_fingerprinter.fingerprint(request).hex()
        data = pickle.dumps(request.to_dict(spider=self.spider), protocol=4)
        task = asyncio.get_event_loop().create_task(self._push(stage, fingerprint, data))
        self.pushing.add(task)
        task.add_done_callback(self.pushing.discard)
        self.crawler.stats.inc_value(f"redislock/workers/{stage}/enqueued")
        return True

    def next_request(self) -> Request | None:
        if self.local:
            return self.local.popleft()
        if self.buffer:
            request, inflight_id = self.buffer.popleft()
            self.inflight[request] = inflight_id
            if len(self.buffer) < self.concurrency:
                self.refill.set()  # top up before the buffer runs dry, not at the next tick
            return request
        return None

    # -- Redis ------------------------------------------------------------------------------

    async def _push(self, stage: str, fingerprint: str, data: bytes, front: bool = False) -> None:
        delay = 0.1
        while True:
            try:
                await self.scripts["queue_push"](
                    keys=[self.keys["dupefilter"], self.queue_keys[stage]],
                    args=[fingerprint, data, "1" if front else "0"],
                )
                return
            except redis.exceptions.ConnectionError as exc:  # keep the request: retry until Redis is back
                logger.warning("Queueing a %r request failed (%s); retrying in %.1f s", stage, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def response_in(self, response: Any, request: Request, spider: Spider | None = None) -> None:
        if request in self.inflight:
            self.awaiting_output.add(request)

    def request_done(self, request: Request, spider: Spider | None = None) -> None:
        """The download is over; with a response, the ack waits until the callback's output is queued."""
        if request not in self.awaiting_output:
            self._ack_later(request)

    def output_done(self, request: Request) -> None:
        """Called by AckAfterOutput once every request the callback yielded has been enqueued."""
        self.awaiting_output.discard(request)
        self._ack_later(request)

    def _ack_later(self, request: Request) -> None:
        inflight_id = self.inflight.pop(request, None)
        if inflight_id is not None:
            task = asyncio.get_event_loop().create_task(self._ack(inflight_id, set(self.pushing)))
            self.pushing.add(task)
            task.add_done_callback(self.pushing.discard)

    async def _ack(self, inflight_id: bytes, pushes: set[asyncio.Task[Any]]) -> None:
        if pushes:  # the children are in Redis before the parent leaves the in-flight record
            await asyncio.gather(*pushes, return_exceptions=True)
        with contextlib.suppress(redis.exceptions.RedisError):
            await self.scripts["queue_ack"](keys=[self.keys["inflight"]], args=[inflight_id])

    async def _requeue(self, worker: str, silence_ms: str) -> int:
        stages = list(self.stages)
        inflight = self.keys["inflight"].rsplit(":inflight:", 1)[0] + f":inflight:{worker}"
        return int(
            await self.scripts["queue_requeue"](
                keys=[self.keys["alive"], inflight, self.keys["working"], *(self.queue_keys[s] for s in stages)],
                args=[worker, silence_ms, *stages],
            )
        )

    # -- the worker loop --------------------------------------------------------------------

    async def _run(self) -> None:
        last_beat = 0.0
        while True:
            try:
                now = time.monotonic()
                if now - last_beat >= self.settings.ttl / 3:
                    await self._beat_and_reap()
                    last_beat = now
                await self._refresh_lengths()
                await self._choose_stage()
                await self._fill()
            except redis.exceptions.RedisError as exc:
                logger.warning("Worker loop: Redis error (%s); retrying", exc)
            self.refill.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.refill.wait(), TICK)

    async def _beat(self) -> None:
        await self.scripts["queue_beat"](
            keys=[self.keys["alive"], self.keys["working"]], args=[self.worker, self.current or ""]
        )

    async def _beat_and_reap(self) -> None:
        await self._beat()
        ttl_ms = int(self.settings.ttl * 1000)
        server_time = await self.client.time()
        now_ms = int(server_time[0]) * 1000 + int(server_time[1]) // 1000
        silent = await self.client.zrangebyscore(self.keys["alive"], "-inf", now_ms - ttl_ms)
        for worker in silent:
            worker = worker.decode() if isinstance(worker, bytes) else worker
            moved = await self._requeue(worker, str(ttl_ms))
            if moved > 0:
                logger.warning("Worker %s stopped beating: requeued %d of its requests", worker, moved)
                self.crawler.stats.inc_value("redislock/workers/requeued", moved)

    async def _refresh_lengths(self) -> None:
        async with self.client.pipeline(transaction=False) as pipe:
            for stage in self.stages:
                pipe.llen(self.queue_keys[stage])
            lengths = await pipe.execute()
        self.lengths = dict(zip(self.stages, (int(n) for n in lengths), strict=True))
        busy = any(self.lengths.values()) or self.buffer or self.inflight or self.pushing
        if not busy:
            others = await self.client.zcard(self.keys["alive"])
            if others > 1:
                inflight_any = False
                for worker in await self.client.zrange(self.keys["alive"], 0, -1):
                    worker = worker.decode() if isinstance(worker, bytes) else worker
                    key = self.keys["inflight"].rsplit(":inflight:", 1)[0] + f":inflight:{worker}"
                    if await self.client.hlen(key):
                        inflight_any = True
                        break
                busy = inflight_any
        if busy:
            self.cluster_busy_at = time.monotonic()

    async def _choose_stage(self) -> None:
        """Keep the stage while it has work; else free its slot and take the first stage with work and room."""
        current = self.current
        if current is not None and (self.lengths[current] or self.buffer or self.inflight):
            if not self.locks.is_capped(current):
                await self._move_up(current)  # e.g. take over the slot of a killed worker at once
            return
        if current is not None:
            await self._leave_stage()
        for stage in self.preference:
            if not self.lengths[stage]:
                continue
            if self.locks.is_capped(stage):
                permit = await self.locks.locks[stage].try_acquire()
                if permit is None:
                    continue
                self.permit = permit
            self.current = stage
            await self._beat()
            self.crawler.stats.inc_value(f"redislock/workers/{stage}/taken")
            logger.info("Worker %s works on stage %r", self.worker, stage)
            (self.spider and self.spider.__dict__.setdefault("redislock_stage_history", [])).append(  # type: ignore[union-attr]
                (time.time(), stage)
            )
            return

    async def _move_up(self, current: str) -> None:
        """From an uncapped stage, take a preferred capped stage that has work and a free slot.

        Requests of the uncapped stage already taken finish here (no cap to break); no new ones are taken.
        """
        for stage in self.preference[: self.preference.index(current)]:
            if self.lengths[stage] and self.locks.is_capped(stage):
                permit = await self.locks.locks[stage].try_acquire()
                if permit is not None:
                    self.permit, self.current = permit, stage
                    await self._beat()
                    logger.info("Worker %s moves up to stage %r", self.worker, stage)
                    return

    async def _leave_stage(self) -> None:
        if self.permit is not None:
            await self.locks.release(self.permit)
            self.permit = None
        self.current = None

    async def _fill(self) -> None:
        if self.current is None:
            return
        want = max(0, self.concurrency * 3 - len(self.buffer) - len(self.inflight))
        if not want:
            return
        stage = self.current
        reply = await self.scripts["queue_pop"](
            keys=[self.queue_keys[stage], self.keys["inflight"], self.keys["ids"]], args=[want, stage]
        )
        for inflight_id, data in zip(reply[::2], reply[1::2], strict=True):
            request = request_from_dict(pickle.loads(data), spider=self.spider)
            self.buffer.append((request, inflight_id))
        if reply:
            wake_engine(self.crawler)

    def cluster_idle_for(self) -> float:
        return time.monotonic() - self.cluster_busy_at
