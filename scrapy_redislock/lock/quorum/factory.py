"""Quorum locks over one set of masters, and the client options their masters need."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.retry import Retry

from scrapy_redislock.errors import InvalidArgument
from scrapy_redislock.lock.base import waiting_client
from scrapy_redislock.lock.quorum.aio import AsyncQuorumCountingLock
from scrapy_redislock.lock.quorum.sync import QuorumCountingLock


def master_options(asyncio: bool = False) -> dict[str, Any]:
    """Client options for a quorum's masters: 1 s socket timeouts and no retries (redis-py retries a
    refused connection for seconds, which would eat the validity time; the next round is the
    retry)."""
    retry = (redis.asyncio.retry.Retry if asyncio else Retry)(NoBackoff(), 0)
    return {"socket_timeout": 1.0, "socket_connect_timeout": 1.0, "retry": retry}


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
