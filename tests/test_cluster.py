"""The counting lock on a real local Redis Cluster (3 masters, 3 replicas), including a failover.

A lock's keys share the hash tag ``{name}``, so each lock lives on one master and every script sees all its
keys; different locks spread over the masters. Both fronts take the cluster clients (``redis.RedisCluster``,
``redis.asyncio.RedisCluster``), which route every command by key and refresh the topology after a failover.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio

from scrapy_redislock import AsyncCountingLock, CountingLock
from scrapy_redislock.core import LockKeys
from tests.clusternodes import ClusterNodes, find_redis_cli

pytestmark = [
    pytest.mark.integration,
    pytest.mark.cluster,
    pytest.mark.skipif(find_redis_cli() is None, reason="no redis-cli to create a cluster with"),
]


def start_cluster() -> ClusterNodes:
    nodes = ClusterNodes()
    try:
        return nodes.start()
    except BaseException:
        nodes.stop()
        raise


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterNodes]:
    nodes = start_cluster()
    yield nodes
    nodes.stop()


def pending(nodes: ClusterNodes, name: str) -> int:
    """Grants held, read on the master that serves the lock now."""
    key = LockKeys.of("redislock", name).slots
    with redis.Redis(port=nodes.node_serving(key).port) as client:
        return int(client.xpending(key, "holders")["pending"])


def test_locks_spread_over_the_masters_and_each_keeps_its_limit(cluster: ClusterNodes) -> None:
    client = redis.RedisCluster(host="127.0.0.1", port=cluster.port)
    names = ["list", "detail", "comments", "a", "b", "c"]
    masters = {cluster.node_serving(LockKeys.of("redislock", n).slots).port for n in names}
    assert len(masters) >= 2, "the names should land on several masters"
    locks = [CountingLock(client, name, limit=2, ttl=10) for name in names]
    for lock in locks:
        held = [lock.acquire(timeout=2), lock.acquire(timeout=2)]
        assert lock.try_acquire() is None
        assert [p.fence for p in held] == sorted({p.fence for p in held})
        assert pending(cluster, lock.name) == 2
        assert lock.set_limit(3) == 2 and lock.get_limit() == 3
        extra = lock.try_acquire()
        assert extra is not None and extra.fence > held[-1].fence
        assert lock.close() == 3
        assert pending(cluster, lock.name) == 0
    client.close()


def test_a_release_hands_the_slot_to_a_blocked_waiter_at_once(cluster: ClusterNodes) -> None:
    client = redis.RedisCluster(host="127.0.0.1", port=cluster.port)
    holder = CountingLock(client, "handoff", limit=1, ttl=10)
    waiter = CountingLock(redis.RedisCluster(host="127.0.0.1", port=cluster.port), "handoff", limit=1, ttl=10)
    permit = holder.acquire()
    got: list[tuple[float, int]] = []

    def wait() -> None:
        fence = waiter.acquire(timeout=10).fence
        got.append((time.monotonic(), fence))

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.3)
    assert not got
    released = time.monotonic()
    assert holder.release(permit)
    thread.join(10)
    handed_after = got[0][0] - released
    print(f"[cluster] hand-off to a blocked waiter: {1000 * handed_after:.1f} ms")
    assert handed_after < 0.5 and got[0][1] > permit.fence
    waiter.close()
    holder.close()
    client.close()


def test_the_asyncio_front_on_a_cluster(cluster: ClusterNodes) -> None:
    async def scenario() -> None:
        client = redis.asyncio.RedisCluster(host="127.0.0.1", port=cluster.port)
        lock = AsyncCountingLock(client, "aio", limit=1, ttl=10)
        permit = await lock.acquire(timeout=2)
        assert await lock.try_acquire() is None
        waiting = asyncio.ensure_future(lock.acquire(timeout=5))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        assert await lock.release(permit)
        second = await asyncio.wait_for(waiting, 2)
        assert second.fence > permit.fence
        assert await lock.maintain() == []
        assert await lock.aclose() == 1
        await client.aclose()

    asyncio.run(scenario())
    assert pending(cluster, "aio") == 0


def test_failover_of_the_locks_master() -> None:
    """kill -9 of the master serving the lock; its replica takes over. A grant the replica acknowledged (WAIT)
    survives: its holder renews and releases it on the new master, and no more than the limit is ever granted."""
    nodes = start_cluster()
    try:
        name, limit = "failover", 2
        key = LockKeys.of("redislock", name).slots
        holder = CountingLock(redis.RedisCluster(host="127.0.0.1", port=nodes.port), name, limit=limit, ttl=10)
        permit = holder.acquire(timeout=2)
        master = nodes.node_serving(key)
        with redis.Redis(port=master.port) as direct:
            # WAIT counts what this connection wrote: a write after the grant, acknowledged by the replica, means
            # the replica has the grant too (one replication stream, in order). A new replica may still be syncing.
            direct.incr("tests:{failover}:probe")
            assert direct.execute_command("WAIT", 1, 15000) == 1, "the replica never acknowledged"
            pid = int(direct.info("server")["process_id"])
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        promoted = nodes.wait_failover(key, master)
        failover_s = time.monotonic() - killed

        # The holder's client finds the new master by itself (redis-py refreshes the slots on a connection error).
        renewed_after: float | None = None
        errors = 0
        while renewed_after is None and time.monotonic() - killed < 30:
            try:
                assert holder.maintain() == []  # the lease was replicated: not lost
                renewed_after = time.monotonic() - killed
            except redis.RedisError:
                errors += 1
                time.sleep(0.2)
        assert renewed_after is not None, "the holder never reached the new master"
        assert not permit.lost

        newcomer = CountingLock(redis.RedisCluster(host="127.0.0.1", port=promoted.port), name, limit=limit, ttl=10)
        granted = [newcomer.try_acquire() for _ in range(limit + 1)]
        assert granted[0] is not None and granted[1:] == [None] * limit  # the surviving grant still counts
        assert granted[0].fence > permit.fence
        assert pending(nodes, name) == limit
        assert holder.release(permit) is True
        assert newcomer.close() == 1
        assert pending(nodes, name) == 0
        print(
            f"[cluster] failover: replica promoted {failover_s:.2f} s after the master's kill; the holder renewed "
            f"its replicated grant {renewed_after:.2f} s after it ({errors} errors on the way); cap {limit} held"
        )
    finally:
        nodes.stop()
