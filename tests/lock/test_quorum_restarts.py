"""The quorum lock when one master restarts empty under a newcomer, or freezes under its queued
waiters: three real redis-servers, restarted (SIGKILL, no persistence) or paused (SIGSTOP, always
resumed) by the tests.

* A master that lost the lock (restarted empty) must not hand its slots to a newcomer while another
  master still has the lock, whatever the newcomer writes first: ``set_limit`` (the request front's
  start) included.
* A waiter queued in a lead master that stops answering moves on to the other masters (it would
  otherwise wait as long as the lead is frozen), and a waiter at a lead that answers keeps its place
  in that master's FIFO.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio

from scrapy_redislock import (
    AcquireTimeout,
    AsyncQuorumCountingLock,
    QuorumLockFactory,
    QuorumPermit,
)
from scrapy_redislock.lock.permit import GROUP, LIMBO, LockKeys
from scrapy_redislock.lock.quorum import master_options
from testing.inprocess import front
from testing.redis_server import RedisServer, free_port
from testing.waiting import until, wait_until

pytestmark = pytest.mark.integration

MASTERS = 3


def admin(server: RedisServer) -> redis.Redis:
    return redis.Redis(port=server.port, socket_timeout=2)


def held_on(server: RedisServer, name: str = "q", limbo: bool = False) -> int:
    """Grants held on one master now (XPENDING), limbo reservations left out unless asked."""
    with admin(server) as client:
        try:
            consumers = client.xinfo_consumers(LockKeys.of("redislock", name).slots, GROUP)
        except redis.ResponseError:
            return 0
    return sum(int(c["pending"]) for c in consumers if limbo or c["name"].decode() != LIMBO)


def blocked(server: RedisServer) -> int:
    with admin(server) as client:
        return int(client.info("clients")["blocked_clients"])


def blocked_ids(server: RedisServer) -> set[str]:
    """The connections blocked in a read on one master (one per queued wait)."""
    with admin(server) as client:
        return {str(c["id"]) for c in client.client_list() if "b" in c["flags"]}


def pings(server: RedisServer) -> int:
    with admin(server) as client:
        return int(client.info("commandstats").get("cmdstat_ping", {}).get("calls", 0))


@contextlib.contextmanager
def paused(server: RedisServer) -> Iterator[None]:
    """SIGSTOP the server (a frozen VM: connections stay open, nothing answers); SIGCONT however the
    block ends."""
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def async_view(servers: list[RedisServer], reachable: set[int]) -> list[redis.asyncio.Redis]:
    """One object's asyncio clients to every master, those outside ``reachable`` pointing at a port
    nobody serves."""
    return [
        redis.asyncio.Redis(
            host="127.0.0.1",
            port=s.port if i in reachable else free_port(),
            **master_options(asyncio=True),
        )
        for i, s in enumerate(servers)
    ]


# -- a master restarted empty under a newcomer's set_limit (the request front's start) -------------


def test_a_newcomers_set_limit_recreates_a_master_that_lost_the_lock_in_limbo(
    masters: list[RedisServer],
) -> None:
    """N=3, L=1 (q=2). A cannot reach master 2: its set_limit creates the lock on 0 and 1 with free
    slots (no master had it) and it holds {0, 1}. Master 0 restarts empty. A newcomer B calls
    set_limit first, as every new process of the request front does: master 0 (lost it) and master 2
    (never had it; B cannot tell) get the lock with every slot reserved for one lease, so B cannot
    take A's slot on master 0; A re-adopts it at its next renewal."""
    three = masters[:3]

    async def main() -> None:
        a_clients, b_clients = async_view(three, {0, 1}), async_view(three, {0, 1, 2})
        a = AsyncQuorumCountingLock(a_clients, "q", 1, 10.0)
        b = AsyncQuorumCountingLock(b_clients, "q", 1, 10.0)
        try:
            assert await a.set_limit(1) is None  # master 2 unreachable: 2 of 3 is the quorum
            # a new lock: free slots, no reservation
            assert [held_on(s, limbo=True) for s in three[:2]] == [0, 0]
            permit = await a.acquire(timeout=1)
            assert sorted(permit.grants) == [0, 1]

            three[0].restart()  # no persistence: A's grant there is gone
            assert await b.set_limit(1) == 1  # master 1 had it
            # 0 and 2 in limbo; 1 is A's grant
            assert [held_on(s, limbo=True) for s in three] == [1, 1, 1]
            assert [held_on(s) for s in three] == [0, 1, 0]
            assert await b.try_acquire() is None
            with pytest.raises(AcquireTimeout, match="2 of 3 masters"):
                await b.acquire(timeout=0.3)
            assert permit.usable(time.monotonic())

            # The restart broke A's pooled connection to master 0, and an asyncio client without
            # retries fails the first command on it (a renewal loop would try again at its next
            # tick): use it up first.
            with contextlib.suppress(redis.ConnectionError):
                await a_clients[0].ping()
            # A's renewal re-adopts its grant out of master 0's reservation
            assert await a.maintain([permit]) == []
            assert sorted(permit.grants) == [0, 1] and held_on(three[0]) == 1
            assert await a.release(permit)
            # master 1 freed: B gets it with master 0 (A's re-adopted slot, freed)
            got = await b.acquire(timeout=2)
            assert sorted(got.grants) == [0, 1]
            await b.release(got)
        finally:
            await a.aclose()
            await b.aclose()
            for client in [*a_clients, *b_clients]:
                await client.aclose()

    asyncio.run(main())


def test_a_new_request_front_cannot_take_a_restarted_masters_slot_from_a_live_holder(
    masters: list[RedisServer],
) -> None:
    """The same through the request front: StageLocks.start() publishes the limit (set_limit) before
    anything else; with A holding {0, 1} and master 0 restarted empty, the new front's stage lock
    gets no quorum."""
    three = masters[:3]

    async def main() -> None:
        a_clients = async_view(three, {0, 1})
        a = AsyncQuorumCountingLock(a_clients, "detail", 1, 10.0)
        try:
            await a.set_limit(1)
            permit = await a.acquire(timeout=1)
            assert sorted(permit.grants) == [0, 1]
            three[0].restart()
            with contextlib.suppress(redis.ConnectionError):
                await a_clients[0].ping()  # the connection the restart broke (see the test above)
            async with front([s.url for s in three], {"detail": 1}, scheduler=False) as f:
                lock = f.locks.locks["detail"]
                assert isinstance(lock, AsyncQuorumCountingLock)
                # without the reservation: masters 0 and 2, A's slot on 0
                assert await lock.try_acquire() is None
                assert [held_on(s, "detail", limbo=True) for s in three] == [1, 1, 1]
                assert permit.usable(time.monotonic())
            assert await a.maintain([permit]) == []
            assert sorted(permit.grants) == [0, 1]
        finally:
            await a.aclose()
            for client in a_clients:
                await client.aclose()

    asyncio.run(main())


# -- a lead master that freezes under its queued waiters -------------------------------------------


def test_asyncio_waiter_queued_at_a_paused_lead_moves_on(masters: list[RedisServer]) -> None:
    """N=3, L=1 (q=2), ttl 3 s. W waits in master 0's FIFO behind H; master 0 freezes (SIGSTOP); H
    releases (masters 1 and 2 confirm). W does not wait for master 0: it finds it silent within
    about ttl/3 plus a PING's timeout and gets masters 1 and 2. After SIGCONT, whatever master 0
    handed the given-up wait is freed by the lock itself."""
    three = masters[:3]

    async def main() -> None:
        factories = [QuorumLockFactory([s.url for s in three], asyncio=True) for _ in range(2)]
        h, w = (factory.lock("q", 1, 3.0) for factory in factories)
        try:
            held = await h.acquire(timeout=2)
            wait = asyncio.create_task(w.acquire(timeout=30))
            await until(lambda: blocked(three[0]) == 1, 10, "W queued at master 0")
            with paused(three[0]):
                assert await h.release(held)  # masters 1 and 2 confirm; master 0 times out
                try:
                    got: QuorumPermit = await asyncio.wait_for(asyncio.shield(wait), 10)
                except TimeoutError:
                    raise AssertionError(
                        "W still waits on the paused master 0 with masters 1 and 2 free"
                    ) from None
                assert sorted(got.grants) == [1, 2]
                assert got.usable(time.monotonic())
            await w.release(got)
            await until(
                lambda: [held_on(s) for s in three] == [0, 0, 0],
                10,
                "every grant freed, the given-up wait's too",
            )
        finally:
            if not wait.done():
                wait.cancel()
            await asyncio.gather(wait, return_exceptions=True)
            for lock in (h, w):
                await lock.aclose()
            for factory in factories:
                await factory.aclose()

    asyncio.run(main())


def test_blocking_waiter_queued_at_a_paused_lead_moves_on(masters: list[RedisServer]) -> None:
    """As above with the blocking lock: a watcher thread breaks the frozen wait off."""
    three = masters[:3]
    factories = [QuorumLockFactory([s.url for s in three], **master_options()) for _ in range(2)]
    h, w = (factory.lock("q", 1, 3.0) for factory in factories)
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(w.acquire(timeout=30)), daemon=True)
    try:
        held = h.acquire(timeout=2)
        thread.start()
        wait_until(lambda: blocked(three[0]) == 1, 10, "W queued at master 0")
        with paused(three[0]):
            assert h.release(held)
            thread.join(10)
            assert got, "W still waits on the paused master 0 with masters 1 and 2 free"
            assert sorted(got[0].grants) == [1, 2]
            assert got[0].usable(time.monotonic())
        w.release(got[0])
        wait_until(
            lambda: [held_on(s) for s in three] == [0, 0, 0],
            10,
            "every grant freed, the given-up wait's too",
        )
    finally:
        thread.join(30)
        for lock in (h, w):
            lock.close()
        for factory in factories:
            factory.close()


def test_waiters_keep_their_place_at_a_lead_that_answers(masters: list[RedisServer]) -> None:
    """Waiters queued at a healthy lead for several renewal intervals: each interval without a grant
    their lock makes sure the lead answers (a PING), and their blocked reads stay as they are (same
    connections, same place): they are served in arrival order."""
    three = masters[:3]

    async def main() -> None:
        factory = QuorumLockFactory([s.url for s in three], asyncio=True)
        holder = factory.lock("q", 1, 3.0, auto_renew=True)  # renewal interval 1 s
        waiters = [factory.lock("q", 1, 3.0) for _ in range(3)]
        order: list[int] = []

        async def wait(index: int) -> None:
            permit = await waiters[index].acquire(timeout=30)
            order.append(index)
            await waiters[index].release(permit)

        tasks: list[asyncio.Task[None]] = []
        try:
            held = await holder.acquire(timeout=2)
            for index in range(3):
                tasks.append(asyncio.create_task(wait(index)))
                await until(lambda: blocked(three[0]) == len(tasks), 10, f"waiter {index} queued")
            queued = blocked_ids(three[0])
            before = pings(three[0])
            await until(
                lambda: pings(three[0]) >= before + 2 * len(waiters),
                15,
                "each waiter checked the lead twice",
            )
            assert blocked_ids(three[0]) == queued  # no wait was given up or sent again
            assert await holder.release(held)
            await asyncio.wait_for(asyncio.gather(*tasks), 15)
            assert order == [0, 1, 2]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for lock in (holder, *waiters):
                await lock.aclose()
            await factory.aclose()

    asyncio.run(main())


def test_a_wait_cancelled_while_its_paused_lead_is_checked_leaves_nothing_held(
    masters: list[RedisServer],
) -> None:
    """W is cancelled while it asks its frozen lead whether it answers (the PING in flight): the
    cancel ends it at once, and what master 0 may hand the cancelled wait after SIGCONT is freed by
    the lock itself."""
    three = masters[:3]

    async def main() -> None:
        factories = [QuorumLockFactory([s.url for s in three], asyncio=True) for _ in range(2)]
        h, w = (factory.lock("q", 1, 3.0) for factory in factories)
        try:
            held = await h.acquire(timeout=2)
            wait = asyncio.create_task(w.acquire(timeout=30))
            await until(lambda: blocked(three[0]) == 1, 10, "W queued at master 0")
            with paused(three[0]):
                await until(
                    lambda: any(not ping.done() for ping in w._pings.values()),
                    10,
                    "W checks its lead",
                )
                wait.cancel()
                await asyncio.wait_for(asyncio.gather(wait, return_exceptions=True), 2)
                assert wait.cancelled()
                assert w.held == []
            assert await h.release(held)
            await until(
                lambda: [held_on(s) for s in three] == [0, 0, 0],
                10,
                "nothing held, the cancelled wait's too",
            )
        finally:
            for lock in (h, w):
                await lock.aclose()
            for factory in factories:
                await factory.aclose()

    asyncio.run(main())
