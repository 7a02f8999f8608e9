"""The quorum lock: a counting lock held on q of N independent Redis masters (Redlock, for a
counting lock).

Each master keeps an ordinary counting lock (a :class:`~scrapy_redislock.lock.sync.CountingLock` or
:class:`~scrapy_redislock.lock.aio.AsyncCountingLock` per master, their Lua scripts unchanged); a
quorum permit is a grant on at least ``q`` of them, obtained within the validity time. No new Lua:
:class:`QuorumCore` is a sans-IO generator, like ``LockCore``, that yields :class:`Fanout` (one lock
operation per master), :class:`LeadWait` and
:class:`Pause`; :class:`QuorumCountingLock` runs a fanout's operations one master after the other,
:class:`AsyncQuorumCountingLock` all at once.

Why not a majority: each master admits ``limit`` (L) holders and each holder needs q masters, so up
to floor(N*L/q) holders fit at once. The safe quorum is the smallest q with q > N*L/(L+1)
(:func:`safe_quorum`); for a mutex (L=1) that is a majority, for L >= 2 it is more (N=3, L=2: 3;
N=5, L=3: 4).

What it promises and what it does not:

* Acquire: a waiter queues in the *lead* master's FIFO (the first master not found down in the last
  ttl/3), then a round asks every other master for a slot without blocking (and renews the lead's
  slot after a long wait); the round wins when >= q granted and the validity ``ttl - elapsed -
  drift`` (drift = ttl * drift_factor + 2 ms, elapsed counted from the start of a short wait, or of
  the round) is still positive; otherwise the partial grants are given back and the round is tried
  again after a jittered back-off, for up to ttl/3, after which the lead's slot goes back too and
  the waiter queues again at the back.
* Order: one FIFO per master cannot give a global FIFO (two waiters can be first on different
  masters); waiters are served in the lead's FIFO order while it is up (a release gives the lead's
  slot back last). While it is down the next master leads, and waiters queued on the dead one lose
  their place. ``try_acquire`` is one round, no queue.
* A lead that stops answering (paused, frozen VM, silent network) is noticed within about ttl/3 plus
  a PING's answer time: a wait that heard nothing from its lead for a renewal interval makes sure
  the lead still answers (one PING per master and interval, shared by every wait of the object); a
  lead that does not is left as a failed one is (down for ttl/3), whatever it may still hand the
  wait being freed when it answers again. A lead that answers keeps the waiter's place in its FIFO
  however long the wait.
* Renew on all masters; a renewal that fewer than q masters confirm loses the permit (what it still
  has is given back). Release on all masters.
* The fencing token is a vector: :attr:`QuorumPermit.fences`, master index -> that master's fence.
  :meth:`QuorumPermit.newer_than` compares two: for a mutex, two successive holders share a master,
  and on it the later one's fence is larger. One number (a max or a sum) would not be ordered across
  masters.
* A master that restarted empty rejoins only after one lease: the lock is recreated there with every
  slot reserved (the single lock's limbo recovery) whenever the lock is on any master, so holders
  re-adopt their grants and nobody new gets that master's slots for one ttl. Before its first write
  (``set_limit``, or the setup of a first acquire) an object that has not seen the lock yet asks
  every master whether it has it (one EXISTS each); only a lock that no master answering has is
  created with free slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import redis
import redis.asyncio
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from scrapy_redislock._loop import every, stop
from scrapy_redislock._redis import Backoff, check_limit, check_timeout
from scrapy_redislock.errors import (
    AcquireTimeout,
    InvalidArgument,
    LockConnectionError,
    LockError,
    LockLost,
    QuorumNotReached,
)
from scrapy_redislock.lock.aio import AsyncCountingLock
from scrapy_redislock.lock.core import Clock, LockCore, LockKeys, Permit, default_identity
from scrapy_redislock.lock.front import LockFront, TaskContext, ThreadContext, waiting_client
from scrapy_redislock.lock.protocol import Call, Operation, adrive, drive
from scrapy_redislock.lock.sync import CountingLock

logger = logging.getLogger(__name__)

T = TypeVar("T")
F = TypeVar("F", bound=LockFront)  # the per-master lock front: CountingLock or AsyncCountingLock

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


def master_options(asyncio: bool = False) -> dict[str, Any]:
    """Client options for a quorum's masters: 1 s socket timeouts and no retries (redis-py retries a
    refused connection for seconds, which would eat the validity time; the next round is the
    retry)."""
    retry = (redis.asyncio.retry.Retry if asyncio else Retry)(NoBackoff(), 0)
    return {"socket_timeout": 1.0, "socket_connect_timeout": 1.0, "retry": retry}


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


class QuorumFront(Generic[F]):
    """What both quorum fronts share: argument checks, the core, one command runner per master."""

    client_types: tuple[type, ...] = ()
    master_class: type[F]  # set by each front

    def __init__(
        self,
        masters: Sequence[Any],
        name: str,
        limit: int,
        ttl: float = 30.0,
        *,
        key_prefix: str = "redislock",
        quorum: int | None = None,
        reentrant: bool = False,
        drift_factor: float = DRIFT_FACTOR,
        auto_renew: bool = False,
        on_lost: Callable[[QuorumPermit], object] | None = None,
        identity: Mapping[str, Any] | None = None,
        clock: Clock = time.monotonic,
        waiting: Sequence[Any] | None = None,
    ) -> None:
        """``waiting``: per master, the client whose connections block in that master's FIFO (a
        factory shares them between its locks); by default each per-master lock makes its own (see
        ``waiting_client``)."""
        if isinstance(masters, str | bytes) or not isinstance(masters, Sequence) or not masters:
            raise InvalidArgument(
                f"masters must be a non-empty list of redis clients, got {masters!r}"
            )
        expected = " or ".join(f"{t.__module__}.{t.__qualname__}" for t in self.client_types)
        for client in masters:
            if not isinstance(client, self.client_types):
                raise InvalidArgument(
                    f"masters must be {expected} clients, got {type(client).__name__}"
                )
        if len({id(c) for c in masters}) != len(masters):
            raise InvalidArgument(
                "masters lists the same client twice: each master must be an independent server"
            )
        if limit is None:
            raise InvalidArgument(
                "limit must be given for a quorum lock (its quorum depends on it), got None"
            )
        if reentrant and check_limit(limit) != 1:
            raise InvalidArgument(f"reentrant=True needs limit=1 (a mutex), got limit={limit!r}")
        # One ordinary lock per master: its core is what the quorum core drives, its front waits in
        # that master's FIFO (and reaps dead holders' leases meanwhile), its runner carries the
        # commands. A shared waiting client is the factory's to close; one a front makes itself, its
        # close() closes.
        shared = list(waiting) if waiting is not None else [None] * len(masters)
        self._fronts = [
            self.master_class(
                client,
                name,
                limit,
                ttl,
                key_prefix=key_prefix,
                identity=identity,
                clock=clock,
                waiting=each,
            )
            for client, each in zip(masters, shared, strict=True)
        ]
        self._core = QuorumCore.create(
            [front.core for front in self._fronts],
            quorum=quorum,
            reentrant=reentrant,
            drift_factor=drift_factor,
            clock=clock,
        )
        self._masters = list(masters)
        self._runners = [front.runner for front in self._fronts]
        # Per master: (when, whether it answered) of the last PING a lead wait sent (see
        # LeadWait.watch).
        self._answered: dict[int, tuple[float, bool]] = {}
        self.auto_renew = auto_renew
        self.on_lost = on_lost or (
            lambda p: logger.warning("quorum permit %s of %r was lost", p.token, p.name)
        )

    @property
    def name(self) -> str:
        """The lock's name."""
        return self._core.name

    @property
    def owner(self) -> str:
        """This object's owner name on every master."""
        return self._core.owner

    @property
    def quorum(self) -> int:
        """Masters a permit needs."""
        return self._core.quorum

    @property
    def ttl(self) -> float:
        """Lease seconds on each master."""
        return self._core.ttl

    @property
    def renew_interval(self) -> float:
        """ttl/3, at most 1 s."""
        return self._core.renew_interval

    @property
    def keys(self) -> LockKeys:
        """The lock's Redis keys (the same on every master)."""
        return self._core.cores[0].keys

    @property
    def held(self) -> list[QuorumPermit]:
        return list(self._core.held.values())

    @property
    def masters(self) -> int:
        return len(self._fronts)

    @property
    def busy(self) -> bool:
        """Holds, waits or has an abandoned wait to clean up on some master: what a maintain() is
        for."""
        return bool(self._core.held) or any(front.busy for front in self._fronts)

    def renewal_due(self) -> bool:
        """Whether a maintain() is needed now: something held, or a master's front busy (a quorum
        permit's validity is counted from its round, so every tick renews it)."""
        return self.busy

    def _check_limit(self, limit: int) -> None:
        if limit != self._core.limit:
            raise InvalidArgument(
                f"quorum lock {self.name!r}: set_limit({limit!r}) differs from the limit "
                f"{self._core.limit} it was made with; its quorum depends on the limit: make a "
                "new lock object"
            )

    def annotate(self, **fields: Any) -> None:
        """Add fields to this owner's identity on every master (sent with the next maintain
        there)."""
        for front in self._fronts:
            front.annotate(**fields)

    def _report_lost(self, lost: list[QuorumPermit]) -> None:
        for permit in lost:
            try:
                self.on_lost(permit)
            except Exception:
                logger.exception("on_lost callback of quorum lock %r failed", self.name)

    def _recent_answer(self, index: int) -> bool | None:
        """Whether master ``index`` answered the last PING, if that was less than a renewal interval
        ago."""
        last = self._answered.get(index)
        if last is None or self._core.clock() - last[0] >= self.renew_interval:
            return None
        return last[1]

    def _silent(self, index: int, cause: BaseException | None = None) -> LeadSilent:
        error = LeadSilent(
            f"quorum lock {self.name!r}: master {index} did not answer within {ANSWER_WITHIN} s "
            "while a wait was "
            "queued there; the wait was given up"
        )
        error.__cause__ = cause
        return error


class QuorumCountingLock(ThreadContext[QuorumPermit], QuorumFront[CountingLock]):
    """A counting lock held on a safe quorum of N independent ``redis.Redis`` masters, for blocking
    code.

    Masters are asked one after the other; give the clients a socket timeout well below ``ttl`` and
    no retries (:class:`QuorumLockFactory` does), or a hung or dead master eats the validity time.
    """

    client_types = (redis.Redis,)
    master_class = CountingLock

    def __init__(self, masters: Sequence[redis.Redis], *args: Any, **kwargs: Any) -> None:
        super().__init__(masters, *args, **kwargs)
        self._local = threading.local()
        self._renewer: threading.Thread | None = None
        self._loop_lock = threading.Lock()
        self._stop = threading.Event()
        self._answer_locks = [threading.Lock() for _ in self._masters]

    def _one(self, index: int, op: Operation[object]) -> object:
        try:
            return drive(op, self._runners[index], self.name)
        except MASTER_ERRORS as exc:
            return exc

    def _run(self, op: QuorumOperation[T]) -> T:
        reply: Any = None
        try:
            while True:
                try:
                    command = op.send(reply)
                except StopIteration as stop:
                    result: T = stop.value
                    return result
                if isinstance(command, Pause):
                    time.sleep(command.seconds)
                    reply = None
                elif isinstance(command, LeadWait):
                    try:
                        reply = {command.index: self._lead_wait(command)}
                    except MASTER_ERRORS as exc:
                        reply = {command.index: exc}
                else:
                    reply = {i: self._one(i, sub) for i, sub in command.ops.items()}
        finally:
            op.close()

    def _lead_wait(self, command: LeadWait) -> Permit | BaseException:
        """The lead master's blocking acquire, in this thread; with ``command.watch`` a watcher
        thread breaks the wait off when the master stops answering (see :meth:`_watch`): LeadSilent
        then."""
        front = self._fronts[command.index]
        if command.watch is None:
            return front.acquire(command.timeout)
        done, cut = threading.Event(), threading.Event()
        watcher = threading.Thread(
            target=self._watch,
            args=(command.index, command.watch, done, cut),
            name=f"redislock-quorum-watch-{self.name}",
            daemon=True,
        )
        watcher.start()
        try:
            return front.acquire(command.timeout)
        except MASTER_ERRORS as exc:
            if cut.is_set():
                return self._silent(command.index, exc)
            raise
        finally:
            done.set()

    def _watch(self, index: int, every: float, done: threading.Event, cut: threading.Event) -> None:
        """While a lead wait on master ``index`` is out: every ``every`` s, if that master does not
        answer, close the connections that wait on it (a blocked read cannot be cancelled from
        another thread): the wait ends with a connection error, its consumer is abandoned (freed by
        the next maintain there), and the quorum moves on. Repeated while it stays silent, in case
        the wait was between two reads. Every wait of this object's factory queued there ends alike:
        the master is silent for all of them."""
        while not done.wait(every):
            if self._answers(index) or done.is_set():
                continue
            cut.set()
            waiting = self._fronts[index]._waiting_client  # (its command runner's)
            if waiting is not None:
                waiting.connection_pool.disconnect()

    def _answers(self, index: int) -> bool:
        """Whether master ``index`` answers a PING (within the client's socket timeout, which a
        quorum's clients must have: 1 s from QuorumLockFactory); one PING per master and renewal
        interval, however many waits ask."""
        with self._answer_locks[index]:
            recent = self._recent_answer(index)
            if recent is not None:
                return recent
            try:
                self._masters[index].ping()
                answered = True
            except MASTER_ERRORS:
                answered = False
            self._answered[index] = (self._core.clock(), answered)
            return answered

    def _acquire(self, timeout: float | None, blocking: bool) -> QuorumPermit | None:
        pending: Pending = []
        try:
            return self._run(self._core.acquire(timeout, blocking, threading.get_ident(), pending))
        except BaseException:
            # interrupted (KeyboardInterrupt) holding grants no permit owns: give them back
            if pending:
                with contextlib.suppress(Exception):
                    self._run(self._core.sweep(pending))
            raise

    def acquire(self, timeout: float | None = None) -> QuorumPermit:
        """A permit on >= quorum masters; AcquireTimeout after ``timeout`` s, saying how the last
        round went."""
        permit = self._acquire(timeout, True)
        assert permit is not None
        self._start_loop()
        return permit

    def try_acquire(self) -> QuorumPermit | None:
        """One round: a permit if >= quorum masters grant one now, else None (partial grants given
        back)."""
        permit = self._acquire(None, False)
        if permit is not None:
            self._start_loop()
        return permit

    def release(self, permit: QuorumPermit) -> bool:
        """Give the slot back on every master: True if >= quorum still held it."""
        return bool(self._run(self._core.release(permit)))

    def renew(self, permit: QuorumPermit) -> None:
        """Renew on every master; LockLost when fewer than ``quorum`` renewed (what is left is given
        back)."""
        if self.maintain([permit]):
            raise LockLost(
                f"quorum lock {self.name!r}: fewer than {self.quorum} masters renewed "
                f"{permit.token}"
            )

    def maintain(self, permits: list[QuorumPermit] | None = None) -> list[QuorumPermit]:
        """Renew held permits (default: all) on every master; returns the lost ones (on_lost is
        called for each)."""
        lost: list[QuorumPermit] = self._run(self._core.maintain(permits))
        self._report_lost(lost)
        return lost

    def set_limit(self, limit: int) -> int | None:
        """Write this object's limit to every master (see
        :meth:`AsyncQuorumCountingLock.set_limit`); returns the previous limit."""
        self._check_limit(limit)
        return self._run(self._core.set_limit(limit))

    def get_limit(self) -> int | None:
        """The limit most answering masters hold; QuorumNotReached when fewer than q answer."""
        return self._run(self._core.get_limit())

    def close(self, retire: bool = False) -> int:
        """Stop renewing and free everything this object holds on every master; returns how many
        permits. ``retire=True``: each master deletes the lock when nobody else uses it there."""
        self._stop.set()
        renewer = self._renewer
        if renewer is not None and renewer is not threading.current_thread():
            renewer.join()
        count = self._core.forget_all()
        for front in self._fronts:
            with contextlib.suppress(*MASTER_ERRORS):
                front.close(retire=retire)
        return count

    def _start_loop(self) -> None:
        with self._loop_lock:
            if (
                not self.auto_renew
                or self._stop.is_set()
                or (self._renewer and self._renewer.is_alive())
            ):
                return
            self._renewer = threading.Thread(
                target=self._loop, name=f"redislock-quorum-{self.name}", daemon=True
            )
            self._renewer.start()

    def _loop(self) -> None:
        """Renew every ttl/3 while something is held; errors are logged and retried."""
        while not self._stop.wait(self.renew_interval):
            with self._loop_lock:
                if not self._core.held:
                    self._renewer = None
                    return
            try:
                self.maintain()
            except Exception:
                logger.exception("renewing quorum lock %r failed", self.name)


class AsyncQuorumCountingLock(TaskContext[QuorumPermit], QuorumFront[AsyncCountingLock]):
    """A counting lock held on a safe quorum of N independent ``redis.asyncio.Redis`` masters;
    masters are asked all at once."""

    client_types = (redis.asyncio.Redis,)
    master_class = AsyncCountingLock

    def __init__(self, masters: Sequence[redis.asyncio.Redis], *args: Any, **kwargs: Any) -> None:
        super().__init__(masters, *args, **kwargs)
        self._context: dict[asyncio.Task[Any] | None, list[QuorumPermit]] = {}
        self._renewer: asyncio.Task[None] | None = None
        self._closed = False
        # master index -> the PING in flight (see _answers)
        self._pings: dict[int, asyncio.Future[bool]] = {}

    async def _one(self, index: int, op: Operation[object]) -> object:
        try:
            return await adrive(op, self._runners[index], self.name)
        except MASTER_ERRORS as exc:
            return exc

    async def _run(self, op: QuorumOperation[T], pending: Pending | None = None) -> T:
        reply: Any = None
        try:
            while True:
                try:
                    command = op.send(reply)
                except StopIteration as stop:
                    result: T = stop.value
                    return result
                if isinstance(command, Pause):
                    await asyncio.sleep(command.seconds)
                    reply = None
                elif isinstance(command, LeadWait):
                    try:
                        reply = {command.index: await self._lead_wait(command, pending)}
                    except MASTER_ERRORS as exc:
                        reply = {command.index: exc}
                else:
                    indexes = list(command.ops)
                    tasks = [asyncio.ensure_future(self._one(i, command.ops[i])) for i in indexes]
                    try:
                        results = await asyncio.gather(*tasks)
                    except asyncio.CancelledError:
                        # Masters that answered before the cancellation may have granted: those
                        # grants are the interrupted acquire's too (the generator never saw them).
                        await asyncio.gather(*tasks, return_exceptions=True)
                        if pending is not None:
                            pending.extend(
                                (i, got)
                                for i, t in zip(indexes, tasks, strict=True)
                                if not t.cancelled() and isinstance(got := t.result(), Permit)
                            )
                        raise
                    reply = dict(zip(indexes, results, strict=True))
        finally:
            op.close()

    async def _lead_wait(
        self, command: LeadWait, pending: Pending | None
    ) -> Permit | BaseException:
        """The lead master's blocking acquire; with ``command.watch``, in a task of its own, given
        up (cancelled: its consumer abandoned, freed by the next maintain there) when the master
        stops answering: LeadSilent then."""
        front = self._fronts[command.index]
        if command.watch is None:
            return await front.acquire(command.timeout)
        wait = asyncio.ensure_future(front.acquire(command.timeout))
        try:
            while True:
                done, _ = await asyncio.wait({wait}, timeout=command.watch)
                if done:
                    break
                if await self._answers(command.index):
                    continue  # the lead is up: the wait keeps its place in the FIFO
                if wait.done():
                    break
                wait.cancel()
                await asyncio.wait({wait})
                if wait.cancelled():
                    return self._silent(command.index)
                break  # it ended as the cancel came: its outcome stands (a grant is used as any other)
        except asyncio.CancelledError:
            # The acquire itself was cancelled: so is the wait; a grant it got first is the
            # acquire's to sweep.
            wait.cancel()
            await asyncio.wait({wait})
            if not wait.cancelled() and wait.exception() is None and pending is not None:
                pending.append((command.index, wait.result()))
            raise
        return wait.result()

    async def _answers(self, index: int) -> bool:
        """Whether master ``index`` answers a PING within ANSWER_WITHIN (or its socket timeout); one
        PING per master and renewal interval, shared by every wait of this object that asks
        meanwhile."""
        recent = self._recent_answer(index)
        if recent is not None:
            return recent
        ping = self._pings.get(index)
        if ping is None or ping.done():
            ping = self._pings[index] = asyncio.ensure_future(self._ping(index))
        return await asyncio.shield(ping)

    async def _ping(self, index: int) -> bool:
        try:
            await asyncio.wait_for(self._masters[index].ping(), ANSWER_WITHIN)
            answered = True
        except MASTER_ERRORS:  # a redis error, or TimeoutError (an OSError) from wait_for
            answered = False
        self._answered[index] = (self._core.clock(), answered)
        return answered

    async def _acquire(self, timeout: float | None, blocking: bool) -> QuorumPermit | None:
        pending: Pending = []
        try:
            return await self._run(
                self._core.acquire(timeout, blocking, asyncio.current_task(), pending), pending
            )
        except asyncio.CancelledError:
            # Cut short: give back what it held that no permit owns, and free cancelled waits'
            # grants, now.
            with contextlib.suppress(Exception):
                await asyncio.shield(self._run(self._core.sweep(pending)))
            raise

    async def acquire(self, timeout: float | None = None) -> QuorumPermit:
        """A permit on >= quorum masters; AcquireTimeout after ``timeout`` s."""
        permit = await self._acquire(timeout, True)
        assert permit is not None
        self._start_loop()
        return permit

    async def try_acquire(self) -> QuorumPermit | None:
        """One round: a permit if >= quorum masters grant one now, else None."""
        permit = await self._acquire(None, False)
        if permit is not None:
            self._start_loop()
        return permit

    async def release(self, permit: QuorumPermit) -> bool:
        """Give the slot back on every master: True if >= quorum still held it."""
        return bool(await self._run(self._core.release(permit)))

    async def renew(self, permit: QuorumPermit) -> None:
        """Renew on every master; LockLost when fewer than ``quorum`` renewed."""
        if await self.maintain([permit]):
            raise LockLost(
                f"quorum lock {self.name!r}: fewer than {self.quorum} masters renewed "
                f"{permit.token}"
            )

    async def maintain(self, permits: list[QuorumPermit] | None = None) -> list[QuorumPermit]:
        """Renew held permits (default: all) on every master; returns the lost ones."""
        lost: list[QuorumPermit] = await self._run(self._core.maintain(permits))
        self._report_lost(lost)
        return lost

    async def set_limit(self, limit: int) -> int | None:
        """Write this object's limit to every master at once (the newest process's settings win):
        the previous limit of the first master that had one; :class:`QuorumNotReached` (naming
        the masters that failed) when fewer than q took it. Only the limit the object was made
        with: its quorum was computed from it (another limit needs a new object). A master missing
        then gets the lock with this limit when it is first used.

        Never creates free slots on a master that lost the lock while another has it: until this
        object has seen the lock, it first asks every master whether it has it (one EXISTS each),
        and a master without it gets it with every slot reserved for one lease (see
        :meth:`QuorumCore.set_limit`)."""
        self._check_limit(limit)
        previous: int | None = await self._run(self._core.set_limit(limit))
        return previous

    async def get_limit(self) -> int | None:
        """The limit most answering masters hold; QuorumNotReached when fewer than q answer."""
        limit: int | None = await self._run(self._core.get_limit())
        return limit

    async def aclose(self, retire: bool = False) -> int:
        """Stop renewing and free everything this object holds on every master; returns how many
        permits. ``retire=True``: each master deletes the lock when nobody else uses it there."""
        self._closed = True
        if self._renewer is not None and self._renewer is not asyncio.current_task():
            await stop(self._renewer)
        self._renewer = None
        for ping in self._pings.values():
            ping.cancel()
        count = self._core.forget_all()
        await asyncio.gather(
            *(front.aclose(retire=retire) for front in self._fronts), return_exceptions=True
        )
        return count

    def _start_loop(self) -> None:
        if (
            not self.auto_renew
            or self._closed
            or (self._renewer is not None and not self._renewer.done())
        ):
            return
        self._renewer = asyncio.get_running_loop().create_task(
            every(
                lambda: self.renew_interval, self._tick, what=f"renewing quorum lock {self.name!r}"
            ),
            name=f"redislock-quorum-{self.name}",
        )

    async def _tick(self) -> bool:
        if not self._core.held:
            return False
        await self.maintain()
        return True


class QuorumLockFactory:
    """Quorum locks over one set of masters, sharing their connections (like redlock-py's
    RedLockFactory).

    ``masters``: redis URLs or clients (all blocking or all ``redis.asyncio``); with URLs,
    ``asyncio=True`` makes asyncio clients. Clients made here get ``socket_timeout`` and
    ``socket_connect_timeout`` of 1 s and no retries unless ``client_options`` say otherwise
    (redis-py retries a refused connection 10 times, some 4 s: that would eat the validity time; the
    next round is the retry), and are closed by :meth:`close` / :meth:`aclose`.
    """

    def __init__(
        self, masters: Sequence[Any], *, asyncio: bool = False, **client_options: Any
    ) -> None:
        if isinstance(masters, str | bytes) or not isinstance(masters, Sequence) or not masters:
            raise InvalidArgument(
                f"masters must be a non-empty list of redis URLs or clients, got {masters!r}"
            )
        module: Any = redis.asyncio if asyncio else redis
        options = {**master_options(asyncio), **client_options}
        self.clients: list[Any] = []
        self._made: list[Any] = []
        for master in masters:
            if isinstance(master, str):
                try:
                    client = module.Redis.from_url(master, **options)
                except ValueError as exc:
                    raise InvalidArgument(
                        f"masters: {master!r} is not a redis URL ({exc})"
                    ) from None
                self._made.append(client)
            else:
                client = master
            self.clients.append(client)
        self.asyncio = isinstance(self.clients[0], redis.asyncio.Redis)
        # one blocking pool per master
        self.waiting = [waiting_client(client) for client in self.clients]

    def lock(
        self, name: str, limit: int, ttl: float = 30.0, **kwargs: Any
    ) -> QuorumCountingLock | AsyncQuorumCountingLock:
        """A :class:`QuorumCountingLock` (or :class:`AsyncQuorumCountingLock`) over the factory's
        masters."""
        cls = AsyncQuorumCountingLock if self.asyncio else QuorumCountingLock
        return cls(self.clients, name, limit, ttl, waiting=self.waiting, **kwargs)

    def close(self) -> None:
        """Close the clients the factory made, and its waiting pools (blocking ones)."""
        for client in self._made:
            client.close()
        for client in self.waiting:
            if client is not None:  # (a cluster client has none)
                client.close()

    async def aclose(self) -> None:
        """Close the clients the factory made, and its waiting pools (asyncio ones)."""
        for client in self._made:
            await client.aclose()
        for client in self.waiting:
            if client is not None:
                await client.aclose()


__all__ = [
    "AsyncQuorumCountingLock",
    "QuorumCountingLock",
    "QuorumLockFactory",
    "QuorumPermit",
    "safe_quorum",
]
