"""Which stage a worker works on, and what it waits for: pure decisions, no Redis, no Scrapy.

:class:`~scrapy_redislock.workers.scheduler.StageWorkerScheduler` asks :class:`StagePolicy` and carries the
answer out (taking a slot, popping, blocking on signal lists). The rules:

- a worker keeps its stage while the stage has work (queued, taken ahead or in progress here);
- from an uncapped stage it moves up to a preferred capped stage that has work and a free slot (a killed
  worker's slot, once its lease has expired, is taken that way while every worker is busy);
- a worker with no stage tries the stages that have work in preference order;
- it then blocks in Redis on the signal lists of the stages it could take (every stage, minus capped ones it has
  just found full) while it has no stage, or on its own stage's signal while that stage's queue is empty;
- it wakes at the latest at its next heartbeat (every ttl/3), or when the crawl's idle-close deadline is due.

Reads no settings.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StagePolicy:
    """A spider's stages in preference order, and which of them are capped."""

    preference: tuple[str, ...]
    capped: frozenset[str]

    @classmethod
    def of(cls, stages: Mapping[str, int | None], preference: Sequence[str] | None = None) -> StagePolicy:
        """Stages (stage -> cap, None = unlimited) in ``preference`` order, then the rest in their own order."""
        order = list(preference or ())
        order += [s for s in stages if s not in order]
        return cls(tuple(order), frozenset(s for s, cap in stages.items() if cap is not None))

    def keeps(self, current: str, lengths: Mapping[str, int], has_work_here: bool) -> bool:
        """Whether a worker on ``current`` stays there: its queue or this worker still has work of it."""
        return bool(lengths.get(current)) or has_work_here

    def to_try(self, current: str | None, lengths: Mapping[str, int], has_work_here: bool = False) -> list[str]:
        """The stages to try to take now, best first (each needs a free slot if capped).

        With no stage: every stage with queued work. On a stage it keeps: only capped stages preferred over an
        uncapped current one (moving up). On a stage it leaves: every stage with queued work."""
        with_work = [s for s in self.preference if lengths.get(s)]
        if current is None or not self.keeps(current, lengths, has_work_here):
            return with_work
        if current in self.capped:
            return []
        above = self.preference[: self.preference.index(current)]
        return [s for s in with_work if s in above and s in self.capped]

    def listens_to(self, current: str | None, empty: Collection[str], full: Collection[str]) -> list[str]:
        """The stages whose signal lists the worker blocks on: none while its own stage's queue may hold work
        (it pops when the engine asks); its own stage once that queue was found empty; with no stage, every
        stage except capped ones found full at its last look (a token for them would only be put back)."""
        if current is not None:
            return [current] if current in empty else []
        return [s for s in self.preference if s not in full]


def next_wake(now: float, beat_due: float, quiet_since: float | None, idle_close: float | None) -> float:
    """Seconds until the worker must look again without being woken: its next heartbeat, or, when the cluster was
    found idle, the moment it has been idle for ``idle_close`` seconds (then it closes if still idle)."""
    due = beat_due
    if idle_close is not None and quiet_since is not None:
        due = min(due, quiet_since + idle_close)
    return max(0.0, due - now)
