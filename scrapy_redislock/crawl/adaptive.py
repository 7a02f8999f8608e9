"""Adaptation: what one crawler's stage locks (or key locks) feed the cluster's adaptive limits,
and the pauses a site's Retry-After asks for.

- **Observations**: :meth:`Adaptation.response` and :meth:`Adaptation.error` record the outcome of
  a request of an adaptive stage or key (REDISLOCK_ADAPTIVE): its download latency (as Scrapy's
  AutoThrottle reads it, ``meta["download_latency"]``) and how long its slots were held, 429 and
  503 answers as overload, timeouts and connection errors as errors. One
  :class:`~scrapy_redislock.lock.adaptive.Recorder` per lock this process used since its last
  report.
- **Reports**: at every renewal tick (the process's one renewal loop, about once a second), each
  recorder with something recorded is reported (:func:`~scrapy_redislock.lock.adaptive.update`):
  merged into the lock's window in Redis, and when the window is due, the next limit is computed
  here and committed against the controller's version. One script per lock used and tick, two when
  a window closes; nothing for a lock this process did not use since the last tick. An overload
  answer (429, 503) or an error is reported at once instead, in a task of its own (one at a time
  per lock, at most one a quarter window: 4 scripts a window and lock while a site refuses, at
  most): an overloaded window is due early (``scripts/adapt_report.lua``: a quarter window old, at
  once in a slow start), so a limit past what the site takes is cut within a few of its answers,
  not at the next tick; a refusal comes back at once and frees its slot for the next
  request, and against bench/adaptive.py's site refusing past 1.5 K, one window at 16 (K = 8)
  drew 70 refusals in the second before the tick reported them.
- **Pauses**: :meth:`Adaptation.pause` stops every process's starts of a stage or key until a
  moment on Redis's clock (:func:`~scrapy_redislock.lock.delay.pause_starts`), in a task of its
  own; a failure is logged, never raised into the crawl.

The limits: each adaptive lock's controller moves its limit between REDISLOCK_ADAPTIVE_MIN and the
configured cap (REDISLOCK_STAGES, REDISLOCK_KEY_LIMITS, REDISLOCK_KEY_LIMIT), over windows of
REDISLOCK_ADAPTIVE_WINDOW seconds (:mod:`scrapy_redislock.lock.adaptive`). Reads no settings
itself: it is given the checked ones.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from scrapy_redislock.crawl.reach import REDIS_ERRORS
from scrapy_redislock.lock.adaptive import AdaptiveParams, Recorder, update
from scrapy_redislock.lock.base import CommandRunner
from scrapy_redislock.lock.delay import pause_starts
from scrapy_redislock.lock.permit import LockKeys
from scrapy_redislock.lock.protocol import adrive

if TYPE_CHECKING:
    from scrapy_redislock._redis import AsyncRedisClient
    from scrapy_redislock.crawl.settings import RedisLockSettings

logger = logging.getLogger(__name__)

# The longest pause a Retry-After may ask for: a site's mistake (or a date far ahead) must not stop
# a key for days.
MOST_PAUSE = 600.0


class Adaptation:
    """The adaptive limits and pauses of one set of locks (a crawler's stages, or its keys)."""

    def __init__(
        self,
        client: AsyncRedisClient,
        settings: RedisLockSettings,
        ceiling: Callable[[str], int | None],
        *,
        key_prefix: str,
        light: bool = False,
        stats: Any = None,
    ) -> None:
        self.settings = settings
        self.key_prefix = key_prefix  # the cap group's (lock/permit.py: group_prefix)
        self.ceiling = ceiling  # lock name -> its configured cap (the controller's maximum)
        self.light = light  # the locks of keys: they may be on their light path (lock/light.py)
        self.stats = stats
        self.runner = CommandRunner(client)
        self.recorders: dict[str, Recorder] = {}
        self.pausing: set[asyncio.Task[float]] = set()
        self.reporting: dict[str, asyncio.Task[None]] = {}  # a lock's report in flight
        # when each lock's last early report went (monotonic), for a quarter window after it
        self.early: dict[str, float] = {}
        self._params: dict[int, AdaptiveParams] = {}
        self._failing = False

    def params(self, name: str) -> AdaptiveParams | None:
        """The controller's parameters of lock ``name`` (None when it has no cap)."""
        ceiling = self.ceiling(name)
        if ceiling is None:
            return None
        params = self._params.get(ceiling)
        if params is None:
            adaptive = self.settings.adaptive
            params = self._params[ceiling] = AdaptiveParams(
                minimum=min(adaptive.adaptive_min, ceiling),
                maximum=ceiling,
                window=adaptive.adaptive_window,
            )
        return params

    # -- observations ------------------------------------------------------------------------------

    def response(
        self, name: str, latency: float | None, overload: bool, hold: float | None = None
    ) -> None:
        """A request of lock ``name`` got an answer after ``latency`` seconds (overload: 429,
        503), its slots held ``hold`` seconds (None: not known)."""
        recorder = self.recorders.setdefault(name, Recorder())
        recorder.response(latency or 0.0, overload, hold)
        if overload:
            self._report_now(name)

    def error(self, name: str) -> None:
        """A request of lock ``name`` failed (a timeout, a connection error)."""
        self.recorders.setdefault(name, Recorder()).error()
        self._report_now(name)

    # -- reports, at every renewal tick or at once on overload -------------------------------------

    async def tick(self) -> None:
        """Report what each lock's recorder holds (see the module docstring); never raises."""
        recorders, self.recorders = self.recorders, {}
        if self.early:
            quarter, now = self.settings.adaptive.adaptive_window / 4, time.monotonic()
            self.early = {name: at for name, at in self.early.items() if now - at < quarter}
        for name, recorder in recorders.items():
            await self._report(name, recorder)

    def _report_now(self, name: str) -> None:
        """Report lock ``name``'s recorder in a task of its own, unless one is in flight or the
        last early report went less than a quarter window ago (the script's least age of an early
        window, but in a slow start, where the first overload is due at once)."""
        recorder, params = self.recorders.get(name), self.params(name)
        if name in self.reporting or recorder is None or params is None:
            return
        now = time.monotonic()
        if now - self.early.get(name, -math.inf) < params.window / 4:
            return
        self.early[name] = now
        task = asyncio.get_running_loop().create_task(self._report_early(name))
        self.reporting[name] = task
        task.add_done_callback(_reported)

    async def _report_early(self, name: str) -> None:
        try:
            recorder = self.recorders.pop(name, None)
            if recorder is not None:
                await self._report(name, recorder)
        finally:
            self.reporting.pop(name, None)

    async def _report(self, name: str, recorder: Recorder) -> None:
        params = self.params(name)
        sample, span = recorder.take()
        if params is None or sample.empty:
            return
        keys = LockKeys.of(self.key_prefix, name)
        operation = update(keys, sample, params, span, self.settings.durable, light=self.light)
        try:
            state = await adrive(operation, self.runner, name)
        except REDIS_ERRORS as exc:
            if not self._failing:
                logger.warning("Reporting to the adaptive limit of %r failed: %s", name, exc)
            self._failing = True
            return
        self._failing = False
        if state is not None:
            logger.debug("Adaptive limit of %r: %s (window closed here)", name, state.applied)

    # -- pauses ------------------------------------------------------------------------------------

    def pause(self, name: str, seconds: float) -> None:
        """No start of lock ``name`` (a stage, or ``key:<key>``) for ``seconds`` from now, in every
        process (capped at :data:`MOST_PAUSE`); sent in a task of its own."""
        seconds = min(max(0.0, seconds), MOST_PAUSE)
        keys = LockKeys.of(self.key_prefix, name)
        operation = pause_starts(keys, seconds, light=self.light)
        task = asyncio.get_running_loop().create_task(adrive(operation, self.runner, name))
        self.pausing.add(task)
        task.add_done_callback(self._paused)
        if self.stats is not None:
            self.stats.inc_value("redislock/retry_after/pauses")
        logger.info("Retry-After: starts of %r paused for %.1f s in every process", name, seconds)

    def _paused(self, task: asyncio.Task[float]) -> None:
        self.pausing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning(
                "Could not pause the starts asked by a Retry-After: %s", task.exception()
            )

    def close(self) -> None:
        for task in [*self.pausing, *self.reporting.values()]:
            task.cancel()


def _reported(task: asyncio.Task[None]) -> None:
    """An early report that failed otherwise than by a Redis error (which it logs itself): logged,
    not left to asyncio's "Task exception was never retrieved"."""
    if not task.cancelled() and (error := task.exception()) is not None:
        logger.error("Reporting to an adaptive limit failed: %r", error, exc_info=error)
