"""Reaching Redis from a crawl: which errors an outage is (waiting cures it) and which a refusal
(it does not), the first master of a quorum that answers, and how the log names masters."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import redis.exceptions

from scrapy_redislock._redis import AsyncRedisClient
from scrapy_redislock.crawl.connection import mask_url
from scrapy_redislock.errors import LockConnectionError

T = TypeVar("T")

# RedisClusterException is not a RedisError: a cluster client with no reachable node raises it.
REDIS_ERRORS = (
    redis.exceptions.RedisError,
    redis.exceptions.RedisClusterException,
    LockConnectionError,
    OSError,
)
# Errors of an outage or a failover, which waiting cures (Redis down, no master yet, a cluster slot
# moving).
OUTAGE_ERRORS = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.RedisClusterException,
    LockConnectionError,
    OSError,
)
# Errors that waiting cannot cure (some are ConnectionErrors): closed at start at once.
REFUSED = (
    redis.exceptions.AuthenticationError,
    redis.exceptions.AuthorizationError,
    redis.exceptions.AuthenticationWrongNumberOfArgsError,
    redis.exceptions.NoPermissionError,
)


async def first_answer(
    clients: Sequence[AsyncRedisClient], ask: Callable[[AsyncRedisClient], Awaitable[T]]
) -> T:
    """``ask(client)`` of the first client that answers (the one Redis without a quorum); the first
    error if none does."""
    error: BaseException | None = None
    for client in clients:
        try:
            return await ask(client)
        except REDIS_ERRORS as exc:
            error = error or exc
    assert error is not None
    raise error


def masters_said(masters: Sequence[str], replies: Mapping[int, Any]) -> str:
    """``master 1 (redis://...): what``, for each master index in ``replies``."""
    return "; ".join(
        f"master {i} ({mask_url(masters[i])}): {reply}" for i, reply in sorted(replies.items())
    )


def no_quorum(
    masters: Sequence[str], failed: Mapping[int, BaseException], needed: int
) -> LockConnectionError:
    """The error of a quorum start that fewer than ``needed`` masters answered."""
    return LockConnectionError(
        f"{len(masters) - len(failed)} of {len(masters)} masters answer, {needed} needed; {masters_said(masters, failed)}"  # noqa: E501
    )


__all__ = ["OUTAGE_ERRORS", "REDIS_ERRORS", "REFUSED", "first_answer", "masters_said", "no_quorum"]
