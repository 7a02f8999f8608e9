"""Where a crawl's stage locks live: one Redis (a server, Sentinel or Cluster), or a quorum of
independent masters (REDISLOCK_URL as a list: the request front's quorum lock). The one difference
between the two, in one place: how a stage's lock is made, what "Redis answers" means at start, how
many masters a slot needs, and what closes. The keys' registry (:class:`~.keylocks.KeyLocks`) uses
the request stages' clients (:meth:`Shared.share`): one set of command clients per process for both.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import redis.asyncio

from scrapy_redislock._redis import AsyncRedisClient, is_default_user
from scrapy_redislock.crawl.connection import async_clients
from scrapy_redislock.crawl.reach import REFUSED, masters_said, no_quorum
from scrapy_redislock.errors import ConfigError
from scrapy_redislock.lock.aio import AsyncCountingLock
from scrapy_redislock.lock.base import eviction_policy
from scrapy_redislock.lock.core import lock_scripts
from scrapy_redislock.lock.interface import AsyncLock
from scrapy_redislock.lock.quorum import AsyncQuorumCountingLock, QuorumLockFactory

if TYPE_CHECKING:
    from typing import Self

    from scrapy_redislock.crawl.settings import RedisLockSettings
    from scrapy_redislock.lock.core import Clock

logger = logging.getLogger(__name__)

# The scripts a crawl process runs on its way to its first grant and release (its limits, its first
# renewal, a take while a slot may be free, else the guard before a wait and the confirmation of a
# grant handed to it, a release), loaded with the first PING (about 18 KB each).
START_SCRIPTS = ("set_limit", "maintain", "take", "guard", "hold_again", "release")


def _waiting_of(lock: AsyncLock[Any]) -> Any:
    """The client a lock's blocking waits go through (its own pool), or None."""
    return getattr(getattr(lock, "runner", None), "waiting", None)


async def check_eviction(client: AsyncRedisClient, settings: RedisLockSettings, where: str) -> None:
    """Refuse a Redis whose maxmemory-policy may evict keys (see :func:`judge_eviction`)."""
    try:
        info: Any = await client.info("memory")
    except redis.exceptions.ResponseError as exc:
        info = exc
    judge_eviction(info, settings, where)


def judge_eviction(info: Any, settings: RedisLockSettings, where: str) -> None:
    """ConfigError for an ``INFO memory`` reply whose maxmemory-policy may evict keys (a lock key
    evicted gives a slot twice) unless REDISLOCK_ALLOW_EVICTION; where INFO was refused (``info``
    the error: a managed Redis), say that noeviction was assumed. INFO, not CONFIG GET: the crawler
    ACL role reads INFO already, and CONFIG GET would show it every setting."""
    if isinstance(info, BaseException):
        logger.warning(
            "Could not read the maxmemory-policy of Redis at %s (%s): assumed noeviction, which the locks need (docs/failures.md)",  # noqa: E501
            where,
            info,
        )
        return
    policy = eviction_policy(info)
    if policy == "noeviction":
        return
    if settings.allow_eviction:
        logger.warning(
            "Redis at %s may evict keys (maxmemory-policy %s), accepted by REDISLOCK_ALLOW_EVICTION: an evicted lock key gives a slot twice",  # noqa: E501
            where,
            policy,
        )
        return
    raise ConfigError(
        f"Redis at {where} has maxmemory-policy {policy}, which may evict the locks' keys and give a slot twice: set maxmemory-policy noeviction, keep the locks on a Redis of their own (REDISLOCK_URL), or set REDISLOCK_ALLOW_EVICTION = True to accept it"  # noqa: E501
    )


class Shared:
    """The clients of a deployment, shared by the registries of one crawler (the request stages'
    and the keys', :meth:`share`): the last of them to close closes the clients."""

    def __init__(self) -> None:
        self.users = 1

    def share(self) -> Self:
        self.users += 1
        return self

    async def aclose(self) -> None:
        self.users -= 1
        if self.users == 0:
            await self._close()

    async def _close(self) -> None:
        raise NotImplementedError


class OneRedis(Shared):
    """Every lock on one Redis deployment, through one client; ``key_prefix``: the locks' (the cap
    group's, :func:`~scrapy_redislock.lock.permit.group_prefix`)."""

    def __init__(self, settings: RedisLockSettings, key_prefix: str) -> None:
        super().__init__()
        self.settings = settings
        self.key_prefix = key_prefix
        self.clients: list[AsyncRedisClient] = async_clients(
            settings.redis.url, settings.redis.url_setting, settings.redis.params
        )

    def make_lock(
        self, name: str, limit: int, identity: Mapping[str, Any], clock: Clock = time.monotonic
    ) -> AsyncLock[Any]:
        return AsyncCountingLock(
            self.clients[0],
            name,
            limit=limit,
            ttl=self.settings.ttl,
            key_prefix=self.key_prefix,
            identity=identity,
            durable=self.settings.durable,
            maintain_loop=False,  # the process's one Renewer maintains every lock
            clock=clock,  # the registry's: a permit's lease and the usable() check on one clock
        )

    async def reach(self, locks: Mapping[str, AsyncLock[Any]]) -> None:
        """PING; redis errors when Redis is unreachable; a ConfigError when it may evict keys.

        In the same round trip (one Redis, not a Cluster): its maxmemory-policy (INFO memory), and
        with capped stages, for Redis's default user, SCRIPT LOAD of the
        scripts on a process's way to its first grant (:data:`START_SCRIPTS`; on a Redis that does
        not have them yet each would cost a NOSCRIPT and a load, in turn, on that way; a load
        refused is left to that fallback), and the locks' waiting connections opened at once beside
        it, not at the first wait; with capped stages, a second connection of the client too (a
        PING), so that a stage's first take (a script) does not open one on its way while the
        start's report of why stages wait reads on the first."""
        client = self.clients[0]
        if isinstance(client, redis.asyncio.RedisCluster):
            # before concurrent first commands (see docs/failures.md, Redis Cluster)
            await client.initialize()
            await client.ping()
            await check_eviction(client, self.settings, self.settings.redis.safe_url)
            return
        pipe = client.pipeline(transaction=False)
        pipe.ping()
        pipe.info("memory")
        if locks and is_default_user(client):
            sources = lock_scripts()
            for name in START_SCRIPTS:
                pipe.script_load(sources[name])
        waiting = {id(w): w for lock in locks.values() if (w := _waiting_of(lock)) is not None}
        beside = [client, *waiting.values()] if locks else []
        replies, *_ = await asyncio.gather(
            pipe.execute(raise_on_error=False), *(c.ping() for c in beside)
        )
        if isinstance(replies[0], BaseException):
            raise replies[0]
        judge_eviction(replies[1], self.settings, self.settings.redis.safe_url)

    def needed(self, lock: AsyncLock[Any]) -> int:
        """Masters with a free slot that a grant needs."""
        return 1

    async def _close(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients), return_exceptions=True)


class QuorumOfMasters(Shared):
    """Each lock on a quorum of independent masters (one client per master, and one factory sharing
    the masters' waiting connections between the stages)."""

    def __init__(self, settings: RedisLockSettings, key_prefix: str) -> None:
        super().__init__()
        self.settings = settings
        self.key_prefix = key_prefix
        self.clients = async_clients(
            settings.redis.url,
            settings.redis.url_setting,
            settings.redis.params,
            settings.redis.masters,
        )
        self.factory = QuorumLockFactory(self.clients, asyncio=True)

    def make_lock(
        self, name: str, limit: int, identity: Mapping[str, Any], clock: Clock = time.monotonic
    ) -> AsyncLock[Any]:
        # The factory's masters are redis.asyncio clients: its locks are AsyncQuorumCountingLocks.
        return cast(
            AsyncQuorumCountingLock,
            self.factory.lock(
                name,
                limit,
                self.settings.ttl,
                key_prefix=self.key_prefix,
                quorum=self.settings.redis.quorum,
                identity=identity,
                clock=clock,
            ),
        )

    async def reach(self, locks: Mapping[str, AsyncLock[Any]]) -> None:
        """PING every master: enough of them must answer for every stage's quorum; a warning names
        those that do not (a quorum lock goes on without them). LockConnectionError otherwise."""
        replies = await asyncio.gather(
            *(client.ping() for client in self.clients), return_exceptions=True
        )
        failed = {i: r for i, r in enumerate(replies) if isinstance(r, BaseException)}
        needed = max((self.needed(lock) for lock in locks.values()), default=1)
        if len(self.clients) - len(failed) < needed:
            refused = [exc for exc in failed.values() if isinstance(exc, REFUSED)]
            raise refused[0] if refused else no_quorum(self.settings.redis.masters, failed, needed)
        for i, client in enumerate(self.clients):
            if i not in failed:
                await check_eviction(client, self.settings, f"master {i + 1} of REDISLOCK_URL")
        if failed:
            logger.warning(
                "Quorum lock: %d of %d masters answer, %d needed; not answering: %s",
                len(self.clients) - len(failed),
                len(self.clients),
                needed,
                masters_said(self.settings.redis.masters, failed),
            )

    def needed(self, lock: AsyncLock[Any]) -> int:
        return cast(AsyncQuorumCountingLock, lock).quorum

    async def _close(self) -> None:
        closing = [client.aclose() for client in self.clients]
        closing.append(self.factory.aclose())  # the masters' waiting connections
        await asyncio.gather(*closing, return_exceptions=True)


Deployment = OneRedis | QuorumOfMasters


def deployment_of(settings: RedisLockSettings, key_prefix: str) -> Deployment:
    """Where the locks with ``key_prefix`` live (see :func:`~scrapy_redislock.lock.permit.group_prefix`)."""
    kind = QuorumOfMasters if settings.redis.masters else OneRedis
    return kind(settings, key_prefix)


__all__ = ["Deployment", "OneRedis", "QuorumOfMasters", "Shared", "deployment_of"]
