"""Sans-IO core of the counting lock: what to send to Redis and what the replies mean.

Every lock operation is a generator that yields commands
(:class:`~scrapy_redislock.lock.protocol.RunScript`,
:class:`~scrapy_redislock.lock.protocol.ReadGrant`) and receives their replies, or has the redis
error thrown in. The blocking and asyncio locks (``sync.py``, ``aio.py``) only carry commands to
Redis, so the lock's logic exists once. An acquire's wait is :mod:`.wait`, a renewal pass
:mod:`.renewal`, the consumer names of waits :mod:`.consumers`, the data :mod:`.permit`. This
module does no I/O and imports neither Scrapy nor Twisted.

How the lock sits in Redis (see ``scripts/_lib.lua``): a stream whose entries are
slot grants and one consumer group. A free slot is an entry not yet delivered;
waiters block in ``XREADGROUP ... BLOCK``, which Redis serves first come, first
served, and a release adds a new entry, which Redis hands to the first blocked
waiter at once. A held slot is an entry in the group's pending list: the owner is
its consumer, the lease age its idle time on Redis's clock. The entry's sequence
number is the fencing token.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import redis.exceptions

from scrapy_redislock._redis import (
    FLAGS_LINE,
    check_flag,
    check_limit,
    check_name,
    check_timeout,
    check_ttl,
    load_scripts,
    text,
)
from scrapy_redislock.errors import (
    InvalidArgument,
    LockError,
    LockLost,
)
from scrapy_redislock.lock.consumers import Consumers, Registration
from scrapy_redislock.lock.light import LightGrants
from scrapy_redislock.lock.permit import LockKeys, Permit, default_identity
from scrapy_redislock.lock.protocol import (
    Call,
    MayEvict,
    Operation,
    RunScript,
    WaitReplicas,
    is_missing_lock,
)
from scrapy_redislock.lock.release import release_grant
from scrapy_redislock.lock.renewal import Renewal
from scrapy_redislock.lock.wait import GrantWait

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
    "start",
    "late_start",
    "rate",
    "rate_late",
    "pause",
    "adapt_unpin",
    "light_take",
    "light_release",
    "light_renew",
    "adapt_report",
    "adapt_commit",
)


# Scripts that only renew or give back: they run even while Redis is out of memory (Redis 7+'s
# ``allow-oom`` flag; they free memory or rewrite what is there), so that a full Redis refuses new
# grants but never strands a slot or lets a held lease run out.
ALLOW_OOM = frozenset(
    ("maintain", "release", "hold_again", "light_renew", "light_release", "release_owner", "retire")
)


@functools.cache
def lock_scripts() -> dict[str, str]:
    """The lock's Lua sources by name, each with ``scripts/_lib.lua`` in front of it (and the
    ``allow-oom`` flag before that for :data:`ALLOW_OOM`'s)."""
    sources = load_scripts("scrapy_redislock.lock", SCRIPT_NAMES, "_lib")
    return {
        name: (f"{FLAGS_LINE}allow-oom\n" if name in ALLOW_OOM else "") + source
        for name, source in sources.items()
    }


Clock = Callable[[], float]


@dataclass
class LockCore:
    """State and logic of one lock object; the lock classes drive its generator methods.

    What it promises (the scripts keep it): a grant is freed only by its holder's release, by the
    reaper once its lease (the longest ttl of the live owners) expired, by an operator, because
    the wait it was delivered to was abandoned (that wait's consumer name is never reused), or
    because nobody confirmed it within a renewal interval of its delivery to a blocked wait (the
    wait confirms it at once: :mod:`.wait`) -- never because a renewal did not list it.
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
    # Redis loses no acknowledged write: a restart keeps the lock (no one-lease reservation)
    durable: bool = False
    # grants are light (lock/light.py) while nobody waits: a lock made for a key met at run time
    light: bool = False
    # 8 random hex digits, as uuid4().hex[:8] gave, without building a UUID (a lock per key met)
    owner: str = field(
        default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"
    )
    held: dict[str, Permit] = field(default_factory=dict)
    by_holder: dict[Any, Permit] = field(default_factory=dict)
    registration: Registration = field(default_factory=Registration)
    # a light lock takes light grants only once the server is known not to evict keys (MayEvict):
    # a light grant's zset expires, and an evicted one is a slot given twice
    light_path: bool | None = None
    waits_in_flight: int = 0
    # the limit in Redis as the last renewal's reply said it (maintain.lua returns it): what a
    # caller reads to learn of another process's or an operator's change, at no command of its own
    reported_limit: int | None = None
    consumers: Consumers = field(init=False)
    # light grants made by this object (their tokens: lock/light.py)
    light_grants_made: int = 0

    def __post_init__(self) -> None:
        self.consumers = Consumers(self.owner)

    @property
    def lights(self) -> LightGrants:
        """The light path's operations on this lock: a view made per use, never kept, so that the
        lock holds no reference back to itself and its refcount frees it (a lock per key met: kept
        in a cycle, each would wait for the garbage collector's oldest generation)."""
        return LightGrants(self)

    def rename(self, owner: str) -> None:
        """Take this owner name (before any wait): the quorum lock uses one name on every master."""
        self.owner = owner
        self.consumers = Consumers(owner)

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
        light: bool = False,
    ) -> LockCore:
        name = check_name(name)
        prefix = check_name(key_prefix, "key_prefix")
        checked_limit = None if limit is None else check_limit(limit)
        checked_ttl = check_ttl(ttl)
        if reentrant and checked_limit != 1:
            raise InvalidArgument(f"reentrant=True needs limit=1 (a mutex), got limit={limit!r}")
        if check_flag(light, "light") and (reentrant or replicas):
            raise InvalidArgument(
                f"light=True is for locks met at run time: neither reentrant nor replicas (got reentrant={reentrant!r}, replicas={replicas!r})"  # noqa: E501
            )
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
            light=light,
        )

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
        return bool(self.held or self.waits_in_flight or self.consumers.abandoned)

    def _script(self, name: str, keys: tuple[str, ...], *args: str | int) -> RunScript:
        return RunScript(name, keys, args)

    @property
    def durable_flag(self) -> str:
        return "1" if self.durable else "0"

    @property
    def stream_grants(self) -> set[str]:
        """The grants this owner holds in the stream: what it re-adopts after a data loss (a light
        grant starts afresh, see :mod:`.light`)."""
        # a copy first: the blocking lock's renewal thread may change ``held`` meanwhile
        return {grant for grant, permit in list(self.held.items()) if not permit.light}

    def setup(self, recover: bool = False) -> Operation[tuple[bool, int]]:
        """Create the lock in Redis if needed and register this owner."""
        k = self.keys
        survivors = (
            self.registration.survivors(self.owner, self.clock(), self.ttl) if recover else None
        )
        reply = yield self._script(
            "setup",
            (k.slots, k.meta, k.owners, k.ttls, k.seen, *self._light_keys),
            "" if self.limit is None else self.limit,
            self.ttl_ms,
            self.owner,
            json.dumps(self.identity),
            "1" if recover else "0",
            self.durable_flag,
            # one that holds grants is a survivor only once a renewal of all of them re-adopted them
            "0" if self.stream_grants else "1",
            *(("0",) if survivors is None else ("1", *survivors)),
        )
        created, limit, lease_ms = text(reply)
        self.registration.done(self.clock())
        self.ttl = int(lease_ms) / 1000
        if self.limit is None:
            self.limit = int(limit)  # what to recreate the lock with if Redis loses it
        return bool(created), int(limit)

    @property
    def _light_keys(self) -> tuple[str, ...]:
        """The light path's keys, for the scripts that escalate it or end it (none without)."""
        return (self.keys.light, self.keys.migrated) if self.light else ()

    def ensure_setup(self) -> Operation[None]:
        """Set up (again after a quiet spell: the owner may have been forgotten, and its ttl with
        it).

        An object that has seen the lock before recreates a missing one in limbo: it can only be
        missing because Redis lost it, and survivors must get their slots back before anybody new.
        """
        if self.registration.due(self.clock(), self.configured_ttl):
            try:
                yield from self.setup(recover=self.registration.ever)
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
            # The hold count is this process's (it follows the permit through a re-adoption after a
            # restart); Redis is asked only whether the grant is still held, and renews it.
            held = yield self._script("hold_again", (self.keys.slots,), self.owner, permit.grant)
            if int(held):
                permit.holds += 1
                self.consumers.free(permit.consumer)
                permit.consumer = self.owner
                return permit
            self.let_go(permit)
        if self.light and self.light_path is None:
            self.light_path = not (yield MayEvict())
        if self.light_path and not self.registration.current:
            done, taken = yield from self.lights.acquire(self.limit, blocking)
            if done:
                return taken
        yield from self.ensure_setup()
        granted = yield from GrantWait(self, timeout, blocking).run()
        if granted is not None:
            self.held[granted.grant] = granted
            if self.reentrant and holder is not None:
                self.by_holder[holder] = granted
        return granted

    def take_script(self, consumer: str) -> RunScript:
        """The ``take`` script: one look for a free slot, without blocking."""
        k = self.keys
        interval_ms = max(1, round(self.renew_interval * 1000))
        return self._script("take", (k.slots, k.meta), consumer, interval_ms, self.durable_flag)

    def wait_replicas(self) -> Operation[int]:
        """How many replicas acknowledged everything this lock's master did so far (waits up to
        renew_interval)."""
        k = self.keys
        timeout_ms = max(1, round(self.renew_interval * 1000))
        reply = yield WaitReplicas(
            k.owners, self.owner, json.dumps(self.identity), self.replicas, timeout_ms
        )
        return int(reply[-1])

    def release(self, permit: Permit, confirm: bool = True) -> Operation[bool]:
        """True if the permit was held and is now given back; False for a stale permit."""
        if not isinstance(permit, Permit):
            raise InvalidArgument(f"permit must be a Permit, got {permit!r}")
        if permit.light:
            return (yield from self.lights.give_back(permit))
        return (yield from release_grant(self, permit, confirm))

    def let_go(self, permit: Permit) -> None:
        """The permit's grant is gone (released or lost): forget it; its consumer holds nothing."""
        self.held.pop(permit.grant, None)
        if self.by_holder:  # a reentrant lock's (no new dict per release of any other)
            self.by_holder = {h: held for h, held in self.by_holder.items() if held is not permit}
        if permit.owner == self.owner:
            self.consumers.free(permit.consumer)
            permit.consumer = self.owner

    def maintain(self, permits: list[Permit] | None = None) -> Operation[list[Permit]]:
        """Renew exactly ``permits`` (default: all held), free abandoned waits' grants, reap expired
        leases; returns the permits found lost (see
        :class:`~scrapy_redislock.lock.renewal.Renewal`)."""
        if self.light:
            return (yield from self.lights.maintain(permits))
        return (yield from Renewal(self, permits).run())

    def renew(self, permit: Permit) -> Operation[None]:
        """Extend one permit's lease; LockLost if it is gone. Other permits are not touched."""
        lost = yield from self.maintain([permit])
        if lost:
            raise LockLost(f"lock {self.name!r}: lease of permit {permit.token} is gone")
        return None

    def set_limit(
        self, limit: object, recover: bool = False, pin: bool = False
    ) -> Operation[int | None]:
        """Change the cluster-wide limit live; returns the previous one (None if new). A missing
        lock is created, with every slot reserved for one lease when ``recover``. ``pin``: an
        operator's word, which an adaptive controller follows until it is unpinned."""
        new = check_limit(limit)
        previous = yield self._script(
            "set_limit",
            (self.keys.slots, self.keys.meta, self.keys.adapt, *self._light_keys[:1]),
            new,
            self.ttl_ms,
            "1" if recover else "0",
            self.durable_flag,
            "1" if pin else "0",
        )
        self.limit = new
        # it exists now: after a data loss this object recreates it in limbo
        self.registration.ever = True
        return None if int(previous) < 0 else int(previous)

    def get_limit(self) -> Operation[int | None]:
        """The limit in Redis now (None if the lock does not exist there)."""
        value = yield Call(("HGET", self.keys.meta, "limit"))
        return None if value is None else int(text(value))

    def release_all(self) -> Operation[int]:
        """Free every grant of this owner (every consumer of it) and unregister it (on close)."""
        freed = yield from self.lights.release_held()
        if not self.light or self.registration.ever:
            freed += yield from release_consumer(self.keys, self.owner)
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
        freed = yield from self.lights.release_held()
        deleted = 0
        if not self.light or self.registration.ever:
            stream_freed, deleted = yield RunScript(
                "retire",
                (k.slots, k.meta, k.owners, k.ttls, k.seen, *self._light_keys),
                (self.owner, self.durable_flag),
            )
            freed += int(stream_freed)
        self._drop_all()
        return int(freed), bool(int(deleted))

    def _drop_all(self) -> None:
        for permit in list(self.held.values()):
            permit.lost = True
        self.held.clear()
        self.by_holder.clear()
        self.consumers.clear()
        self.registration.current = False


# -- operator actions (the command line); they work on any lock, not on one lock object ------------


def release_consumer(keys: LockKeys, owner: str, light: bool = False) -> Operation[int]:
    """Free every grant of one owner (all its consumers; its light grants too with ``light``) and
    forget it: an operator freeing a dead worker."""
    freed = yield RunScript(
        "release_owner",
        (keys.slots, keys.meta, keys.owners, keys.ttls, keys.seen)
        + ((keys.light,) if light else ()),
        (owner,),
    )
    return int(freed)


def forget_lock(keys: LockKeys, light: bool = False) -> Operation[bool]:
    """Delete a lock from Redis when nobody holds, waits or is registered (``retire.lua`` for no
    owner of its own; its light path too with ``light``): an operator's ``forget``. Returns whether
    it was deleted."""
    _freed, deleted = yield RunScript(
        "retire",
        (keys.slots, keys.meta, keys.owners, keys.ttls, keys.seen)
        + ((keys.light, keys.migrated) if light else ()),
        ("", "0"),
    )
    return bool(int(deleted))


# reset_lock's limit when the one in Redis is no valid limit (written by hand?): no slot was added
NO_VALID_LIMIT = -2


def reset_lock(keys: LockKeys, light: bool = False) -> Operation[tuple[int, int | None]]:
    """Free every grant (the light ones too with ``light``) and forget every consumer; the limit
    stays. Returns (grants freed, limit; None for a light-path lock with no limit in Redis,
    NO_VALID_LIMIT when the limit in Redis is not one: set_limit repairs it)."""
    freed, limit = yield RunScript(
        "reset",
        (keys.slots, keys.meta, keys.owners, keys.ttls, keys.seen)
        + ((keys.light,) if light else ()),
        (),
    )
    limit = int(limit)
    return int(freed), None if limit == -1 else limit
