"""What tests do to a lock from outside its objects: an operator's release, the lock's keys, forced
lease ages."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import redis

from scrapy_redislock.lock.core import release_consumer
from scrapy_redislock.lock.front import CommandRunner
from scrapy_redislock.lock.permit import GROUP, LockKeys
from scrapy_redislock.lock.protocol import drive

# A hand-off "at once" reaches the waiter within this many seconds: no polling interval (the lock's
# loops run every ttl/3, 10 s for the tests' 30 s leases), but room for a busy machine to schedule
# the waiter late.
AT_ONCE = 0.5


def operator_release(client: redis.Redis, keys: LockKeys, owner: str) -> int:
    """Free every slot of an owner, as ``release STAGE HOLDER`` does (release_owner.lua)."""
    return int(drive(release_consumer(keys, owner), CommandRunner(client), "operator"))


def all_keys(keys: LockKeys) -> list[str]:
    """Every Redis key of one lock."""
    return list(dataclasses.astuple(keys))


def age_grant(client: redis.Redis, keys: LockKeys, grant: str, idle_ms: int) -> None:
    """Make a grant's lease ``idle_ms`` old on Redis's clock (the clock the lock reads), under its
    own consumer."""
    entry = _pending(client, keys, grant)
    assert entry, f"grant {grant} is not held"
    client.xclaim(keys.slots, GROUP, entry["consumer"], 0, [grant], idle=idle_ms, justid=True)


def pending_grants(client: redis.Redis, keys: LockKeys) -> list[str]:
    """The grants Redis counts as held, oldest first."""
    return [
        str(e["message_id"].decode())
        for e in client.xpending_range(keys.slots, GROUP, "-", "+", 100)
    ]


def lease_age_ms(client: redis.Redis, keys: LockKeys, grant: str) -> int:
    """How old a grant's lease is on Redis's clock (0 if it is not held)."""
    entry = _pending(client, keys, grant)
    return int(entry["time_since_delivered"]) if entry else 0


def _pending(client: redis.Redis, keys: LockKeys, grant: str) -> dict[str, Any] | None:
    """Redis's pending-entry record of one grant (its consumer, its lease age), None if it is not
    held."""
    entries = client.xpending_range(keys.slots, GROUP, grant, grant, 1)
    return entries[0] if entries else None


def after_a_renewal(client: redis.Redis, keys: LockKeys, grant: str) -> None:
    """Return right after the grant's holder renewed it (its lease age on Redis's clock dropped)."""
    last = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        age = lease_age_ms(client, keys, grant)
        if last is not None and age < last:
            return
        last = age
        time.sleep(0.002)
    raise AssertionError(f"no renewal of grant {grant} seen")
