"""What a quorum lock operation yields (one lock operation per master, a wait in one master's FIFO,
a pause), and the permit it makes.

The quorum locks (:mod:`.sync`, :mod:`.aio`) carry these the way the single lock's classes carry
:mod:`scrapy_redislock.lock.protocol`'s commands. Data only, no I/O.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from scrapy_redislock.errors import LockConnectionError
from scrapy_redislock.lock.permit import Permit
from scrapy_redislock.lock.protocol import Operation

T = TypeVar("T")


class LeadSilent(LockConnectionError):
    """The lead master did not answer while a wait was queued in its FIFO: the wait was given up
    (see LeadWait)."""


@dataclass(frozen=True)
class Fanout:
    """Run one lock operation on each of these masters; the reply maps master index -> result or
    exception."""

    ops: dict[int, Operation[object]]


@dataclass(frozen=True)
class LeadWait:
    """Wait in one master's FIFO for a slot (its lock's blocking acquire, which reaps dead
    holders' leases while it waits); the reply maps that master's index -> Permit or exception
    (AcquireTimeout after timeout).

    With ``watch``: each time the wait has gone ``watch`` seconds without a reply, the lock makes
    sure the master still answers (a PING; see ``QuorumBase``). While it does, the wait goes on
    untouched (its place in the FIFO kept); when it does not, the lock gives the wait up as a
    cancelled one (what Redis may still hand it is freed by the next maintain there) and replies
    :class:`LeadSilent`.
    """

    index: int
    timeout: float | None
    watch: float | None = None


@dataclass(frozen=True)
class Pause:
    """Sleep this many seconds (the back-off between two rounds)."""

    seconds: float


# Like Operation: yields these, is sent their replies (a Fanout's and LeadWait's: index -> result or
# exception).
QuorumOperation = Generator[Fanout | LeadWait | Pause, Any, T]
Pending = list[tuple[int, Permit]]  # master index, grant: what an acquire in progress holds


@dataclass
class QuorumPermit:
    """A slot held on at least ``quorum`` masters; ``valid_until`` is on the lock's clock
    (monotonic)."""

    name: str
    owner: str
    grants: dict[int, Permit]
    acquired_at: float
    valid_until: float
    quorum: int
    holds: int = 1
    lost: bool = False
    released: bool = False
    lead: int | None = None  # the master whose FIFO this permit waited in (released last)

    def usable(self, now: float) -> bool:
        """Held as far as this process knows: not lost, not released, its validity not run out by
        ``now``."""
        return not self.lost and not self.released and now < self.valid_until

    @property
    def fences(self) -> dict[int, int]:
        """The fencing token: master index -> fence of the grant there."""
        return {i: p.fence for i, p in sorted(self.grants.items())}

    def newer_than(self, other: QuorumPermit | Mapping[int, int]) -> bool:
        """True when this permit was granted after ``other`` on a master both hold, and before it on
        none."""
        theirs = other.fences if isinstance(other, QuorumPermit) else dict(other)
        shared = [i for i in self.fences if i in theirs]
        return bool(shared) and all(self.fences[i] > theirs[i] for i in shared)

    @property
    def token(self) -> str:
        return f"{self.owner}/" + ",".join(f"{i}:{p.grant}" for i, p in sorted(self.grants.items()))
