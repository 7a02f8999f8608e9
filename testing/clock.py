"""A fake monotonic clock for unit tests: pass it where the package takes a ``clock`` (``LockCore``,
``WorkerState``, ``StageWorkerScheduler``, ``StageScheduler``, ``StageLockMiddleware``,
``RequestSlots``, ``StageLocks``) and move time by hand, so a test of what happens after seconds of
silence runs in microseconds and never waits.

    clock = FakeClock()                                  # now = 100.0
    scheduler = StageWorkerScheduler(crawler, clock=clock)
    clock.advance(6.0)                                   # six seconds later, at once
"""

from __future__ import annotations


class FakeClock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move time forward by ``seconds``; the new time."""
        assert seconds >= 0, "a monotonic clock never goes back"
        self.now += seconds
        return self.now


__all__ = ["FakeClock"]
