"""Sans-IO core of the counting lock: what to send to Redis and what the replies mean.

Every lock operation is a generator that yields commands (:class:`RunScript`,
:class:`ReadGrant`) and receives their replies, or has the redis error thrown in.
The sync and asyncio fronts (``sync.py``, ``aio.py``) only carry commands to
Redis, so the lock's logic exists once. This module does no I/O and imports
neither Scrapy nor Twisted.

How the lock sits in Redis (see ``scripts/_lib.lua``): a stream whose entries are
slot grants and one consumer group. A free slot is an entry not yet delivered;
waiters block in ``XREADGROUP ... BLOCK``, which Redis serves first come, first
served, and a release adds a new entry, which Redis hands to the first blocked
waiter at once. A held slot is an entry in the group's pending list: the owner is
its consumer, the lease age its idle time on Redis's clock. The entry's sequence
number is the fencing token.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import redis.exceptions

from scrapy_redislock._redis import (
    check_flag,
    check_limit,
    check_name,
    check_timeout,
    check_ttl,
    load_scripts,
    text,
)
from scrapy_redislock.errors import (
    AcquireTimeout,
    InvalidArgument,
    LockError,
    LockLost,
    NotReplicated,
)
from scrapy_redislock.lock.protocol import (
    Call,
    Operation,
    ReadGrant,
    RunScript,
    WaitReplicas,
    is_missing_lock,
)

GROUP = "holders"
LIMBO = "__limbo__"
SCRIPT_NAMES = (
    "setup",
    "guard",
    "take",
    "release",
    "hold_again",
    "maintain",
    "set_limit",
    "release_owner",
    "reset",
    "retire",
    "delay",
)


def lock_scripts() -> dict[str, str]:
    """The lock's Lua sources by name, each with ``scripts/_lib.lua`` in front of it."""
    return load_scripts("scrapy_redislock.lock", SCRIPT_NAMES, "_lib")


Clock = Callable[[], float]


@dataclass
class Permit:
    """One granted slot. ``fence`` increases strictly with every grant of the lock.

    ``leased_at`` is when its lease began at the latest, on the lock's clock: the moment the wait
    that got it asked, then the moment each renewal that confirmed it was sent (Redis restarts a
    lease when it grants or renews, never before it is asked). ``valid_until`` is that plus the
    lease: past it, Redis may have given the slot to another process, even if this one could not
    hear about it (a stall, a partition).
    """

    name: str
    owner: str
    grant: str
    fence: int
    acquired_at: float
    holds: int = 1
    lost: bool = False
    released: bool = False
    # the consumer the grant sits under in Redis: its wait's, or the owner's once renewed
    consumer: str = ""
    leased_at: float = -math.inf
    # set by the lock at each grant and renewal; a permit made by hand is not usable
    valid_until: float = -math.inf

    def usable(self, now: float) -> bool:
        """Held as far as this process knows: not lost, not released, its lease not run out by
        ``now``."""
        return not self.lost and not self.released and now < self.valid_until

    @property
    def token(self) -> str:
        """The owner token: who holds it and which grant it is."""
        return f"{self.owner}/{self.grant}"


@dataclass(frozen=True)
class LockKeys:
    """Redis keys of one lock; they share a hash tag so Redis Cluster keeps them together."""

    slots: str
    meta: str
    owners: str
    holds: str
    ttls: str
    seen: str
    gate: str  # the delay gate of the stage or key (lock/delay.py): a string, only while a start is booked

    @classmethod
    def of(cls, prefix: str, name: str) -> LockKeys:
        base = f"{prefix}:{{{name}}}"
        return cls(
            *(
                f"{base}:{part}"
                for part in ("slots", "meta", "owners", "holds", "ttls", "seen", "gate")
            )
        )


def fence_of(grant: str) -> int:
    return int(grant.rsplit("-", 1)[1])


def default_identity(label: str | None = None) -> dict[str, Any]:
    """What status shows about a holder; nothing in it is secret."""
    identity: dict[str, Any] = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": round(time.time(), 3),
    }
    if label:
        identity["label"] = label
    return identity


# maintains that free an abandoned wait's consumer: the second catches a late delivery
ABANDONED_PASSES = 2


@dataclass
class LockCore:
    """State and logic of one lock object; the fronts drive its generator methods.

    What it promises (the scripts keep it): a grant is freed only by its holder's release, by the
    reaper once its lease (the longest ttl of the live owners) expired, by an operator, or because
    the wait it was delivered to was abandoned (that wait's consumer name is never reused) -- never
    because a renewal did not list it.
    """

    name: str
    keys: LockKeys
    limit: int | None
    ttl: float
    reentrant: bool
    clock: Clock
    identity: dict[str, Any]
    max_block: float | None = None
    configured_ttl: float = 0.0
    replicas: int = 0
    durable: bool = False  # Redis loses no acknowledged write: a restart keeps the lock (no one-lease reservation)
    owner: str = field(
        default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    )
    held: dict[str, Permit] = field(default_factory=dict)
    by_holder: dict[Any, Permit] = field(default_factory=dict)
    set_up: bool = False
    ever_set_up: bool = False
    registered_at: float = -math.inf
    waits_in_flight: int = 0
    idle_consumers: list[str] = field(default_factory=list)
    consumers_made: int = 0
    abandoned: dict[str, int] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        name: object,
        limit: object,
        ttl: object,
        *,
        key_prefix: object = "redislock",
        reentrant: bool = False,
        clock: Clock = time.monotonic,
        identity: Mapping[str, Any] | None = None,
        max_block: float | None = None,
        replicas: object = 0,
        durable: bool = False,
    ) -> LockCore:
        name = check_name(name)
        prefix = check_name(key_prefix, "key_prefix")
        checked_limit = None if limit is None else check_limit(limit)
        checked_ttl = check_ttl(ttl)
        if reentrant and checked_limit != 1:
            raise InvalidArgument(f"reentrant=True needs limit=1 (a mutex), got limit={limit!r}")
        ident = default_identity()
        ident.update(identity or {})
        return cls(
            name=name,
            keys=LockKeys.of(prefix, name),
            limit=checked_limit,
            ttl=checked_ttl,
            reentrant=reentrant,
            clock=clock,
            identity=ident,
            max_block=max_block,
            configured_ttl=checked_ttl,
            replicas=check_limit(replicas, "replicas"),
            durable=check_flag(durable, "durable"),
        )

    # -- commands ---------------------------------------------------------------

    @property
    def ttl_ms(self) -> int:
        """This object's own lease ttl in ms (a lease in Redis lasts the longest ttl of the live
        owners)."""
        return max(1, round(self.configured_ttl * 1000))

    @property
    def renew_interval(self) -> float:
        """A third of this object's ttl, at most 1 s; leases are judged by the longest ttl in play,
        never shorter."""
        return min(self.configured_ttl, 3.0) / 3

    @property
    def busy(self) -> bool:
        """Something to renew, a wait to serve, or an abandoned wait to clean up."""
        return bool(self.held or self.waits_in_flight or self.abandoned)

    def _script(self, name: str, keys: tuple[str, ...], *args: str | int) -> RunScript:
        return RunScript(name, keys, args)

    def _take_consumer(self) -> str:
        """A consumer name for one wait: an idle one of this owner, or a new one."""
        if self.idle_consumers:
            return self.idle_consumers.pop()
        self.consumers_made += 1
        return f"{self.owner}#{self.consumers_made}"

    def _idle(self, consumer: str) -> None:
        """The consumer holds nothing and no wait uses it: the next wait may reuse it."""
        if consumer.startswith(f"{self.owner}#") and consumer not in self.idle_consumers:
            self.idle_consumers.append(consumer)

    def _abandon(self, consumer: str) -> None:
        """A wait on ``consumer`` ended without seeing its reply: what it was handed is freed, the
        name retired.

        A grant id in its place (a grant that a renewal may have moved to the owner's consumer) is
        freed alike.
        """
        self.abandoned[consumer] = ABANDONED_PASSES

    @property
    def _durable_flag(self) -> str:
        return "1" if self.durable else "0"

    # -- operations (generators) ----------------------------------------------

    def setup(self, recover: bool = False) -> Operation[tuple[bool, int]]:
        """Create the lock in Redis if needed and register this owner."""
        k = self.keys
        reply = yield self._script(
            "setup",
            (k.slots, k.meta, k.owners, k.ttls, k.seen),
            "" if self.limit is None else self.limit,
            self.ttl_ms,
            self.owner,
            json.dumps(self.identity),
            "1" if recover else "0",
            self._durable_flag,
        )
        created, limit, lease_ms = text(reply)
        self.set_up = self.ever_set_up = True
        self.registered_at = self.clock()
        self.ttl = int(lease_ms) / 1000
        if self.limit is None:
            self.limit = int(limit)  # what to recreate the lock with if Redis loses it
        return bool(created), int(limit)

    def _ensure_setup(self) -> Operation[None]:
        """Set up (again after a quiet spell: the owner may have been forgotten, and its ttl with
        it).

        An object that has seen the lock before recreates a missing one in limbo: it can only be
        missing because Redis lost it, and survivors must get their slots back before anybody new.
        """
        if not self.set_up or self.clock() - self.registered_at > self.configured_ttl:
            try:
                yield from self.setup(recover=self.ever_set_up)
            except redis.exceptions.ResponseError as exc:
                if is_missing_lock(exc):
                    raise LockError(
                        f"lock {self.name!r} does not exist in Redis and no limit was given"
                    ) from None
                raise

    @overload
    def acquire(
        self, timeout: float | None, blocking: Literal[True] = True, holder: object = None
    ) -> Operation[Permit]: ...

    @overload
    def acquire(
        self, timeout: float | None, blocking: bool, holder: object = None
    ) -> Operation[Permit | None]: ...

    def acquire(
        self, timeout: float | None, blocking: bool = True, holder: object = None
    ) -> Operation[Permit | None]:
        """Wait for a slot (FIFO across all processes); None when not blocking and none is free."""
        timeout = check_timeout(timeout)
        if self.reentrant and holder is not None and holder in self.by_holder:
            permit = self.by_holder[holder]
            count = yield self._script(
                "hold_again", (self.keys.slots, self.keys.holds), self.owner, permit.grant
            )
            if int(count):
                permit.holds = int(count)
                self._idle(permit.consumer)
                permit.consumer = self.owner
                return permit
            self._forget(permit)
        yield from self._ensure_setup()
        deadline = None if timeout is None else self.clock() + timeout
        consumer = self._take_consumer()
        while True:
            block_ms = self._block_ms(deadline) if blocking else None
            # deadline passed: one last look without blocking
            last_try = blocking and block_ms is None
            self.waits_in_flight += 1
            finished = False
            asked_at = self.clock()
            try:
                if blocking and block_ms is not None:  # (that is, not last_try)
                    reply = yield ReadGrant(
                        self.keys.slots, consumer, block_ms, self.keys.meta, self.durable
                    )
                    grant = self._grant_from(reply)
                else:  # one look without blocking: a script, which notices a restart of Redis first
                    reply = yield self._take(consumer)
                    grant = None if not reply else str(text(reply))
                finished = True
            except redis.exceptions.ResponseError as exc:
                finished = True  # an error reply: nothing was delivered
                if not is_missing_lock(exc):
                    self._idle(consumer)
                    raise
                self.set_up = False
                try:
                    yield from self._ensure_setup()
                except BaseException:
                    self._idle(consumer)
                    raise
                continue
            finally:
                self.waits_in_flight -= 1
                if not finished:
                    # Cancelled, or the connection broke: a grant may have been delivered that
                    # nobody will see.
                    self._abandon(consumer)
            if grant is not None:
                permit = Permit(
                    self.name, self.owner, grant, fence_of(grant), self.clock(), consumer=consumer
                )
                self._leased(permit, asked_at)
                if self.replicas:
                    yield from self._confirm_grant(permit)
                if self.clock() - asked_at >= self.ttl / 2 and not (
                    yield from self._still_granted(permit)
                ):
                    consumer = self._take_consumer()
                    continue
                self.held[permit.grant] = permit
                if self.reentrant and holder is not None:
                    self.by_holder[holder] = permit
                return permit
            if not blocking:
                self._idle(consumer)
                return None
            if last_try:
                self._idle(consumer)
                raise AcquireTimeout(f"lock {self.name!r}: no slot within {timeout} s")

    def _still_granted(self, permit: Permit) -> Operation[bool]:
        """Renew a grant whose reply came late; False if its lease was already reaped.

        Redis made the grant at some moment between the ask and the reply. A reply that took half a
        lease or more (a paused or overloaded Redis, a slow network, a long blocking wait) may carry
        a grant made that long ago, whose lease has run out or is about to, and which a reaper may
        hand to somebody else. Renewing it first makes it safe to use; a grant already reaped is not
        used and the wait goes on. Shorter replies cost nothing: their grant has more than half a
        lease left, and renewals run every ttl/3.
        """
        try:
            lost = yield from self.maintain([permit])
        except BaseException:
            # Not held yet: whatever the wait was handed is freed, under its wait's consumer or, if
            # the renewal went through before the cancel, under the owner's.
            self._abandon(permit.consumer)
            self._abandon(permit.grant)
            raise
        return not lost

    def _take(self, consumer: str) -> RunScript:
        k = self.keys
        interval_ms = max(1, round(self.renew_interval * 1000))
        return self._script(
            "take", (k.slots, k.meta, k.holds), consumer, interval_ms, self._durable_flag
        )

    def _block_ms(self, deadline: float | None) -> int | None:
        """Milliseconds to block; 0 is forever; None when the deadline has passed."""
        cap = None if self.max_block is None else max(1, int(self.max_block * 1000))
        if deadline is None:
            return cap or 0
        left = deadline - self.clock()
        if left <= 0:
            return None
        ms = max(1, math.ceil(left * 1000))
        return ms if cap is None else min(ms, cap)

    @staticmethod
    def _grant_from(reply: Any) -> str | None:
        if not reply:
            return None
        # RESP2: [[key, [[id, fields]]]]; RESP3: {key: [[id, fields]]} (or one level deeper)
        entries = next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1]
        entry = entries
        while entry and isinstance(entry[0], list | tuple):
            entry = entry[0]
        if not entry:
            return None
        return str(text(entry[0]))

    def _wait_replicas(self) -> Operation[int]:
        """How many replicas acknowledged everything this lock's master did so far (waits up to
        renew_interval)."""
        k = self.keys
        timeout_ms = max(1, round(self.renew_interval * 1000))
        reply = yield WaitReplicas(
            k.owners, self.owner, json.dumps(self.identity), self.replicas, timeout_ms
        )
        return int(reply[-1])

    def _confirm_grant(self, permit: Permit) -> Operation[None]:
        """With ``replicas``: the grant is on that many replicas, or it is given back and
        NotReplicated raised.

        The permit is not in ``held`` yet, so it stays under its wait's consumer: if this is
        cancelled, abandoning that consumer frees exactly this grant.
        """
        acked, error = -1, None
        try:
            acked = yield from self._wait_replicas()
        except redis.exceptions.RedisError as exc:
            error = exc
        except BaseException:
            self._abandon(permit.consumer)
            raise
        if acked >= self.replicas:
            return
        try:
            yield from self.release(permit, confirm=False)
        except BaseException as exc:
            self._abandon(permit.consumer)
            if not isinstance(exc, redis.exceptions.RedisError):
                raise
        seen = f"{type(error).__name__}: {error}" if error else f"{acked} acknowledged"
        raise NotReplicated(
            f"lock {self.name!r}: grant {permit.grant} not acknowledged by {self.replicas} "
            f"replica(s) ({seen}); "
            "given back"
        ) from error

    def release(self, permit: Permit, confirm: bool = True) -> Operation[bool]:
        """True if the permit was held and is now given back; False for a stale permit."""
        if not isinstance(permit, Permit):
            raise InvalidArgument(f"permit must be a Permit, got {permit!r}")
        usable = permit.owner == self.owner and permit.usable(self.clock())
        permit.released = permit.holds <= 1
        reply = yield self._script(
            "release",
            (self.keys.slots, self.keys.holds, self.keys.meta),
            permit.owner,
            permit.grant,
            "1" if self.reentrant else "0",
        )
        result = int(reply)
        if result == 2:
            permit.holds -= 1
            return True
        if result == 3:
            result = 0
            if usable and permit.released:
                # Within its lease, and Redis forgot it in a restart: a renewal re-adopts a reserved
                # slot for it and, as it was released meanwhile, gives that straight back: the slot
                # need not wait out the reservation.
                yield from self.maintain([permit])
        self._forget(permit)
        if permit.owner == self.owner:
            self._idle(permit.consumer)  # its one grant is gone: the consumer holds nothing now
            permit.consumer = self.owner
        if result == 0:
            permit.lost = True
        if result == 1 and confirm and self.replicas:
            acked = yield from self._wait_replicas()
            if acked < self.replicas:
                raise NotReplicated(
                    f"lock {self.name!r}: release of {permit.grant} done, but acknowledged by "
                    f"{acked} of "
                    f"{self.replicas} replica(s): a failover before they have it brings the slot "
                    "back held for a lease"
                )
        return result == 1

    def _forget(self, permit: Permit) -> None:
        self.held.pop(permit.grant, None)
        for holder, held in list(self.by_holder.items()):
            if held is permit:
                del self.by_holder[holder]

    def maintain(self, permits: list[Permit] | None = None) -> Operation[list[Permit]]:
        """Renew exactly ``permits`` (default: all held), free abandoned waits' grants, reap expired
        leases.

        Returns the permits found lost. A permit released while this ran is never reported lost, and
        a limbo slot adopted for it after a data loss is given back at once.
        """
        targets = list(self.held.values()) if permits is None else list(permits)
        abandoned = list(self.abandoned)
        k = self.keys
        sent_at = self.clock()
        try:
            reply = yield self._script(
                "maintain",
                (k.slots, k.meta, k.owners, k.holds, k.ttls, k.seen),
                self.owner,
                json.dumps(self.identity),
                self.ttl_ms,
                max(1, round(self.renew_interval * 1000)),
                self._durable_flag,
                len(abandoned),
                *abandoned,
                *[p.grant if p.valid_until > sent_at else f"!{p.grant}" for p in targets],
            )
        except redis.exceptions.ResponseError as exc:
            if not is_missing_lock(exc):
                raise
            # Redis lost the lock (restart without persistence, or a reset): recreate it with every
            # slot reserved for one lease if this object ever saw it (survivors re-adopt their
            # grants), then renew again.
            self.set_up = False
            yield from self._ensure_setup()
            return (yield from self.maintain(permits))
        self.registered_at = self.clock()
        self.set_up = self.ever_set_up = True  # maintain registers this owner as setup does
        for consumer in abandoned:
            left = self.abandoned.get(consumer, 0) - 1
            if left > 0:
                self.abandoned[consumer] = left
            else:
                self.abandoned.pop(consumer, None)
        lost_ids, _limit, lease_ms, _freed, adopted = text(reply)
        self.ttl = int(lease_ms) / 1000
        by_grant = {p.grant: p for p in targets}
        renamed = dict(zip(adopted[::2], adopted[1::2], strict=True))
        lost_set = set(lost_ids)
        # Renewed permits now sit under the consumer named like the owner: their wait consumers are
        # free again.
        for permit in targets:
            if permit.grant not in lost_set and permit.owner == self.owner:
                self._leased(permit, sent_at)
                if permit.grant not in renamed:
                    self._idle(permit.consumer)
                    permit.consumer = self.owner
        # Apply the re-adoption map as a whole: old and new ids never meet half-renamed.
        moved = [(by_grant[old], new) for old, new in renamed.items()]
        for permit, _new in moved:
            if self.held.get(permit.grant) is permit:
                del self.held[permit.grant]
        orphans: list[str] = []
        for permit, new in moved:
            if permit.released or permit.lost:
                # released while the renewal ran: give the adopted slot straight back
                orphans.append(new)
                continue
            self._idle(permit.consumer)
            permit.grant, permit.fence, permit.consumer = new, fence_of(new), self.owner
            self.held[new] = permit
        for grant in orphans:
            yield self._script("release", (k.slots, k.holds, k.meta), self.owner, grant, "0")
        # A permit released meanwhile (by another thread or task) is not "lost".
        lost = [by_grant[g] for g in lost_ids if g in by_grant and not by_grant[g].released]
        for permit in lost:
            permit.lost = True
            self._forget(permit)
            if permit.owner == self.owner:
                self._idle(permit.consumer)
                permit.consumer = self.owner
        return lost

    def _leased(self, permit: Permit, since: float) -> None:
        """Redis (re)started the permit's lease no earlier than ``since``: it lasts at least a lease
        from then."""
        permit.leased_at = max(permit.leased_at, since)
        permit.valid_until = permit.leased_at + self.ttl

    def renew(self, permit: Permit) -> Operation[None]:
        """Extend one permit's lease; LockLost if it is gone. Other permits are not touched."""
        lost = yield from self.maintain([permit])
        if lost:
            raise LockLost(f"lock {self.name!r}: lease of permit {permit.token} is gone")
        return None

    def set_limit(self, limit: object) -> Operation[int | None]:
        """Change the cluster-wide limit live; returns the previous one (None if new)."""
        new = check_limit(limit)
        previous = yield from self.set_limit_op(new, recover=False)
        return previous

    def set_limit_op(self, new: int, recover: bool) -> Operation[int | None]:
        """Set the limit; a missing lock is created, with every slot reserved for one lease when
        ``recover``."""
        previous = yield self._script(
            "set_limit",
            (self.keys.slots, self.keys.meta),
            new,
            self.ttl_ms,
            "1" if recover else "0",
            self._durable_flag,
        )
        self.limit = new
        # it exists now: after a data loss this object recreates it in limbo
        self.ever_set_up = True
        previous = int(previous)
        return None if previous < 0 else previous

    def get_limit(self) -> Operation[int | None]:
        """The limit in Redis now (None if the lock does not exist there)."""
        value = yield Call(("HGET", self.keys.meta, "limit"))
        return None if value is None else int(text(value))

    def release_all(self) -> Operation[int]:
        """Free every grant of this owner (every consumer of it) and unregister it (on close)."""
        freed = yield from release_consumer(self.keys, self.owner)
        self._drop_all()
        return int(freed)

    def retire(self) -> Operation[tuple[int, bool]]:
        """Like :meth:`release_all`, and delete the lock from Redis when nobody else holds, waits or
        is registered.

        For locks made for keys met at run time (a domain): once idle they leave nothing in Redis. A
        later setup creates the lock anew (a fresh object: no recovery window, which is for data
        loss only). Returns (grants freed, whether the lock was deleted).
        """
        k = self.keys
        freed, deleted = yield RunScript(
            "retire",
            (k.slots, k.meta, k.owners, k.holds, k.ttls, k.seen),
            (self.owner, self._durable_flag),
        )
        self._drop_all()
        return int(freed), bool(int(deleted))

    def _drop_all(self) -> None:
        for permit in list(self.held.values()):
            permit.lost = True
        self.held.clear()
        self.by_holder.clear()
        self.idle_consumers.clear()
        self.abandoned.clear()
        self.set_up = False


# -- operator actions (the command line); they work on any lock, not on one lock object ------------


def release_consumer(keys: LockKeys, owner: str) -> Operation[int]:
    """Free every grant of one owner (all its consumers) and forget it: an operator freeing a dead
    worker."""
    freed = yield RunScript(
        "release_owner",
        (keys.slots, keys.meta, keys.owners, keys.holds, keys.ttls, keys.seen),
        (owner,),
    )
    return int(freed)


def reset_lock(keys: LockKeys) -> Operation[tuple[int, int]]:
    """Free every grant and forget every consumer; the limit stays. Returns (grants freed,
    limit)."""
    freed, limit = yield RunScript(
        "reset", (keys.slots, keys.meta, keys.owners, keys.holds, keys.ttls, keys.seen), ()
    )
    return int(freed), int(limit)


def owner_of(consumer: str) -> str:
    """The owner of a consumer name: ``<owner>#<n>`` (one wait's consumer) -> ``<owner>``."""
    head, sep, tail = consumer.rpartition("#")
    return head if sep and head and tail.isdigit() else consumer
