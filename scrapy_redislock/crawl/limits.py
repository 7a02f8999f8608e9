"""What a crawl process writes of its stages' limits when it starts, what it says about them, and how
it hears of a change made later.

Each capped stage's limit is written to Redis (the newest process's settings win; a change is
logged at WARNING, and every other process of the stage's group logs it too when its next renewal
reports the new limit: :class:`LimitWatch`); an adaptive stage (REDISLOCK_ADAPTIVE) is only
created, at the minimum, when its lock is not in Redis yet: its controller moves the limit from
there, and a process starting must not write its ceiling over it. A stage unlimited in this
process but capped in Redis by others is said at WARNING: their cap does not hold for this
process. Reads no settings itself.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from scrapy_redislock._redis import AsyncRedisClient, text
from scrapy_redislock.crawl.reach import first_answer, no_quorum
from scrapy_redislock.errors import QuorumNotReached
from scrapy_redislock.lock.interface import AsyncLock
from scrapy_redislock.lock.permit import LockKeys
from scrapy_redislock.lock.protocol import Command, RunScript

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


class LimitWatch:
    """Wraps a lock's command runner: passes every command on unchanged, and hands the limit in each
    reply of the ``maintain`` script (``{lost, limit, lease, freed, adopted}``) to ``seen``: a
    renewal tells every process of the lock's limit at no cost in Redis commands. A reply it cannot
    read is passed on as it is."""

    def __init__(self, runner: Callable[[Command], Any], seen: Callable[[int], None]) -> None:
        self.runner = runner
        self.seen = seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def __call__(self, command: Command) -> Any:
        result = self.runner(command)
        if isinstance(command, RunScript) and command.name == "maintain":
            return self._watch(result)
        return result

    async def _watch(self, result: Awaitable[Any]) -> Any:
        reply = await result
        try:
            limit = int(reply[1])
        except (TypeError, ValueError, IndexError, KeyError):
            return reply
        self.seen(limit)
        return reply


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
                await lock.set_limit(min(limit, settings.adaptive.minimum))
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
