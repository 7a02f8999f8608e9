"""What a lock is in Redis and what holding it means: its keys, a granted slot, and the names in
its consumer group.

Data only; the logic that hands out and renews slots is :mod:`scrapy_redislock.lock.core`.
"""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import dataclass, fields
from typing import Any

GROUP = "holders"
LIMBO = "__limbo__"


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
    # granted on the light path (lock/light.py): ``grant`` is ``L<n>``, the fence 0, until a renewal
    # finds it moved into the stream
    light: bool = False

    def leased(self, since: float, ttl: float) -> None:
        """Redis (re)started the lease no earlier than ``since``: it lasts at least ``ttl`` from
        then."""
        self.leased_at = max(self.leased_at, since)
        self.valid_until = self.leased_at + ttl

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
    ttls: str
    seen: str
    gate: str  # the delay gate of the stage or key (lock/delay.py): a string, only while a start is booked
    started: str  # the next free confirmed start of the stage or key (lock/delay.py), as the gate
    rate: str  # the starts of a scope's last rate window (lock/delay.py): a zset, expires when idle
    light: str  # grants of the light path (lock/light.py): a zset, only while the lock is in use
    migrated: str  # light grants moved into the stream when the lock escalated: token -> grant id
    adapt: str  # the adaptive limit's controller (lock/adaptive.py): a hash, while reports come
    adapt_log: str  # its history: a list of one record per window, newest first, bounded

    @classmethod
    def of(cls, prefix: str, name: str) -> LockKeys:
        """The keys of lock ``name``: ``<prefix>:{<name>}:<field name>``; ``prefix`` is a
        :func:`group_prefix` for the locks of a cap group."""
        base = f"{prefix}:{{{name}}}"
        return cls(*[f"{base}:{part}" for part in _PARTS])  # a list: no generator step per key


def group_prefix(prefix: str, group: str) -> str:
    """The prefix of a cap group's locks (REDISLOCK_GROUP): ``<prefix>:<group>``, so that its keys
    are ``<prefix>:<group>:{<lock>}:...``; ``group`` empty: ``<prefix>`` itself, the key names of
    0.x, shared by every spider that names no group."""
    return f"{prefix}:{group}" if group else prefix


def split_group(prefix: str, key: str) -> tuple[str, str, str] | None:
    """``(group, tag, rest)`` of a key ``<prefix>:[<group>:]{<tag>}<rest>`` (group "" for the 0.x
    names without one); None for a key of another shape."""
    head = f"{prefix}:"
    if not key.startswith(head):
        return None
    middle, brace, tagged = key[len(head) :].partition("{")
    tag, closing, rest = tagged.partition("}")
    if not brace or not closing or not tag or "{" in tag:
        return None
    if middle and (middle == ":" or not middle.endswith(":")):
        return None
    return middle[:-1], tag, rest


# LockKeys' field names, which are the keys' suffixes (read once: fields() is slow, and a key met
# at run time makes its LockKeys per use)
_PARTS = tuple(part.name for part in fields(LockKeys))


def fence_of(grant: str) -> int:
    return int(grant.rsplit("-", 1)[1])


def default_identity() -> dict[str, Any]:
    """What status shows about a holder; nothing in it is secret."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": round(time.time(), 3)}


def owner_of(consumer: str) -> str:
    """The owner of a consumer name: ``<owner>#<n>`` (one wait's consumer) -> ``<owner>``."""
    head, sep, tail = consumer.rpartition("#")
    return head if sep and head and tail.isdigit() else consumer
