"""One quorum acquire: queue in the lead master's FIFO, then gather the rest of the quorum.

Sans-IO like :mod:`scrapy_redislock.lock.quorum.core`, whose
:meth:`~scrapy_redislock.lock.quorum.core.QuorumCore.acquire` it is: apart because it has state of
its own (its deadline, its back-off, the grants it holds that no permit owns yet) that lives only as
long as the acquire.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Protocol

from scrapy_redislock._redis import Backoff
from scrapy_redislock.errors import AcquireTimeout, LockError
from scrapy_redislock.lock.permit import Permit
from scrapy_redislock.lock.protocol import Operation
from scrapy_redislock.lock.quorum.protocol import (
    Fanout,
    LeadWait,
    Pause,
    Pending,
    QuorumOperation,
    QuorumPermit,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from scrapy_redislock.lock.core import LockCore


class Core(Protocol):
    """What one acquire needs of its :class:`~scrapy_redislock.lock.quorum.core.QuorumCore` (this
    module imports it never, so imports run one way)."""

    name: str
    owner: str
    quorum: int
    cores: list[LockCore]
    down_until: list[float]
    last_round: str

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def renew_interval(self) -> float: ...

    def validity(self, started: float) -> float: ...

    def known_somewhere(self) -> None: ...

    def probe(self, skip: int | None = None) -> QuorumOperation[None]: ...


RETRY_FIRST = 0.005  # s, first back-off after a lost round; doubles up to RETRY_MOST
RETRY_MOST = 0.05


class QuorumWait:
    """One acquire on a quorum of masters; ``pending`` lists the grants it holds that no permit
    owns yet, so that a caller can give them back if the acquire is cut short."""

    def __init__(self, core: Core, timeout: float | None, pending: Pending) -> None:
        self.core = core
        self.timeout = timeout
        self.pending = pending
        self.deadline = None if timeout is None else core.clock() + timeout
        interval = core.renew_interval
        self.backoff = Backoff(RETRY_FIRST, max(RETRY_FIRST, min(RETRY_MOST, interval)))

    def run(self) -> QuorumOperation[QuorumPermit]:
        """Queue at the lead master (its FIFO), then gather the rest of the quorum; give up the lead
        slot and queue again (at the back) after ``renew_interval`` without a quorum, so split leads
        never wait on each other."""
        core = self.core
        while True:
            lead = self._lead()
            left = None if self.deadline is None else max(0.0, self.deadline - core.clock())
            if lead is None:  # every master failed lately: wait a little, then try them all again
                core.down_until = [0.0] * len(core.cores)
                reply: Any = LockError("no master answered")
            else:
                asked = core.clock()
                reply = (yield LeadWait(lead, left, core.renew_interval))[lead]
            if isinstance(reply, AcquireTimeout):
                raise self._timed_out()
            if isinstance(reply, Permit) and lead is not None:
                permit = yield from self._gather(lead, reply, asked)
                if permit is not None:
                    return permit
            elif isinstance(reply, BaseException) and lead is not None:
                core.down_until[lead] = core.clock() + core.renew_interval
                core.last_round = f"lead master {lead}: {type(reply).__name__}: {reply}"
                if self._lead() is not None:
                    continue  # the next master leads at once
            if self._past_deadline():
                raise self._timed_out()
            delay = self._jittered()
            yield Pause(
                delay
                if self.deadline is None
                else min(delay, max(0.0, self.deadline - core.clock()))
            )

    def _gather(
        self, lead: int, grant: Permit, asked: float
    ) -> QuorumOperation[QuorumPermit | None]:
        """Rounds around the lead's slot until a quorum, or give the slot back after
        ``renew_interval``."""
        core = self.core
        self.pending.append((lead, grant))
        # Not seen before the wait: the lead may have created it just now (a new lock), or the
        # others may have it by now (a master that did not answer the first probe): ask them again
        # before the round.
        yield from core.probe(skip=lead)
        patience_end = core.clock() + core.renew_interval
        # The lead's lease began after ``asked`` (Redis delivered the slot to a read sent after it):
        # after a short wait the validity is counted from there, a long one renews the lead's slot
        # in the round.
        since = asked if core.clock() - asked < core.renew_interval else None
        while True:
            permit = yield from self.round((lead, grant), since)
            if permit is not None:
                permit.lead = lead
                return permit
            if grant.lost or core.clock() >= patience_end or self._past_deadline():
                break
            yield Pause(self._jittered())
        if not grant.lost:
            yield Fanout({lead: core.cores[lead].release(grant)})
        self.pending.clear()
        self.backoff.reset()
        return None

    def round(
        self, lead: tuple[int, Permit] | None = None, since: float | None = None
    ) -> QuorumOperation[QuorumPermit | None]:
        """Ask every master for a slot without blocking; a win needs >= quorum grants and validity
        left.

        The lead's slot, already held, is not asked for: with ``since`` (its lease began after that
        time) the validity is counted from ``since``; without, the slot is renewed in this round,
        its lease starting in it.
        """
        core, pending = self.core, self.pending
        started = core.clock() if since is None else since
        ops: dict[int, Operation[object]] = {
            i: master.acquire(None, blocking=False) for i, master in enumerate(core.cores)
        }
        if lead is not None:
            if since is None:
                ops[lead[0]] = core.cores[lead[0]].maintain([lead[1]])
            else:
                del ops[lead[0]]
        replies = yield Fanout(ops)
        if lead is not None:
            reply = replies.get(lead[0], [])
            replies[lead[0]] = lead[1] if isinstance(reply, list) and not reply else reply
        grants = {i: r for i, r in replies.items() if isinstance(r, Permit)}
        pending.extend((i, p) for i, p in grants.items() if lead is None or i != lead[0])
        if grants:
            core.known_somewhere()
        validity = core.validity(started)
        errors = {i: r for i, r in replies.items() if isinstance(r, BaseException)}
        core.last_round = (
            f"{len(grants)} of {len(core.cores)} masters granted, quorum {core.quorum}"
            + "".join(f"; master {i}: {type(e).__name__}: {e}" for i, e in sorted(errors.items()))
        )
        if len(grants) >= core.quorum and validity > 0:
            now = core.clock()
            pending.clear()  # the permit owns them now
            return QuorumPermit(core.name, core.owner, grants, now, now + validity, core.quorum)
        if len(grants) >= core.quorum:
            core.last_round += f"; validity {validity:.3f} s left: too late"
        partial = {i: p for i, p in grants.items() if lead is None or i != lead[0]}
        if partial:
            # give every partial grant back
            yield Fanout({i: core.cores[i].release(p) for i, p in partial.items()})
        pending[:] = [(i, p) for i, p in pending if p not in partial.values()]
        return None

    def _lead(self) -> int | None:
        """The master whose FIFO orders the waiters: the first one not found down lately."""
        now = self.core.clock()
        return next((i for i, until in enumerate(self.core.down_until) if until <= now), None)

    def _past_deadline(self) -> bool:
        return self.deadline is not None and self.core.clock() >= self.deadline

    def _jittered(self) -> float:
        return self.backoff.next() * random.uniform(0.5, 1.5)

    def _timed_out(self) -> AcquireTimeout:
        core = self.core
        return AcquireTimeout(
            f"quorum lock {core.name!r}: no quorum ({core.quorum} of {len(core.cores)} masters) within {self.timeout} s; last: {core.last_round}"  # noqa: E501
        )
