"""What a crawl process writes of its stages' limits when it starts, what it says about them, and how
it hears of a change made later.

Each capped stage's limit is written to Redis (the newest process's settings win; a change is logged
at WARNING, and every other process of the stage's group logs it too when its next renewal reports
the new limit: the lock's ``reported_limit``, read by ``StageLocks`` after each renewal); an
adaptive stage (REDISLOCK_ADAPTIVE) is only created, at the minimum, when its lock is not in Redis
yet: its controller moves the limit from there, and a process starting must not write its ceiling
over it. A stage unlimited in this process but capped in Redis by others is said at WARNING: their
cap does not hold for this process. Reads no settings itself."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from scrapy_redislock._redis import AsyncRedisClient, text
from scrapy_redislock.crawl.reach import first_answer, no_quorum
from scrapy_redislock.errors import QuorumNotReached
from scrapy_redislock.lock.interface import AsyncLock
from scrapy_redislock.lock.permit import LockKeys

if TYPE_CHECKING:
    from scrapy_redislock.crawl.settings import RedisLockSettings


class Locks(Protocol):
    """What this needs of a crawler's StageLocks (seen through this, so imports run one way)."""

    settings: RedisLockSettings
    limits: dict[str, int | None]
    lock_prefix: str
    key_prefix: str
    group: str
    limits_known: dict[str, int]

    @property
    def locks(self) -> Mapping[str, AsyncLock[Any]]: ...

    @property
    def clients(self) -> list[AsyncRedisClient]: ...


logger = logging.getLogger("scrapy_redislock.crawl.stagelocks")


def _hget_limit(client: AsyncRedisClient, meta: str) -> Awaitable[Any]:
    return client.hget(meta, "limit")


async def publish_limits(locks: Locks) -> None:
    """Write this process's limits (see the module docstring); redis errors when Redis cannot be
    reached, a ConfigError naming the masters when a quorum does not answer."""
    settings = locks.settings
    for stage, lock in locks.locks.items():
        limit = locks.limits[stage]
        assert limit is not None
        if settings.adaptive.adapts(stage=stage):
            if await lock.get_limit() is None:
                await lock.set_limit(min(limit, settings.adaptive.adaptive_min))
            continue
        try:
            previous = await lock.set_limit(limit)
        except QuorumNotReached as exc:
            raise no_quorum(settings.redis.masters, exc.failed, exc.needed) from None
        locks.limits_known[stage] = limit
        if previous is not None and previous != limit:
            logger.warning(
                "Limit of stage %r changed from %s to %s in Redis (group %r; the newest process's settings win; the other processes of the group log it at their next renewal)",  # noqa: E501
                f"{locks.lock_prefix}{stage}",
                previous,
                limit,
                locks.group,
            )
    for stage in sorted(set(locks.limits) - set(locks.locks)):
        meta = LockKeys.of(locks.key_prefix, f"{locks.lock_prefix}{stage}").meta
        other = await first_answer(locks.clients, functools.partial(_hget_limit, meta=meta))
        if other is not None:
            logger.warning(
                "Stage %r is unlimited in this process but capped at %s in Redis by other processes",
                stage,
                text(other),
            )
