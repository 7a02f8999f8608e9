"""The consumer names one lock owner waits under: reused when idle, retired when a wait was
abandoned.

Every wait blocks under a consumer of the lock's group (``<owner>#<n>``); a grant is delivered to
that consumer and moves to the owner's own consumer at its first renewal. Pure bookkeeping: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# maintains that free an abandoned wait's consumer: the second catches a late delivery
ABANDONED_PASSES = 2


@dataclass
class Consumers:
    """One owner's wait consumers: which are free to reuse, which a renewal must still clean up."""

    owner: str
    idle: list[str] = field(default_factory=list)
    made: int = 0
    # consumer (or grant id) -> renewals left that free what was delivered to it
    abandoned: dict[str, int] = field(default_factory=dict)

    def take(self) -> str:
        """A consumer name for one wait: an idle one of this owner, or a new one."""
        if self.idle:
            return self.idle.pop()
        self.made += 1
        return f"{self.owner}#{self.made}"

    def free(self, consumer: str) -> None:
        """The consumer holds nothing and no wait uses it: the next wait may reuse it."""
        if consumer.startswith(f"{self.owner}#") and consumer not in self.idle:
            self.idle.append(consumer)

    def abandon(self, consumer: str) -> None:
        """A wait on ``consumer`` ended without seeing its reply: what it was handed is freed, the
        name retired.

        A grant id in its place (a grant that a renewal may have moved to the owner's consumer) is
        freed alike.
        """
        self.abandoned[consumer] = ABANDONED_PASSES

    def cleaned(self, names: list[str]) -> None:
        """A renewal freed what ``names`` were handed: one pass fewer for each."""
        for name in names:
            left = self.abandoned.get(name, 0) - 1
            if left > 0:
                self.abandoned[name] = left
            else:
                self.abandoned.pop(name, None)

    def clear(self) -> None:
        self.idle.clear()
        self.abandoned.clear()


# The most owners a renewal names back: ROSTER_MAX in _lib.lua
# (tests/lock/test_recovery.py checks they agree).
ROSTER_MAX = 32


@dataclass
class Registration:
    """Whether this owner is registered with the lock in Redis now, and whether it ever saw the
    lock there.

    Redis forgets an owner that has been quiet for longer than its ttl, so a registration lapses on
    this side too; an owner that ever saw the lock treats a missing one as lost data (limbo).
    """

    current: bool = False
    ever: bool = False
    at: float = -math.inf
    # the owners alive at this owner's last renewal (maintain's roster; None: more than ROSTER_MAX)
    roster: list[str] | None = None
    roster_at: float = -math.inf

    def done(self, now: float) -> None:
        self.current = self.ever = True
        self.at = now

    def saw(self, roster: list[str], now: float) -> None:
        """A renewal named the owners alive (see maintain.lua)."""
        self.roster = roster if len(roster) <= ROSTER_MAX else None
        self.roster_at = now

    def survivors(self, owner: str, now: float, lease: float) -> list[str] | None:
        """Whom a recovery after a data loss waits for (setup.lua, ``await_survivors``): the owners
        alive at this owner's last renewal, if that was within the lease (an owner quiet for longer
        cannot tell who may hold); None: unknown, the recovery waits out its lease."""
        if self.roster is None or now - self.roster_at > lease:
            return None
        return sorted({*self.roster, owner})

    def due(self, now: float, ttl: float) -> bool:
        """Set up (again) before the next wait: never done, lost, or quiet for over ``ttl``."""
        return not self.current or now - self.at > ttl
