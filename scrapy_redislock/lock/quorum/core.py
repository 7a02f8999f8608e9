"""The quorum lock's sans-IO core: one lock operation fanned out over N masters (see the
package docstring for what it promises)."""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.exceptions

from scrapy_redislock._redis import Backoff, check_timeout
from scrapy_redislock.errors import (
    AcquireTimeout,
    InvalidArgument,
    LockConnectionError,
    LockError,
    QuorumNotReached,
)
from scrapy_redislock.lock.core import Clock, LockCore, Permit, default_identity
from scrapy_redislock.lock.protocol import Call, Operation

logger = logging.getLogger("scrapy_redislock.lock.quorum")

T = TypeVar("T")

DRIFT_FACTOR = 0.01  # as Redlock: clocks may run 1% apart over a ttl
DRIFT_MS = 2  # plus this much for the rounding of Redis's millisecond clock
RETRY_FIRST = 0.005  # s, first back-off after a lost round; doubles up to RETRY_MOST
RETRY_MOST = 0.05
# one master failing is an answer, not a failure
MASTER_ERRORS = (redis.exceptions.RedisError, LockError, OSError)
ANSWER_WITHIN = 1.0  # s: a lead master that does not answer a PING within this (or its socket timeout) is silent


class LeadSilent(LockConnectionError):
    """The lead master did not answer while a wait was queued in its FIFO: the wait was given up
    (see LeadWait)."""


def safe_quorum(masters: int, limit: int) -> int:
    """The smallest q with q > masters*limit/(limit+1): no more than ``limit`` holders can each own
    q masters."""
    return masters * limit // (limit + 1) + 1


@dataclass(frozen=True)
class Fanout:
    """Run one lock operation on each of these masters; the reply maps master index -> result or
    exception."""

    ops: dict[int, Operation[object]]


@dataclass(frozen=True)
class LeadWait:
    """Wait in one master's FIFO for a slot (its lock front's blocking acquire, which reaps dead
    holders' leases while it waits); the reply maps that master's index -> Permit or exception
    (AcquireTimeout after timeout).

    With ``watch``: each time the wait has gone ``watch`` seconds without a reply, the front makes
    sure the master still answers (a PING; see ``QuorumFront``). While it does, the wait goes on
    untouched (its place in the FIFO kept); when it does not, the front gives the wait up as a
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


def _exists(core: LockCore) -> Operation[object]:
    return (yield Call(("EXISTS", core.keys.slots)))


@dataclass
class QuorumCore:
    """State and logic of one quorum lock object over N per-master ``LockCore`` objects; no I/O."""

    name: str
    limit: int
    ttl: float
    quorum: int
    cores: list[LockCore]
    clock: Clock
    drift_factor: float = DRIFT_FACTOR
    reentrant: bool = False
    owner: str = ""
    held: dict[int, QuorumPermit] = field(default_factory=dict)  # id(permit) -> permit
    by_holder: dict[object, QuorumPermit] = field(default_factory=dict)
    known: bool = False  # the lock was seen on some master: a master missing it lost it (restart)
    last_round: str = ""
    # per master: not the lead before this time
    down_until: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.down_until = [0.0] * len(self.cores)

    @classmethod
    def create(
        cls,
        cores: list[LockCore],
        *,
        quorum: object = None,
        reentrant: bool = False,
        drift_factor: object = DRIFT_FACTOR,
        clock: Clock = time.monotonic,
    ) -> QuorumCore:
        """Over ``cores``, one per master, all made with the same (checked) name, limit and ttl."""
        masters, limit, name = len(cores), int(cores[0].limit or 0), cores[0].name
        if (
            isinstance(drift_factor, bool)
            or not isinstance(drift_factor, int | float)
            or not 0 <= drift_factor < 1
        ):
            raise InvalidArgument(f"drift_factor must be a number in [0, 1), got {drift_factor!r}")
        safe = safe_quorum(masters, limit)
        if quorum is None:
            quorum = safe
        elif isinstance(quorum, bool) or not isinstance(quorum, int) or not 1 <= quorum <= masters:
            raise InvalidArgument(
                f"quorum must be an integer from 1 to {masters} (the masters), got {quorum!r}"
            )
        elif quorum < safe:
            logger.warning(
                "quorum lock %r: quorum=%d is below the safe quorum %d for %d masters and limit "
                "%d: up to %d holders"
                " can hold it at once",
                name,
                quorum,
                safe,
                masters,
                limit,
                masters * limit // quorum,
            )
        owner = f"{default_identity()['host']}:{uuid.uuid4().hex[:12]}"
        for core in cores:
            core.owner = owner  # one owner name on every master: status shows one holder
        return cls(
            name=name,
            limit=limit,
            ttl=cores[0].configured_ttl,
            quorum=quorum,
            cores=cores,
            clock=clock,
            drift_factor=float(drift_factor),
            reentrant=reentrant,
            owner=owner,
        )

    @property
    def renew_interval(self) -> float:
        return self.cores[0].renew_interval

    def validity(self, started: float) -> float:
        """Seconds a grant made by a round that started at ``started`` is still safe to use."""
        drift = self.ttl * self.drift_factor + DRIFT_MS / 1000
        return self.ttl - (self.clock() - started) - drift

    def _known(self) -> None:
        """The lock exists on some master: any master that lacks it lost it, and recreates it in
        limbo."""
        self.known = True
        for core in self.cores:
            core.ever_set_up = True

    def _probe(self, skip: int | None = None) -> QuorumOperation[None]:
        """Until the lock was seen: does it exist on any master (but ``skip``)? Then a master
        without it lost it (restarted empty), and every per-master setup or set_limit that finds it
        missing recreates it in limbo. Run before anything this object writes could create the lock:
        one EXISTS per master, only while the lock was never seen. A master that does not answer is
        not counted: only a lock that some master has is known."""
        if self.known:
            return
        replies = yield Fanout({i: _exists(core) for i, core in enumerate(self.cores) if i != skip})
        if any(not isinstance(r, BaseException) and int(r) for r in replies.values()):
            self._known()

    def set_limit(self, limit: int) -> QuorumOperation[int | None]:
        """Write ``limit`` to every master: the previous limit of the first master that had one;
        :class:`QuorumNotReached` when fewer than ``quorum`` masters took it. A master that lacks
        the lock while another has it gets it in limbo (every slot reserved for one lease: it lost
        the lock, and a holder may be about to re-adopt its grant there); only a lock found on no
        master is created with free slots."""
        yield from self._probe()
        recover = self.known
        replies = yield Fanout(
            {i: core.set_limit_op(limit, recover) for i, core in enumerate(self.cores)}
        )
        failed: dict[int, BaseException] = {}
        previous: int | None = None
        for index in sorted(replies):
            reply = replies[index]
            if isinstance(reply, BaseException):
                failed[index] = reply
            elif previous is None:
                previous = reply
        if len(failed) < len(replies):
            # the lock exists now: a master that later lacks it lost it (recreated in limbo)
            self._known()
        self._check_answers(failed, "set_limit")
        return previous

    def get_limit(self) -> QuorumOperation[int | None]:
        """The limit most masters that answer hold (ties: the first master's); None where no
        master has the lock. :class:`QuorumNotReached` when fewer than ``quorum`` answer."""
        replies = yield Fanout({i: core.get_limit() for i, core in enumerate(self.cores)})
        failed = {i: r for i, r in replies.items() if isinstance(r, BaseException)}
        self._check_answers(failed, "get_limit")
        limits: list[int | None] = [replies[i] for i in sorted(replies) if i not in failed]
        return max(limits, key=limits.count)

    def _check_answers(self, failed: Mapping[int, BaseException], what: str) -> None:
        if len(self.cores) - len(failed) >= self.quorum:
            return
        said = "; ".join(f"master {i}: {error}" for i, error in sorted(failed.items()))
        raise QuorumNotReached(
            f"quorum lock {self.name!r}: {what}: {len(self.cores) - len(failed)} of "
            f"{len(self.cores)} masters answered, {self.quorum} needed ({said})",
            dict(failed),
            self.quorum,
        )

    def acquire(
        self,
        timeout: float | None,
        blocking: bool = True,
        holder: object = None,
        pending: Pending | None = None,
    ) -> QuorumOperation[QuorumPermit | None]:
        """A permit on >= quorum masters (see the module docstring); None when not blocking and the
        round lost.

        ``pending`` is kept listing the per-master grants this call holds that no permit owns yet:
        if the call is cut short (cancelled), :meth:`sweep` of that list gives them back.
        """
        pending = [] if pending is None else pending
        timeout = check_timeout(timeout)
        if self.reentrant and holder is not None and holder in self.by_holder:
            again = self.by_holder[holder]
            if not again.lost and not again.released:
                again.holds += 1
                return again
            del self.by_holder[holder]
        yield from self._probe()
        permit: QuorumPermit | None
        if blocking:
            permit = yield from self._wait(
                None if timeout is None else self.clock() + timeout, timeout, pending
            )
        else:
            permit = yield from self._round(pending)
        if permit is not None:
            self.held[id(permit)] = permit
            if self.reentrant and holder is not None:
                self.by_holder[holder] = permit
        return permit

    def _lead(self) -> int | None:
        """The master whose FIFO orders the waiters: the first one not found down lately."""
        now = self.clock()
        return next((i for i, until in enumerate(self.down_until) if until <= now), None)

    def _wait(
        self, deadline: float | None, timeout: float | None, pending: Pending
    ) -> QuorumOperation[QuorumPermit]:
        """Queue at the lead master (its FIFO), then gather the rest of the quorum; give up the lead
        slot and queue again (at the back) after ``renew_interval`` without a quorum, so split leads
        never wait on each other."""
        backoff = Backoff(RETRY_FIRST, max(RETRY_FIRST, min(RETRY_MOST, self.renew_interval)))
        while True:
            lead = self._lead()
            left = None if deadline is None else max(0.0, deadline - self.clock())
            if lead is None:  # every master failed lately: wait a little, then try them all again
                self.down_until = [0.0] * len(self.cores)
                reply: Any = LockError("no master answered")
            else:
                asked = self.clock()
                reply = (yield LeadWait(lead, left, self.renew_interval))[lead]
            if isinstance(reply, AcquireTimeout):
                raise self._timeout(timeout)
            if isinstance(reply, Permit) and lead is not None:
                pending.append((lead, reply))
                # Not seen before the wait: the lead may have created it just now (a new lock), or
                # the others may have it by now (a master that did not answer the first probe): ask
                # them again before the round.
                yield from self._probe(skip=lead)
                patience_end = self.clock() + self.renew_interval
                # The lead's lease began after ``asked`` (Redis delivered the slot to a read sent
                # after it): after a short wait the validity is counted from there, a long one
                # renews the lead's slot in the round.
                since = asked if self.clock() - asked < self.renew_interval else None
                while True:
                    permit = yield from self._round(pending, (lead, reply), since)
                    if permit is not None:
                        permit.lead = lead
                        return permit
                    if reply.lost or self.clock() >= patience_end:
                        break
                    if deadline is not None and self.clock() >= deadline:
                        break
                    yield Pause(backoff.next() * random.uniform(0.5, 1.5))
                if not reply.lost:
                    yield Fanout({lead: self.cores[lead].release(reply)})
                pending.clear()
                backoff.reset()
            elif isinstance(reply, BaseException):
                if lead is not None:
                    self.down_until[lead] = self.clock() + self.renew_interval
                    self.last_round = f"lead master {lead}: {type(reply).__name__}: {reply}"
                if lead is not None and self._lead() is not None:
                    continue  # the next master leads at once
            if deadline is not None and self.clock() >= deadline:
                raise self._timeout(timeout)
            delay = backoff.next() * random.uniform(0.5, 1.5)
            yield Pause(
                delay if deadline is None else min(delay, max(0.0, deadline - self.clock()))
            )

    def _timeout(self, timeout: float | None) -> AcquireTimeout:
        return AcquireTimeout(
            f"quorum lock {self.name!r}: no quorum ({self.quorum} of {len(self.cores)} masters) "
            f"within {timeout} s; "
            f"last: {self.last_round}"
        )

    def _round(
        self, pending: Pending, lead: tuple[int, Permit] | None = None, since: float | None = None
    ) -> QuorumOperation[QuorumPermit | None]:
        """Ask every master for a slot without blocking; a win needs >= quorum grants and validity
        left.

        The lead's slot, already held, is not asked for: with ``since`` (its lease began after that
        time) the validity is counted from ``since``; without, the slot is renewed in this round,
        its lease starting in it.
        """
        started = self.clock() if since is None else since
        ops: dict[int, Operation[object]] = {
            i: core.acquire(None, blocking=False) for i, core in enumerate(self.cores)
        }
        if lead is not None:
            if since is None:
                ops[lead[0]] = self.cores[lead[0]].maintain([lead[1]])
            else:
                del ops[lead[0]]
        replies = yield Fanout(ops)
        if lead is not None:
            reply = replies.get(lead[0], [])
            replies[lead[0]] = lead[1] if isinstance(reply, list) and not reply else reply
        grants = {i: r for i, r in replies.items() if isinstance(r, Permit)}
        pending.extend((i, p) for i, p in grants.items() if lead is None or i != lead[0])
        if grants:
            self._known()
        validity = self.validity(started)
        errors = {i: r for i, r in replies.items() if isinstance(r, BaseException)}
        self.last_round = (
            f"{len(grants)} of {len(self.cores)} masters granted, quorum {self.quorum}"
            + "".join(f"; master {i}: {type(e).__name__}: {e}" for i, e in sorted(errors.items()))
        )
        if len(grants) >= self.quorum and validity > 0:
            now = self.clock()
            pending.clear()  # the permit owns them now
            return QuorumPermit(self.name, self.owner, grants, now, now + validity, self.quorum)
        if len(grants) >= self.quorum:
            self.last_round += f"; validity {validity:.3f} s left: too late"
        partial = {i: p for i, p in grants.items() if lead is None or i != lead[0]}
        if partial:
            # give every partial grant back
            yield Fanout({i: self.cores[i].release(p) for i, p in partial.items()})
        pending[:] = [(i, p) for i, p in pending if p not in partial.values()]
        return None

    def release(self, permit: QuorumPermit) -> QuorumOperation[bool]:
        """Give the slot back on every master; True when >= q masters still held it."""
        if not isinstance(permit, QuorumPermit):
            raise InvalidArgument(f"permit must be a QuorumPermit, got {permit!r}")
        if self.reentrant and permit.holds > 1 and not permit.lost:
            permit.holds -= 1
            return True
        permit.released = True
        # The lead's slot last: when its FIFO hands it to the next waiter, the other masters are
        # free already.
        rest = {i: p for i, p in permit.grants.items() if i != permit.lead}
        replies = (
            (yield Fanout({i: self.cores[i].release(p) for i, p in rest.items()})) if rest else {}
        )
        if permit.lead in permit.grants:
            lead = permit.lead
            replies.update((yield Fanout({lead: self.cores[lead].release(permit.grants[lead])})))
        self._forget(permit)
        confirmed = sum(1 for r in replies.values() if r is True)
        if confirmed < permit.quorum:
            permit.lost = True
        return confirmed >= permit.quorum

    def _forget(self, permit: QuorumPermit) -> None:
        self.held.pop(id(permit), None)
        for holder, held in list(self.by_holder.items()):
            if held is permit:
                del self.by_holder[holder]

    def maintain(
        self, permits: list[QuorumPermit] | None = None
    ) -> QuorumOperation[list[QuorumPermit]]:
        """Renew ``permits`` (default: all held) on every master; returns those fewer than q masters
        renewed.

        A lost permit's remaining grants are given back. Masters with an abandoned wait are
        maintained too.
        """
        targets = list(self.held.values()) if permits is None else list(permits)
        started = self.clock()
        ops: dict[int, Operation[object]] = {}
        for i, core in enumerate(self.cores):
            mine = [p.grants[i] for p in targets if i in p.grants]
            if mine or core.abandoned:
                ops[i] = core.maintain(mine)
        replies = yield Fanout(ops)
        validity = self.validity(started)
        lost: list[QuorumPermit] = []
        for permit in targets:
            renewed = 0
            for i, grant in list(permit.grants.items()):
                reply = replies.get(i)
                if isinstance(reply, BaseException) or reply is None:
                    continue  # unknown: kept, it may still be there
                if any(g is grant for g in reply):
                    del permit.grants[i]
                else:
                    renewed += 1
            if permit.released:
                continue
            if renewed >= permit.quorum and validity > 0:
                permit.valid_until = self.clock() + validity
            else:
                lost.append(permit)
        for permit in lost:
            permit.lost = True
            self._forget(permit)
        rest: dict[int, list[Permit]] = {}
        for permit in lost:
            for i, grant in permit.grants.items():
                rest.setdefault(i, []).append(grant)
        if rest:
            yield Fanout({i: self._release_each(i, grants) for i, grants in rest.items()})
        return lost

    def _release_each(self, index: int, grants: list[Permit]) -> Operation[None]:
        for grant in grants:
            yield from self.cores[index].release(grant)

    def sweep(self, pending: Pending) -> QuorumOperation[None]:
        """Give back an interrupted acquire's ``pending`` grants, and free abandoned waits, on every
        master."""
        ops: dict[int, Operation[object]] = {}
        for i, core in enumerate(self.cores):
            orphans = [p for j, p in pending if j == i]
            if orphans or core.abandoned:
                ops[i] = self._sweep_one(i, orphans)
        pending.clear()
        if ops:
            yield Fanout(ops)

    def _sweep_one(self, index: int, orphans: list[Permit]) -> Operation[None]:
        yield from self._release_each(index, orphans)
        if self.cores[index].abandoned:
            yield from self.cores[index].maintain([])

    def forget_all(self) -> int:
        """Every permit is lost (the fronts' close frees everything of this owner on each master);
        how many."""
        count = len(self.held)
        for permit in self.held.values():
            permit.lost = True
        self.held.clear()
        self.by_holder.clear()
        return count
