"""The quorum lock's sans-IO core: one lock operation fanned out over N masters (see the
package docstring for what it promises)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import redis.exceptions

from scrapy_redislock._redis import check_timeout
from scrapy_redislock.errors import (
    InvalidArgument,
    LockError,
    QuorumNotReached,
)
from scrapy_redislock.lock.core import Clock, LockCore
from scrapy_redislock.lock.permit import LockKeys, Permit, default_identity
from scrapy_redislock.lock.protocol import Call, Operation
from scrapy_redislock.lock.quorum.protocol import (
    Fanout,
    Pending,
    QuorumOperation,
    QuorumPermit,
)
from scrapy_redislock.lock.quorum.wait import QuorumWait

logger = logging.getLogger("scrapy_redislock.lock.quorum")

T = TypeVar("T")

DRIFT_FACTOR = 0.01  # as Redlock: clocks may run 1% apart over a ttl
DRIFT_MS = 2  # plus this much for the rounding of Redis's millisecond clock
# one master failing is an answer, not a failure
MASTER_ERRORS = (redis.exceptions.RedisError, LockError, OSError)
ANSWER_WITHIN = 1.0  # s: a lead master that does not answer a PING within this (or its socket timeout) is silent


def safe_quorum(masters: int, limit: int) -> int:
    """The smallest q with q > masters*limit/(limit+1): no more than ``limit`` holders can each own
    q masters."""
    return masters * limit // (limit + 1) + 1


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
                "quorum lock %r: quorum=%d is below the safe quorum %d for %d masters and limit %d: up to %d holders can hold it at once",  # noqa: E501
                name,
                quorum,
                safe,
                masters,
                limit,
                masters * limit // quorum,
            )
        owner = f"{default_identity()['host']}:{uuid.uuid4().hex[:12]}"
        for core in cores:
            core.rename(owner)  # one owner name on every master: status shows one holder
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

    @property
    def keys(self) -> LockKeys:
        """The lock's Redis keys, the same on every master."""
        return self.cores[0].keys

    def validity(self, started: float) -> float:
        """Seconds a grant made by a round that started at ``started`` is still safe to use."""
        drift = self.ttl * self.drift_factor + DRIFT_MS / 1000
        return self.ttl - (self.clock() - started) - drift

    def known_somewhere(self) -> None:
        """The lock exists on some master: any master that lacks it lost it, and recreates it in
        limbo."""
        self.known = True
        for core in self.cores:
            core.registration.ever = True

    def probe(self, skip: int | None = None) -> QuorumOperation[None]:
        """Until the lock was seen: does it exist on any master (but ``skip``)? Then a master
        without it lost it (restarted empty), and every per-master setup or set_limit that finds it
        missing recreates it in limbo. Run before anything this object writes could create the lock:
        one EXISTS per master, only while the lock was never seen. A master that does not answer is
        not counted: only a lock that some master has is known."""
        if self.known:
            return
        replies = yield Fanout({i: _exists(core) for i, core in enumerate(self.cores) if i != skip})
        if any(not isinstance(r, BaseException) and int(r) for r in replies.values()):
            self.known_somewhere()

    def set_limit(self, limit: int) -> QuorumOperation[int | None]:
        """Write ``limit`` to every master: the previous limit of the first master that had one;
        :class:`QuorumNotReached` when fewer than ``quorum`` masters took it. A master that lacks
        the lock while another has it gets it in limbo (every slot reserved for one lease: it lost
        the lock, and a holder may be about to re-adopt its grant there); only a lock found on no
        master is created with free slots."""
        yield from self.probe()
        recover = self.known
        replies = yield Fanout(
            {i: core.set_limit(limit, recover) for i, core in enumerate(self.cores)}
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
            self.known_somewhere()
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
            f"quorum lock {self.name!r}: {what}: {len(self.cores) - len(failed)} of {len(self.cores)} masters answered, {self.quorum} needed ({said})",  # noqa: E501
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
        yield from self.probe()
        wait = QuorumWait(self, timeout, pending)
        permit = (yield from wait.run()) if blocking else (yield from wait.round())
        if permit is not None:
            self.held[id(permit)] = permit
            if self.reentrant and holder is not None:
                self.by_holder[holder] = permit
        return permit

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
            if mine or core.consumers.abandoned:
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
            if orphans or core.consumers.abandoned:
                ops[i] = self._sweep_one(i, orphans)
        pending.clear()
        if ops:
            yield Fanout(ops)

    def _sweep_one(self, index: int, orphans: list[Permit]) -> Operation[None]:
        yield from self._release_each(index, orphans)
        if self.cores[index].consumers.abandoned:
            yield from self.cores[index].maintain([])

    def forget_all(self) -> int:
        """Every permit is lost (the quorum lock's close frees everything of this owner on each master);
        how many."""
        count = len(self.held)
        for permit in self.held.values():
            permit.lost = True
        self.held.clear()
        self.by_holder.clear()
        return count
