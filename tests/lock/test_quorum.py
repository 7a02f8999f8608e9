"""The quorum lock (q of N independent masters) against N real redis-servers, killed and restarted
by the tests.

A master one lock object cannot reach is a client to a port nobody listens on: that object's own
partition.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from scrapy_redislock import (
    AcquireTimeout,
    AsyncQuorumCountingLock,
    InvalidArgument,
    LockLost,
    QuorumCountingLock,
    QuorumLockFactory,
    QuorumPermit,
    safe_quorum,
)
from scrapy_redislock.lock.permit import GROUP, LIMBO, LockKeys
from scrapy_redislock.lock.quorum import master_options
from testing.faultproc import max_overlap
from testing.redis_server import RedisServer, free_port
from testing.waiting import wait_until

pytestmark = pytest.mark.integration

MASTERS = 5
OPTIONS = master_options()
# The model test kills masters (refused at once) but never pauses one: a longer socket timeout keeps
# a busy machine's slow answer from counting as a master failure (a release that times out leaves
# its grant until the lease runs out).
MACHINE_OPTIONS = {**OPTIONS, "socket_timeout": 5.0}


@pytest.fixture
def made() -> Iterator[list[Any]]:
    """Clients made by a test; closed afterwards."""
    clients: list[Any] = []
    yield clients
    for client in reversed(clients):  # lock objects before the clients they use
        client.close()


def admin(server: RedisServer) -> redis.Redis:
    return redis.Redis(port=server.port, socket_timeout=2)


def client_of(server: RedisServer | None, made: list[Any]) -> redis.Redis:
    """A client to ``server``, or to a port nobody listens on (an unreachable master) for None."""
    port = free_port() if server is None else server.port
    client = redis.Redis(host="127.0.0.1", port=port, **OPTIONS)
    made.append(client)
    return client


def qlock(made: list[Any], *args: Any, **kwargs: Any) -> QuorumCountingLock:
    """A lock object closed at the end of the test (its per-master locks stop their threads
    then)."""
    lock = QuorumCountingLock(*args, **kwargs)
    made.append(lock)
    return lock


def made_lock(made: list[Any], factory: QuorumLockFactory, *args: Any, **kwargs: Any) -> Any:
    lock = factory.lock(*args, **kwargs)
    made.append(lock)
    return lock


def create_everywhere(servers: list[RedisServer], made: list[Any], limit: int) -> None:
    """The lock exists on every master (a master without it is then one that lost it: it rejoins
    after a ttl)."""
    lock = qlock(made, view(servers, set(range(len(servers))), made), "q", limit, 10.0)
    lock.release(lock.acquire(timeout=1))
    lock.close()


def view(servers: list[RedisServer], reachable: set[int], made: list[Any]) -> list[redis.Redis]:
    """One object's clients to every master, those outside ``reachable`` pointing nowhere."""
    return [client_of(s if i in reachable else None, made) for i, s in enumerate(servers)]


def held_on(server: RedisServer, name: str = "q", limbo: bool = False) -> int:
    """Grants held on one master now (XPENDING), limbo reservations left out unless asked."""
    with admin(server) as client:
        try:
            consumers = client.xinfo_consumers(LockKeys.of("redislock", name).slots, GROUP)
        except redis.ResponseError:
            return 0
    return sum(int(c["pending"]) for c in consumers if limbo or c["name"].decode() != LIMBO)


# -- the quorum ------------------------------------------------------------------------------------


def test_safe_quorum_is_more_than_a_majority_for_a_counting_lock() -> None:
    assert [safe_quorum(3, limit) for limit in (1, 2, 3, 10)] == [2, 3, 3, 3]
    assert [safe_quorum(5, limit) for limit in (1, 2, 3, 4, 9)] == [3, 4, 4, 5, 5]
    for n in range(1, 8):
        for limit in range(1, 6):
            q = safe_quorum(n, limit)
            assert n * limit // q <= limit  # holders that fit, each on q masters
            assert q == 1 or n * limit // (q - 1) > limit  # and it is the smallest such q


def test_bad_arguments_name_the_argument_and_write_nothing(
    masters: list[RedisServer], made: list[Any]
) -> None:
    clients = view(masters[:3], {0, 1, 2}, made)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"limit": None}, "limit"),
        ({"limit": -1}, "limit"),
        ({"limit": 1, "quorum": 0}, "quorum"),
        ({"limit": 1, "quorum": 4}, "quorum"),
        ({"limit": 1, "quorum": True}, "quorum"),
        ({"limit": 2, "reentrant": True}, "reentrant"),
        ({"limit": 1, "drift_factor": 1.5}, "drift_factor"),
        ({"limit": 1, "ttl": 0}, "ttl"),
    ]
    for kwargs, named in cases:
        with pytest.raises(InvalidArgument, match=named):
            QuorumCountingLock(clients, "q", **kwargs)
    with pytest.raises(InvalidArgument, match="masters"):
        QuorumCountingLock([], "q", 1)
    with pytest.raises(InvalidArgument, match="masters"):
        QuorumCountingLock("redis://localhost", "q", 1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="twice"):
        QuorumCountingLock([clients[0], clients[0], clients[1]], "q", 1)
    with pytest.raises(InvalidArgument, match="asyncio"):
        AsyncQuorumCountingLock(clients, "q", 1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="not a redis URL"):
        QuorumLockFactory(["redis://localhost:6379/0", "http://nowhere"])
    for server in masters:
        with admin(server) as client:
            assert client.dbsize() == 0


def test_a_majority_admits_limit_plus_one_holders_the_safe_quorum_never(
    masters: list[RedisServer], made: list[Any]
) -> None:
    """N=3, L=2: three holders each see a different pair of masters; a majority (2) grants all
    three."""
    three = masters[:3]
    create_everywhere(three, made, 2)
    pairs = [{0, 1}, {1, 2}, {0, 2}]
    majority = [qlock(made, view(three, pair, made), "q", 2, 10.0, quorum=2) for pair in pairs]
    permits = [lock.try_acquire() for lock in majority]
    assert all(permits), "each holder got 2 of 3 masters"
    # every master within its limit, and 3 holders > limit 2
    assert [held_on(s) for s in three] == [2, 2, 2]
    for lock in majority:
        lock.close()
    assert [held_on(s) for s in three] == [0, 0, 0]

    safe = [qlock(made, view(three, pair, made), "q", 2, 10.0) for pair in pairs]
    assert safe[0].quorum == 3
    assert [lock.try_acquire() for lock in safe] == [None, None, None]
    assert [held_on(s) for s in three] == [0, 0, 0]  # every partial grant was given back
    for lock in safe:
        lock.close()


def test_random_partitions_never_exceed_the_limit_with_the_safe_quorum(
    masters: list[RedisServer], made: list[Any]
) -> None:
    """N=5, L=2: three objects, each seeing a random set of >= 3 masters, try in a random order.

    A majority (3) exceeds the limit for some of these views; the safe quorum (4) never does.
    """
    rng = random.Random(11)
    exceeded_by_majority = 0
    for _ in range(25):
        views = [set(rng.sample(range(MASTERS), rng.choice([3, 4, 5]))) for _ in range(3)]
        for quorum in (3, None):
            for server in masters:
                with admin(server) as client:
                    client.flushall()
            create_everywhere(masters, made, 2)
            locks = [
                qlock(made, view(masters, v, made), "q", 2, 10.0, quorum=quorum) for v in views
            ]
            holders = sum(1 for lock in locks if lock.try_acquire() is not None)
            if quorum is None:
                assert holders <= 2, f"views {views}"
            elif holders > 2:
                exceeded_by_majority += 1
    assert exceeded_by_majority > 0  # the views do include the dangerous ones


# -- masters failing -------------------------------------------------------------------------------


def test_n3_mutex_goes_on_with_one_master_killed(
    masters: list[RedisServer], made: list[Any]
) -> None:
    factory = QuorumLockFactory([s.url for s in masters[:3]], **OPTIONS)
    made.append(factory)
    first, second = made_lock(made, factory, "q", 1, 2.0), made_lock(made, factory, "q", 1, 2.0)
    permit = first.acquire(timeout=1)
    masters[0].kill()
    assert first.maintain() == []  # two of three renewed: still held
    assert sorted(permit.grants) == [0, 1, 2]  # the dead master's grant is unknown, not known lost
    with pytest.raises(AcquireTimeout, match="2 of 3 masters"):
        second.acquire(timeout=0.2)
    for _ in range(5):  # handoffs go on on the two live masters
        assert first.release(permit)
        permit = second.acquire(timeout=1)
        assert sorted(permit.grants) == [1, 2]
        first, second = second, first
    first.release(permit)
    assert [held_on(s) for s in masters[1:3]] == [0, 0]


def test_n5_limit3_goes_on_with_one_master_down_and_stops_with_two(
    masters: list[RedisServer], made: list[Any]
) -> None:
    factory = QuorumLockFactory([s.url for s in masters], **OPTIONS)
    made.append(factory)
    lost: list[QuorumPermit] = []
    locks = [made_lock(made, factory, "q", 3, 5.0, on_lost=lost.append) for _ in range(4)]
    assert locks[0].quorum == 4
    masters[4].kill()
    permits = [lock.acquire(timeout=2) for lock in locks[:3]]
    assert all(sorted(p.grants) == [0, 1, 2, 3] for p in permits)
    assert locks[3].try_acquire() is None  # the limit holds with one master down
    assert [held_on(s) for s in masters[:4]] == [3, 3, 3, 3]
    assert locks[0].release(permits[0])
    permits[0] = locks[3].acquire(timeout=2)

    masters[3].kill()
    assert locks[0].try_acquire() is None
    with pytest.raises(AcquireTimeout, match="4 of 5 masters"):
        locks[0].acquire(timeout=0.3)
    # Holders renew on 3 of their 4 masters: fewer than the quorum, so every permit is lost and
    # given back.
    for lock, permit in zip(locks[1:], permits[1:] + permits[:1], strict=True):
        with pytest.raises(LockLost):
            lock.renew(permit)
        assert permit.lost
    assert len(lost) == 3
    assert [held_on(s) for s in masters[:3]] == [0, 0, 0]


def test_a_master_restarted_empty_does_not_rejoin_while_the_holder_renews(
    masters: list[RedisServer], made: list[Any]
) -> None:
    """N=3, L=1: A holds on masters 0 and 1 (it cannot reach 2); master 0 restarts empty.

    A fresh B sees masters 0 and 2 free: without the reservation it would hold too. It must not
    while A renews.
    """
    three = masters[:3]
    # A 4 s lease: a restart and a renewal on a starved machine fit in it (with 1 s, a late renewal
    # lost the lease under load, and B then rightly got the lock).
    ttl = 4.0
    holder = qlock(made, view(three, {0, 1}, made), "q", 1, ttl)
    permit = holder.acquire(timeout=5)
    three[0].restart()
    restarted = time.monotonic()
    other = qlock(made, view(three, {0, 1, 2}, made), "q", 1, ttl)
    renewals = 0
    renew_at = time.monotonic()
    # B tries until past the lease that was running at the restart (the reservation on master 0
    # lasts one lease) and A has renewed three times since
    while renewals < 3 or time.monotonic() < restarted + 1.25 * ttl:
        assert other.try_acquire() is None
        if time.monotonic() >= renew_at:
            holder.renew(permit)  # re-adopts its grant on the restarted master
            renewals += 1
            renew_at = time.monotonic() + holder.renew_interval
        time.sleep(0.02)
    assert sorted(permit.grants) == [0, 1]
    assert held_on(three[0]) == 1  # A's grant, re-adopted out of the reservation
    holder.release(permit)
    assert other.acquire(timeout=5) is not None


def test_a_master_restarted_empty_rejoins_only_after_the_holders_validity(
    masters: list[RedisServer], made: list[Any]
) -> None:
    """As above, but A stops renewing (paused): B gets the lock only once A's permit is no longer
    valid."""
    three = masters[:3]
    holder = qlock(made, view(three, {0, 1}, made), "q", 1, 1.0)
    permit = holder.acquire(timeout=1)
    old_fence = permit.fences[0]
    three[0].restart()
    other = qlock(made, view(three, {0, 1, 2}, made), "q", 1, 1.0)
    granted = None
    while granted is None:
        granted = other.try_acquire()
        if granted is None:
            time.sleep(0.01)
    assert time.monotonic() >= permit.valid_until
    if 0 in granted.grants:
        assert granted.fences[0] > old_fence  # fences never go back, across the restart too


def test_a_round_slower_than_the_validity_gives_everything_back(
    masters: list[RedisServer], made: list[Any]
) -> None:
    """Clock drift: the validity is ttl - elapsed - (ttl * drift_factor + 2 ms); a round past it is
    no grant."""
    now = [0.0]
    clock_jump = [0.0]

    # each look at the clock moves it on by clock_jump: a slow round, or a fast clock
    def clock() -> float:
        now[0] += clock_jump[0]
        return time.monotonic() + now[0]

    three = masters[:3]
    lock = qlock(made, view(three, {0, 1, 2}, made), "q", 1, 2.0, drift_factor=0.25, clock=clock)
    permit = lock.try_acquire()
    assert permit is not None
    assert permit.valid_until - permit.acquired_at <= 2.0 - 0.5 - 0.002
    lock.release(permit)
    # a round now looks at the clock more than 4 times: it "takes" longer than 1.5 s
    clock_jump[0] = 0.4
    assert lock.try_acquire() is None
    assert "too late" in lock._core.last_round
    assert [held_on(s) for s in three] == [0, 0, 0]
    clock_jump[0] = 0.0
    assert lock.try_acquire() is not None


def test_clients_whose_clocks_run_apart_never_overlap(
    masters: list[RedisServer], made: list[Any]
) -> None:
    """Two holders whose clocks run 10% fast and 10% slow, with drift_factor 0.15: each uses its
    permit until its own ``valid_until`` and never releases (the lease has to expire); their holds
    never overlap in real time."""
    base = time.monotonic()
    intervals: list[tuple[float, float]] = []

    def holder(rate: float) -> None:
        def clock() -> float:
            return base + (time.monotonic() - base) * rate

        lock = qlock(
            made, view(masters[:3], {0, 1, 2}, made), "q", 1, 0.3, drift_factor=0.15, clock=clock
        )
        for _ in range(3):
            got = None
            while got is None:
                got = lock.try_acquire()
            start = time.monotonic()
            while clock() < got.valid_until:
                time.sleep(0.002)
            # its use ends when its own clock reads valid_until (read now, the end would be late by
            # a GIL hand-off)
            intervals.append((start, base + (got.valid_until - base) / rate))

    threads = [threading.Thread(target=holder, args=(rate,)) for rate in (1.1, 0.9)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(intervals) == 6
    assert max_overlap(intervals) == 1


# -- the API ---------------------------------------------------------------------------------------


def test_threads_with_their_own_objects_never_exceed_the_limit(
    masters: list[RedisServer], made: list[Any]
) -> None:
    factory = QuorumLockFactory([s.url for s in masters[:3]])
    made.append(factory)
    intervals: list[tuple[float, float]] = []
    errors: list[BaseException] = []

    def worker() -> None:
        lock = made_lock(made, factory, "q", 2, 5.0)
        try:
            for _ in range(10):
                permit = lock.acquire(timeout=20)
                start = time.monotonic()
                time.sleep(0.003)
                intervals.append((start, time.monotonic()))
                lock.release(permit)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    assert len(intervals) == 40
    assert max_overlap(intervals) <= 2
    assert [held_on(s) for s in masters[:3]] == [0, 0, 0]


def test_fences_order_successive_holders_of_a_mutex(
    masters: list[RedisServer], made: list[Any]
) -> None:
    factory = QuorumLockFactory([s.url for s in masters])
    made.append(factory)
    first, second = made_lock(made, factory, "q", 1, 5.0), made_lock(made, factory, "q", 1, 5.0)
    earlier = first.acquire(timeout=1)
    first.release(earlier)
    masters[0].kill()
    later = second.acquire(timeout=1)
    assert sorted(later.grants) == [1, 2, 3, 4]
    assert later.newer_than(earlier) and not earlier.newer_than(later)
    assert later.newer_than(earlier.fences)
    assert not later.newer_than({0: 1})  # nothing shared: no order


def test_reentrant_holds_count_per_thread(masters: list[RedisServer], made: list[Any]) -> None:
    factory = QuorumLockFactory([s.url for s in masters[:3]])
    made.append(factory)
    lock = made_lock(made, factory, "q", 1, 5.0, reentrant=True)
    outer = lock.acquire(timeout=1)
    assert lock.acquire(timeout=1) is outer and outer.holds == 2
    other: list[object] = []
    thread = threading.Thread(target=lambda: other.append(lock.try_acquire()))
    thread.start()
    thread.join()
    assert other == [None]  # another thread is another holder
    assert lock.release(outer) and [held_on(s) for s in masters[:3]] == [1, 1, 1]
    assert lock.release(outer) and [held_on(s) for s in masters[:3]] == [0, 0, 0]
    with lock as permit:
        assert permit.holds == 1 and not permit.released
    assert permit.released


def test_auto_renew_keeps_a_permit_past_its_ttl(
    masters: list[RedisServer], made: list[Any]
) -> None:
    factory = QuorumLockFactory([s.url for s in masters[:3]])
    made.append(factory)
    ttl = 1.0  # a live lease outlasts a busy machine's stall of its renewals by well over 0.5 s
    holder, other = (
        made_lock(made, factory, "q", 1, ttl, auto_renew=True),
        made_lock(made, factory, "q", 1, ttl),
    )
    permit = holder.acquire(timeout=1)
    first_validity = permit.valid_until
    deadline = time.monotonic() + 2 * ttl
    while time.monotonic() < deadline:
        assert other.try_acquire() is None
        time.sleep(0.02)
    assert not permit.lost and permit.valid_until > first_validity + ttl
    holder.close()
    assert other.acquire(timeout=1) is not None


def test_a_factory_shares_its_connections(masters: list[RedisServer], made: list[Any]) -> None:
    factory = QuorumLockFactory([s.url for s in masters[:3]])
    made.append(factory)
    locks = [made_lock(made, factory, f"q{i}", 1, 5.0) for i in range(10)]
    for lock in locks:
        lock.release(lock.acquire(timeout=1))
    assert all(lock._masters == factory.clients for lock in locks)
    with admin(masters[0]) as client:
        clients = client.client_list()
    # the factory's command and waiting connections (and this one), not some per lock
    assert len(clients) <= 3


def test_asyncio_lock_caps_holders_and_goes_on_with_a_master_killed(
    masters: list[RedisServer],
) -> None:
    intervals: list[tuple[float, float]] = []

    async def main() -> None:
        factory = QuorumLockFactory([s.url for s in masters], asyncio=True)
        locks = [factory.lock("q", 2, 5.0) for _ in range(5)]
        assert locks[0].quorum == 4

        async def worker(lock: Any) -> None:
            for _ in range(8):
                permit = await lock.acquire(timeout=20)
                start = time.monotonic()
                await asyncio.sleep(0.003)
                intervals.append((start, time.monotonic()))
                await lock.release(permit)

        tasks = [asyncio.create_task(worker(lock)) for lock in locks]
        while len(intervals) < 10:
            await asyncio.sleep(0.005)
        masters[0].kill()
        await asyncio.gather(*tasks)
        for lock in locks:
            await lock.aclose()
        await factory.aclose()

    asyncio.run(main())
    assert len(intervals) == 40
    assert max_overlap(intervals) <= 2
    assert [held_on(s) for s in masters[1:]] == [0, 0, 0, 0]


def test_asyncio_cancelled_acquires_leave_nothing_held(masters: list[RedisServer]) -> None:
    outcomes = {"cancelled": 0, "granted": 0}

    async def main() -> None:
        factory = QuorumLockFactory([s.url for s in masters], asyncio=True)
        lock = factory.lock("q", 3, 5.0)
        rng = random.Random(5)
        for _ in range(40):
            task = asyncio.create_task(lock.acquire(timeout=5))
            await asyncio.sleep(rng.uniform(0, 0.002))
            task.cancel()
            try:
                await lock.release(await task)
                outcomes["granted"] += 1
            except asyncio.CancelledError:
                outcomes["cancelled"] += 1
        assert lock.held == []
        # What Redis handed to a cancelled wait is freed by the lock's own maintenance, the lock
        # staying open.
        deadline = time.monotonic() + 4 * lock.renew_interval
        while [held_on(s) for s in masters] != [0] * MASTERS:
            assert time.monotonic() < deadline, [held_on(s) for s in masters]
            await asyncio.sleep(0.02)
        await lock.aclose()
        await factory.aclose()

    asyncio.run(main())
    assert outcomes["cancelled"] > 0


def test_waiters_are_served_in_arrival_order_while_the_lead_master_is_up(
    masters: list[RedisServer], made: list[Any]
) -> None:
    """They queue in the first master's FIFO; its slot is released last, so the first in line finds
    the others free."""
    factory = QuorumLockFactory([s.url for s in masters[:3]])
    made.append(factory)
    holder = made_lock(made, factory, "q", 1, 5.0)
    permit = holder.acquire(timeout=1)
    order: list[int] = []

    def waiter(index: int) -> None:
        lock = made_lock(made, factory, "q", 1, 5.0)
        got = lock.acquire(timeout=30)
        order.append(index)
        lock.release(got)

    threads = []
    with admin(masters[0]) as lead:
        for index in range(6):
            thread = threading.Thread(target=waiter, args=(index,))
            thread.start()
            threads.append(thread)
            queued = index + 1
            wait_until(
                lambda queued=queued: lead.info("clients")["blocked_clients"] == queued,
                10,
                f"waiter {index} queued",
            )
    holder.release(permit)
    for thread in threads:
        thread.join(30)
    assert order == list(range(6))


# -- random operations against a model, N masters --------------------------------------------------


class QuorumMachine(RuleBasedStateMachine):
    """Random acquires, releases, renewals, objects replaced, and masters killed, started empty,
    restarted, on a quorum lock over 3 masters (L=1: q=2; L=2: q=3). Master 2 is never restarted:
    with every master's data lost at once, nothing remembers a permit, and no quorum can help that
    (documented).

    Checked after every step: no more permits valid now (not released, not found lost,
    ``valid_until`` not passed) than the limit, however they were obtained: the quorum lock's whole
    promise; and every grant Redis holds on a master that is up (reservations after a restart aside)
    belongs to a permit not released, closed or found lost: partial grants are all given back. The
    ttl is short (1 s) so that leases and reservations run out within a run.
    """

    servers: list[RedisServer] = []
    limit = 1
    TTL = 1.0

    def __init__(self) -> None:
        super().__init__()
        for server in self.servers:
            if server.process is None or server.process.poll() is not None:
                server.start()
            with admin(server) as client:
                client.flushall()
        self.clients: list[redis.Redis] = []
        self.factory = QuorumLockFactory([s.url for s in self.servers], **MACHINE_OPTIONS)
        self.objects = [self.factory.lock("m", self.limit, self.TTL) for _ in range(3)]
        self.live: list[QuorumPermit] = []
        # every permit handed out, live or not: rules pick from it by a drawn index, not from a
        # Bundle, whose size depends on which acquires were granted (timing): Hypothesis must
        # draw the same choices whatever the servers answered
        self.issued: list[QuorumPermit] = []

    def up(self, index: int) -> bool:
        process = self.servers[index].process
        return process is not None and process.poll() is None

    def handed(self, permit: QuorumPermit | None) -> None:
        if permit is not None:
            self.live.append(permit)
            self.issued.append(permit)

    @rule(index=st.integers(0, 2))
    def try_acquire(self, index: int) -> None:
        self.handed(self.objects[index].try_acquire())

    @rule(index=st.integers(0, 2))
    def acquire(self, index: int) -> None:
        with contextlib.suppress(AcquireTimeout):
            self.handed(self.objects[index].acquire(timeout=0.05))

    def live_pick(self, pick: int) -> tuple[QuorumPermit, Any] | None:
        """The issued permit ``pick`` names and its owner, if it is still live."""
        if not self.issued:
            return None
        permit = self.issued[pick % len(self.issued)]
        if not any(p is permit for p in self.live):
            return None
        return permit, next(o for o in self.objects if o.owner == permit.owner)

    def forget(self, permit: QuorumPermit) -> None:
        self.live = [p for p in self.live if p is not permit]

    @rule(pick=st.integers(0, 15))
    def release(self, pick: int) -> None:
        picked = self.live_pick(pick)
        if picked is not None:
            permit, owner = picked
            owner.release(permit)
            self.forget(permit)

    @rule(pick=st.integers(0, 15))
    def renew(self, pick: int) -> None:
        picked = self.live_pick(pick)
        if picked is None:
            return
        permit, owner = picked
        try:
            owner.renew(permit)
        except LockLost:
            self.forget(permit)

    @rule(index=st.integers(0, 2))
    def replace_object(self, index: int) -> None:
        old = self.objects[index]
        old.close()
        self.live = [p for p in self.live if p.owner != old.owner]
        self.objects[index] = self.factory.lock("m", self.limit, self.TTL)

    @rule(index=st.integers(0, 1))
    def kill(self, index: int) -> None:
        self.servers[index].kill()

    @rule(index=st.integers(0, 1))
    def start_empty(self, index: int) -> None:
        if not self.up(index):
            self.servers[index].start()

    @rule(index=st.integers(0, 1))
    def restart_empty(self, index: int) -> None:
        self.servers[index].restart()

    @invariant()
    def never_above_the_limit(self) -> None:
        now = time.monotonic()
        valid = [p for p in self.live if p.valid_until > now]
        assert len(valid) <= self.limit, [p.token for p in valid]

    @invariant()
    def nothing_leaks(self) -> None:
        owned = {(i, p.grants[i].grant) for p in self.live for i in p.grants}
        for index, server in enumerate(self.servers):
            if not self.up(index):
                continue
            with admin(server) as client:
                try:
                    entries = client.xpending_range(
                        LockKeys.of("redislock", "m").slots, GROUP, "-", "+", 100
                    )
                except redis.ResponseError:
                    continue  # the lock is not there (yet)
            for entry in entries:
                if entry["consumer"].decode() != LIMBO:
                    assert (index, entry["message_id"].decode()) in owned, (index, entry)

    def teardown(self) -> None:
        for lock in self.objects:
            lock.close()
        self.factory.close()


@pytest.mark.parametrize("limit", [1, 2])
def test_quorum_lock_against_the_model(masters: list[RedisServer], limit: int) -> None:
    QuorumMachine.servers = masters[:3]
    QuorumMachine.limit = limit
    machine_settings = settings(
        max_examples=25,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        # Real servers and real time: a step's outcome (a grant, a lease running out) depends on
        # timing, so a failing run cannot be replayed to shrink it (Hypothesis reports
        # FlakyStrategyDefinition and hides the failure). Report the first failing run as it
        # happened, and replay nothing from an earlier session.
        phases=[Phase.generate],
        database=None,
    )
    run_state_machine_as_test(QuorumMachine, settings=machine_settings)
