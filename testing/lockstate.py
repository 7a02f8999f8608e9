"""What tests, benchmarks and the demo see of Redis, and do to it, from outside the crawl's objects.

A lock: an operator's release, its keys, forced lease ages. A crawl: the slots held of given locks
(or of every lock) and their holders, and what a finished crawl left behind, for the request front
(StageLockMiddleware over scrapy-redis's queue) and for the worker front (StageWorkerMixin's stage
queues). Every key comes from the package's key classes (:class:`LockKeys`, :class:`QueueKeys`), or
from scrapy-redis's own key templates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import redis
from scrapy_redis import defaults as scrapy_redis_defaults

from scrapy_redislock._redis import RedisClient, text
from scrapy_redislock.lock.base import CommandRunner
from scrapy_redislock.lock.core import release_consumer
from scrapy_redislock.lock.permit import GROUP, LockKeys, group_prefix
from scrapy_redislock.lock.protocol import drive
from scrapy_redislock.lock.status import grouped_keys
from scrapy_redislock.workers.queue import QueueKeys
from scrapy_redislock.workers.status import WORKER_LOCK_PREFIX

# A hand-off "at once" reaches the waiter within this many seconds: no polling interval (the lock's
# loops run every ttl/3, 10 s for the tests' 30 s leases), but room for a busy machine to schedule
# the waiter late.
AT_ONCE = 0.5


def queued(client: RedisClient, keys: QueueKeys, stage: str) -> int:
    """Requests waiting in a stage's queue, both parts (list and sorted set): LLEN and ZCARD."""
    with client.pipeline(transaction=False) as pipe:
        pipe.llen(keys.queue(stage))
        pipe.zcard(keys.scored(stage))
        listed, scored = pipe.execute()
    return int(listed) + int(scored)


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
        str(text(e["message_id"])) for e in client.xpending_range(keys.slots, GROUP, "-", "+", 100)
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


# -- a crawl's state ------------------------------------------------------------------------------


def requests_key(spider: str) -> str:
    """scrapy-redis's request queue of a spider (its SCHEDULER_QUEUE_KEY default)."""
    return str(scrapy_redis_defaults.SCHEDULER_QUEUE_KEY % {"spider": spider})


def start_urls_key(spider: str) -> str:
    """A RedisSpider's start-URL feed (scrapy-redis's START_URLS_KEY default)."""
    return str(scrapy_redis_defaults.START_URLS_KEY % {"name": spider})


def worker_lock(stage: str) -> str:
    """The name of the lock that caps StageWorkerMixin's workers on a stage."""
    return f"{WORKER_LOCK_PREFIX}{stage}"


def locks_in(client: RedisClient, prefix: str) -> list[str]:
    """Every lock under ``prefix`` with its slots stream in Redis (one SCAN, as ``status`` finds
    them)."""
    found = grouped_keys(client, prefix, ":slots")
    return sorted(tag for group, tag in found if not group)  # the locks of no group (0.x keys)


def held_slots(
    client: RedisClient, prefix: str = "redislock", locks: Iterable[str] | None = None
) -> int:
    """Grants Redis counts as held (the holders' pending entries) over ``locks``, every lock under
    the prefix if None; a lock that is not in Redis holds none."""
    held = 0
    # every lock of every cap group (REDISLOCK_GROUP), or the named ones of no group
    places = (
        sorted(grouped_keys(client, prefix, ":slots"))
        if locks is None
        else [("", name) for name in locks]
    )
    for group, name in places:
        slots = LockKeys.of(group_prefix(prefix, group), name).slots
        with contextlib.suppress(redis.ResponseError):  # no stream, or no group: nothing held
            held += int(client.xpending(slots, GROUP)["pending"])
    return held


def slot_holders(client: RedisClient, prefix: str, lock: str) -> list[str]:
    """The consumers holding a slot of ``lock``, one per grant (none when the lock is not in
    Redis)."""
    try:
        pending = client.xpending_range(LockKeys.of(prefix, lock).slots, GROUP, "-", "+", 1000)
    except redis.ResponseError:
        return []
    return [str(text(entry["consumer"])) for entry in pending]


def request_leftovers(
    client: RedisClient, prefix: str, spider: str, locks: Iterable[str]
) -> dict[str, int]:
    """What a finished request-front crawl left in Redis: slots held of ``locks`` and requests
    queued in scrapy-redis's queue; plain scrapy-redis (no ``locks``): only the queue."""
    locks = list(locks)
    queued_requests = int(client.llen(requests_key(spider)))
    if not locks:
        return {"queued": queued_requests}
    return {"held slots": held_slots(client, prefix, locks), "queued": queued_requests}


def worker_leftovers(
    client: RedisClient, prefix: str, spider: str, stages: Iterable[str]
) -> dict[str, int]:
    """What a finished worker-front crawl left in Redis: worker slots held, requests queued (both
    parts of each stage queue) and in flight (every worker's record, registered or not), and
    workers still registered."""
    stages = list(stages)
    keys = QueueKeys.of(prefix, spider)
    return {
        "held slots": held_slots(client, prefix, [worker_lock(stage) for stage in stages]),
        "queued": sum(queued(client, keys, stage) for stage in stages),
        "in flight": sum(int(client.hlen(key)) for key in client.scan_iter(keys.inflight("*"))),
        "workers": int(client.zcard(keys.alive)),
    }
