"""The one lock interface: the four lock classes have the protocol's members with its signatures,
and the members the quorum locks gained (set_limit, get_limit, close/aclose with retire) work on
real masters."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
import redis
import redis.asyncio

from scrapy_redislock import (
    AsyncCountingLock,
    AsyncLock,
    AsyncQuorumCountingLock,
    BlockingLock,
    CountingLock,
    QuorumCountingLock,
    QuorumNotReached,
)
from scrapy_redislock.lock.interface import LockView
from scrapy_redislock.lock.permit import LockKeys
from scrapy_redislock.lock.quorum import master_options
from testing.redis_server import RedisServer, free_port

MASTERS = 3
OPTIONS = master_options()
ASYNC_OPTIONS = master_options(asyncio=True)


def members(protocol: type) -> dict[str, Any]:
    """The protocol's own members (its bases' too), as declared."""
    found: dict[str, Any] = {}
    for klass in reversed(protocol.__mro__):
        if klass in (LockView, BlockingLock, AsyncLock):
            for name, value in vars(klass).items():
                if not name.startswith("_") or name in (
                    "__enter__",
                    "__exit__",
                    "__aenter__",
                    "__aexit__",
                ):
                    found[name] = value
    return found


def shape(function: Any) -> list[tuple[str, Any, Any]]:
    """Parameter names, kinds and defaults, ``self`` left out."""
    parameters = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.kind, p.default) for p in parameters]


@pytest.mark.parametrize(
    ("lock_class", "protocol"),
    [
        (CountingLock, BlockingLock),
        (QuorumCountingLock, BlockingLock),
        (AsyncCountingLock, AsyncLock),
        (AsyncQuorumCountingLock, AsyncLock),
    ],
)
def test_each_lock_class_has_the_protocols_members_with_its_signatures(
    lock_class: type, protocol: type
) -> None:
    for name, declared in members(protocol).items():
        assert hasattr(lock_class, name), f"{lock_class.__name__} lacks {name}"
        actual = inspect.getattr_static(lock_class, name)
        if isinstance(declared, property):
            assert isinstance(actual, property), f"{lock_class.__name__}.{name} is not a property"
            continue
        assert inspect.iscoroutinefunction(actual) == inspect.iscoroutinefunction(declared), (
            f"{lock_class.__name__}.{name}: async-ness differs from the protocol"
        )
        assert shape(actual) == shape(declared), f"{lock_class.__name__}.{name}"


def test_the_check_fails_for_a_lock_that_strays() -> None:
    """The signature check above can fail: a class whose set_limit takes another argument."""

    class Stray(CountingLock):
        def set_limit(self, limit: int, force: bool = False) -> int | None:  # type: ignore[override]
            return None

    assert shape(Stray.set_limit) != shape(BlockingLock.set_limit)


# -- the quorum locks' limit and retire, on real masters -------------------------------------------


def sync_view(servers: list[RedisServer], reachable: set[int]) -> list[redis.Redis]:
    return [
        redis.Redis(port=s.port if i in reachable else free_port(), **OPTIONS)
        for i, s in enumerate(servers)
    ]


def limit_on(server: RedisServer, name: str = "q") -> int | None:
    with redis.Redis(port=server.port, socket_timeout=2) as client:
        value = client.hget(LockKeys.of("redislock", name).meta, "limit")
    return None if value is None else int(value)


def keys_on(server: RedisServer) -> list[bytes]:
    with redis.Redis(port=server.port, socket_timeout=2) as client:
        return sorted(client.keys("redislock:*"))


@pytest.mark.integration
def test_quorum_set_limit_and_get_limit_need_the_quorum_and_name_the_failed_masters(
    masters: list[RedisServer],
) -> None:
    three = masters[:3]
    clients = sync_view(three, {0, 1})
    lock = QuorumCountingLock(clients, "q", 2, 10.0)  # q = 3 for N=3, L=2
    try:
        assert lock.quorum == 3
        with pytest.raises(
            QuorumNotReached, match=r"set_limit: 2 of 3 masters answered, 3 needed"
        ) as caught:
            lock.set_limit(2)
        assert sorted(caught.value.failed) == [2] and caught.value.needed == 3
        with pytest.raises(QuorumNotReached, match=r"get_limit: 2 of 3 masters answered"):
            lock.get_limit()
    finally:
        lock.close()
        for client in clients:
            client.close()

    clients = sync_view(three, {0, 1, 2})
    lock = QuorumCountingLock(clients, "q", 2, 10.0)
    try:
        assert lock.set_limit(2) == 2  # the failed call above still wrote masters 0 and 1
        assert [limit_on(s) for s in three] == [2, 2, 2]
        assert lock.get_limit() == 2
        with redis.Redis(port=three[2].port) as admin:
            admin.hset(LockKeys.of("redislock", "q").meta, "limit", 5)
        assert lock.get_limit() == 2  # what most masters hold
    finally:
        lock.close()
        for client in clients:
            client.close()


@pytest.mark.integration
def test_quorum_close_with_retire_deletes_the_lock_on_every_master_once_unused(
    masters: list[RedisServer],
) -> None:
    three = masters[:3]
    clients = sync_view(three, {0, 1, 2})
    first = QuorumCountingLock(clients, "q", 1, 10.0)
    second = QuorumCountingLock(clients, "q", 1, 10.0)
    try:
        first.release(first.acquire(timeout=2))
        permit = second.acquire(timeout=2)
        assert first.close(retire=True) == 0
        assert all(keys_on(s) for s in three)  # second still holds it
        second.release(permit)
        assert second.close(retire=True) == 0
        assert [keys_on(s) for s in three] == [[], [], []]
    finally:
        for client in clients:
            client.close()


@pytest.mark.integration
def test_async_quorum_lock_has_the_same_limit_and_retire(masters: list[RedisServer]) -> None:
    three = masters[:3]

    async def main() -> None:
        clients = [redis.asyncio.Redis(port=s.port, **ASYNC_OPTIONS) for s in three]
        lock = AsyncQuorumCountingLock(clients, "q", 1, 10.0)
        try:
            assert await lock.set_limit(1) is None
            assert await lock.get_limit() == 1
            await lock.release(await lock.acquire(timeout=2))
            assert await lock.aclose(retire=True) == 0
            assert [keys_on(s) for s in three] == [[], [], []]
            three[1].kill()
            three[2].kill()
            late = AsyncQuorumCountingLock(clients, "q", 1, 10.0)
            with pytest.raises(QuorumNotReached, match=r"1 of 3 masters answered, 2 needed"):
                await late.set_limit(1)
            await late.aclose()
        finally:
            for client in clients:
                await client.aclose()

    asyncio.run(main())
