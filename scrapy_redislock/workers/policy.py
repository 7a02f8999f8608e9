"""Which stage a worker works on, and what it waits for: pure decisions, no Redis, no Scrapy.

:class:`~scrapy_redislock.workers.scheduler.StageWorkerScheduler` asks :class:`StagePolicy` and
carries the answer out (taking a slot, popping, blocking on signal lists). The rules:

- a worker keeps its stage while the stage has work (queued, taken ahead or in progress here);
- from an uncapped stage it moves up to a preferred capped stage that has work and a free slot (a
  killed worker's slot, once its lease has expired, is taken that way while every worker is busy);
- a worker with no stage tries the stages that have work in preference order;
- it then blocks in Redis on the signal lists of the stages it could take (every stage, minus capped
  ones it has just found full) while it has no stage, or on its own stage's signal while that
  stage's queue is empty;
- it wakes at the latest at its next heartbeat (every ttl/3), or when the crawl's idle-close
  deadline is due;
- a worker with work (a stage, or requests in flight) also beats every ttl/3 but at least every
  second (a "pulse") and promises its next beat within ``min(ttl, 5 s)``; one without work beats
  every ttl/3 and promises one within the ttl (:func:`liveness`). A worker past its promise is dead:
  its requests are requeued;
- a worker reaps the dead only once it has itself reached Redis without a gap for a while
  (:func:`may_reap`): after an outage every worker's promise has passed, and the live ones need up
  to one back-off to beat again;
- it closes once the cluster has had no work for :func:`idle_close_for` seconds
  (REDISLOCK_IDLE_CLOSE, else the spider's ``max_idle_time`` as scrapy-redis's RedisSpider reads it,
  else MAX_IDLE_TIME_BEFORE_CLOSE);
- when its capped stage holds more slots than its limit (the limit was lowered, or set to 0:
  paused), the newest holders leave (:func:`keeps_slot`): each gives back what it took ahead, lets
  its downloads finish, frees its slot, and takes another stage with work or waits.

Reads no settings (:func:`idle_close_for` decides between values read elsewhere).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scrapy_redislock.errors import ConfigError


@dataclass(frozen=True)
class StagePolicy:
    """A spider's stages in preference order, and which of them are capped."""

    preference: tuple[str, ...]
    capped: frozenset[str]

    @classmethod
    def of(
        cls, stages: Mapping[str, int | None], preference: Sequence[str] | None = None
    ) -> StagePolicy:
        """Stages (stage -> cap, None = unlimited) in ``preference`` order, then the rest in their
        own order."""
        order = list(preference or ())
        order += [s for s in stages if s not in order]
        return cls(tuple(order), frozenset(s for s, cap in stages.items() if cap is not None))

    def keeps(self, current: str, lengths: Mapping[str, int], has_work_here: bool) -> bool:
        """Whether a worker on ``current`` stays there: its queue or this worker still has work of
        it."""
        return bool(lengths.get(current)) or has_work_here

    def to_try(
        self, current: str | None, lengths: Mapping[str, int], has_work_here: bool = False
    ) -> list[str]:
        """The stages to try to take now, best first (each needs a free slot if capped).

        With no stage: every stage with queued work. On a stage it keeps: only capped stages
        preferred over an uncapped current one (moving up). On a stage it leaves: every stage with
        queued work."""
        with_work = [s for s in self.preference if lengths.get(s)]
        if current is None or not self.keeps(current, lengths, has_work_here):
            return with_work
        if current in self.capped:
            return []
        above = self.preference[: self.preference.index(current)]
        return [s for s in with_work if s in above and s in self.capped]

    def listens_to(
        self,
        current: str | None,
        empty: Collection[str],
        full: Collection[str],
        leaving: bool = False,
    ) -> list[str]:
        """The stages whose signal lists the worker blocks on: none while its own stage's queue may
        hold work (it pops when the engine asks); its own stage once that queue was found empty;
        with no stage, every stage except capped ones found full at its last look (a token for them
        would only be put back). None while ``leaving`` its stage (over the limit): a token it took
        there would only be put back."""
        if current is not None:
            return [current] if current in empty and not leaving else []
        return [s for s in self.preference if s not in full]


def idle_close_for(
    redislock_idle_close: float | None, max_idle_time: Any, fallback: float | None
) -> tuple[float | None, str]:
    """Seconds with no work anywhere in the cluster after which a worker closes (None: it idles for
    ever, as a RedisSpider does by default), and the setting that says so. REDISLOCK_IDLE_CLOSE when
    it is set (``redislock_idle_close``); else the spider's ``max_idle_time`` (its attribute, or
    ``-a max_idle_time=N``), as scrapy-redis's RedisSpider honours it; else
    MAX_IDLE_TIME_BEFORE_CLOSE (``fallback``, read with the other worker settings). 0 in either of
    scrapy-redis's means never, as there. A RedisSpider has already put MAX_IDLE_TIME_BEFORE_CLOSE
    in its ``max_idle_time`` when it had none (``setup_redis``): the same order. A ``max_idle_time``
    that is not a number of seconds >= 0 is a ConfigError."""
    if redislock_idle_close is not None:
        return redislock_idle_close, "REDISLOCK_IDLE_CLOSE"
    if max_idle_time is None:
        return fallback, "MAX_IDLE_TIME_BEFORE_CLOSE"
    try:
        seconds = float(max_idle_time)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(max_idle_time, bool) or not seconds >= 0 or math.isinf(seconds):
        raise ConfigError(
            f"max_idle_time (the spider's attribute or -a max_idle_time=N, as scrapy-redis's RedisSpider reads it) must be a number of seconds >= 0 (0 = never close), got {max_idle_time!r}"  # noqa: E501
        )
    return (seconds if seconds > 0 else None), "max_idle_time"


def next_wake(
    now: float, beat_due: float, quiet_since: float | None, idle_close: float | None
) -> float:
    """Seconds until the worker must look again without being woken: its next heartbeat, or, when
    the cluster was found idle, the moment it has been idle for ``idle_close`` seconds (then it
    closes if still idle)."""
    due = beat_due
    if idle_close is not None and quiet_since is not None:
        due = min(due, quiet_since + idle_close)
    return max(0.0, due - now)


# -- liveness: how often a worker beats, when it counts as dead, when it may reap others -----------

PULSE_MOST = 1.0  # seconds: a worker with work beats at least this often (as the lock's renewals: ttl/3, at most 1 s)
WORKING_GRACE = 5.0  # seconds: a worker with work is dead when silent this long (5 pulses; never more than the ttl)
RECOVERY = 6.0  # seconds a worker beats without a gap before it reaps: the others retry within a back-off (5 s)


@dataclass(frozen=True)
class Liveness:
    """How often a worker beats (``interval``) and the silence after which it counts as dead
    (``grace``: each beat promises the next one within it; Redis keeps the deadline)."""

    interval: float
    grace: float


def liveness(ttl: float, working: bool) -> Liveness:
    """A worker with work (a stage, requests in flight) beats every ``min(ttl/3, 1 s)`` and is dead
    after ``min(ttl, 5 s)``: a killed worker's requests are fetched again within seconds, not a ttl.
    An idle one beats every ttl/3 (its wait for work in Redis lasts until then) and is dead after
    the ttl: it has nothing to requeue, and beating it more often would cost Redis for nothing."""
    if not working:
        return Liveness(ttl / 3, ttl)
    return Liveness(min(ttl / 3, PULSE_MOST), min(ttl, WORKING_GRACE))


def keeps_streak(gap: float, interval: float) -> bool:
    """Whether a beat sent ``gap`` seconds after the previous beat's reply continues an unbroken run
    of beats: at most two intervals and a half second late. A longer gap (this worker stalled, Redis
    was slow or away) means the others may have missed their beats for the same reason."""
    return gap <= 2 * interval + 0.5


def may_reap(beating_for: float, ttl: float) -> bool:
    """Whether a worker that has beaten without a gap for ``beating_for`` seconds may take others
    for dead. After an outage every worker's deadline has passed; the live ones beat again within
    one back-off (at most 5 s), so the first to be back waits :data:`RECOVERY` (the ttl if shorter:
    a dead worker is then never kept longer than before)."""
    return beating_for >= min(ttl, RECOVERY)


class BeatClock:
    """When a worker beat, when its next beat and pulse are due, and since when its beats have
    reached Redis without a gap (a streak, for :func:`may_reap`). Times are monotonic seconds, passed
    in (the worker's clock), so the schedule is unit-tested without waiting."""

    def __init__(self, ttl: float, now: float) -> None:
        self.ttl = ttl
        self.beat_at = now  # when the last beat that reached Redis was sent
        self.beat_due = 0.0  # the next heartbeat (every ttl/3)
        self.pulse_due = 0.0  # the next pulse of a worker with work
        self.grace = ttl  # the silence its last beat promised not to exceed (else it is dead)
        self.pulse_interval = ttl / 3  # the interval its last beat set for the next one
        self.streak_since: float | None = None  # since when its beats reach Redis without a gap
        self.replied_at = 0.0  # when the last beat's reply came

    def beaten(self, sent: float, replied: float, plan: Liveness, pulse: bool = False) -> None:
        """A beat sent at ``sent`` reached Redis (its reply came at ``replied``), promising the next
        within ``plan.grace``; the next pulse is due after ``plan.interval``, the next heartbeat
        (unless this was a pulse) after ttl/3."""
        if self.streak_since is None or not keeps_streak(
            sent - self.replied_at, self.pulse_interval
        ):
            self.streak_since = sent
        self.replied_at = replied
        self.grace, self.pulse_interval = plan.grace, plan.interval
        self.pulse_due = sent + plan.interval
        self.beat_at = sent
        if not pulse:
            self.beat_due = sent + self.ttl / 3

    def broken(self) -> None:
        """A call to Redis failed: the others may not reach it either, the streak starts again."""
        self.streak_since = None

    def stalled(self, now: float) -> bool:
        """No beat for most of what the last one promised: this process stalled, and the others may
        have requeued what it took ahead."""
        return now - self.beat_at > 0.8 * self.grace

    def may_reap(self, now: float) -> bool:
        """Whether this worker's streak is long enough to take others for dead (:func:`may_reap`)."""
        return self.streak_since is not None and may_reap(now - self.streak_since, self.ttl)


def keeps_slot(grant: str, oldest: Sequence[str], limit: int) -> bool:
    """Whether the holder of ``grant`` keeps its slot of a stage whose ``limit`` may have been
    lowered: ``oldest`` are the stage's held grants, oldest first (grant ids grow with every grant),
    at least ``limit`` of them if there are. The ``limit`` oldest holders stay and every newer one
    leaves, so exactly the excess leaves, whichever holder decides first; with limit 0 (paused)
    every holder leaves."""
    return limit > 0 and grant in oldest[:limit]
