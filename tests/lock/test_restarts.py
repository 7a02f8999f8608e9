"""The lock across restarts of Redis that keep some state: a snapshot (RDB), and what each promise
costs.

A restart empty is covered in test_sync.py and test_model.py (data loss); here Redis comes back with
an *older* state than the processes saw, which looks like a healthy lock. Each test restarts a real
redis-server from its RDB file. Also here: the renewal bookkeeping that keeps a lease honest (late
grants, cancelled late grants), what a renewal costs as owners grow, and the stream after lowering
and raising a limit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from scrapy_redislock import AcquireTimeout, CountingLock
from scrapy_redislock.lock.base import CommandRunner
from scrapy_redislock.lock.core import LockCore
from scrapy_redislock.lock.protocol import drive
from testing import lockstate
from testing.clock import FakeClock
from testing.redis_server import RedisServer

pytestmark = pytest.mark.integration

TTL = 3.0


@pytest.fixture
def rdb_server() -> Iterator[RedisServer]:
    """A redis-server that writes an RDB snapshot only when told (SAVE) and loads it when started
    again."""
    with RedisServer() as server:
        yield server


def snapshot(client: redis.Redis) -> None:
    client.save()


def restart_from_snapshot(server: RedisServer) -> None:
    """SIGKILL and start again: the server loads its last RDB snapshot, and is another run."""
    server.kill()
    server.start()


def lock(server: RedisServer, **kwargs: object) -> CountingLock:
    client = redis.Redis.from_url(server.url)
    return CountingLock(client, "detail", limit=1, ttl=TTL, maintain_loop=False, **kwargs)  # type: ignore[arg-type]


def test_a_redis_back_from_an_older_snapshot_reserves_every_slot_and_never_repeats_a_fence(
    rdb_server: RedisServer,
) -> None:
    """e02: A's grant is released and B holds the next one after the snapshot; Redis comes back from
    it. C must not get B's slot (nor B's fence): every slot is reserved for a lease, B re-adopts one
    with a higher fence."""
    a, b, c = lock(rdb_server), lock(rdb_server), lock(rdb_server)
    admin = redis.Redis.from_url(rdb_server.url)
    first = a.acquire(timeout=1)
    assert a.release(first)
    c.maintain()  # C has seen the lock too: it is an old process, not a newcomer
    snapshot(admin)  # the lock with its one slot free
    held = b.acquire(timeout=1)
    restart_from_snapshot(rdb_server)

    assert c.try_acquire() is None, "a slot held since the snapshot was handed out again"
    with pytest.raises(AcquireTimeout):
        c.acquire(timeout=0.3)  # the blocking read too: its connection is new, the guard runs first
    assert b.maintain() == [] and not held.lost, "the holder did not re-adopt its slot"
    assert held.fence > first.fence + 1, (
        "the re-adopted slot's fence is not above every earlier fence"
    )
    assert lockstate.pending_grants(admin, b.keys) == [held.grant]
    assert b.release(held)
    again = c.acquire(timeout=1)
    assert again.fence > held.fence
    for each in (a, b, c):
        each.close()
    admin.close()


def test_a_waiting_connection_made_before_the_restart_is_guarded_again(
    rdb_server: RedisServer,
) -> None:
    """An object set up before the restart waits without a setup: its first command to the new run
    is the blocking read itself, on a connection its pool makes anew. The guard goes first on that
    connection."""
    holder, waiter = lock(rdb_server), lock(rdb_server)
    admin = redis.Redis.from_url(rdb_server.url)
    first = holder.acquire(timeout=1)
    with pytest.raises(AcquireTimeout):
        waiter.acquire(timeout=0.05)  # set up, and a waiting connection made and guarded
    assert holder.release(first)
    snapshot(admin)  # the slot free
    held = holder.acquire(timeout=1)
    restart_from_snapshot(rdb_server)
    # registered recently: the next acquire goes straight to the read
    waiter._core.registration.at = time.monotonic()
    # the pool's old connection is dead: redis-py makes a new one (or the first read breaks)
    for _ in range(3):
        try:
            permit = waiter.acquire(timeout=0.3)
        except AcquireTimeout:
            break
        except redis.RedisError:
            continue
        raise AssertionError(f"the read got the slot held since the snapshot: {permit}")
    assert holder.maintain() == [] and not held.lost
    holder.close(), waiter.close(), admin.close()


def test_a_durable_deployment_keeps_the_lock_across_a_restart(rdb_server: RedisServer) -> None:
    """durable=True: the operator vouches that Redis loses no acknowledged write (AOF with
    appendfsync always); a restart then costs nothing: the lock is as it was, no slot is
    reserved."""
    admin = redis.Redis.from_url(rdb_server.url)
    holder = lock(rdb_server, durable=True)
    held = holder.acquire(timeout=1)
    snapshot(admin)  # nothing changes after it: the restart loses nothing
    restart_from_snapshot(rdb_server)
    assert holder.maintain() == [] and not held.lost
    other = lock(rdb_server, durable=True)
    assert other.try_acquire() is None  # the one slot is still held
    assert holder.release(held)
    assert other.try_acquire() is not None
    holder.close(), other.close(), admin.close()


def test_a_restart_costs_a_stage_one_lease_then_grants_resume(rdb_server: RedisServer) -> None:
    """Nobody re-adopts: the reserved slot comes back once a lease has passed on Redis's clock."""
    admin = redis.Redis.from_url(rdb_server.url)
    first = lock(rdb_server)
    first.maintain()
    snapshot(admin)
    restart_from_snapshot(rdb_server)
    newcomer = lock(rdb_server)
    started = time.monotonic()
    permit = newcomer.acquire(timeout=3 * TTL)
    waited = time.monotonic() - started
    assert waited >= TTL * 0.9, (
        f"granted after {waited:.2f} s, before the reservation's lease of {TTL} s ran out"
    )
    assert newcomer.release(permit)
    first.close(), newcomer.close(), admin.close()


def test_a_wait_cancelled_while_its_late_grant_is_renewed_gives_the_slot_back_at_once(
    redis_client: redis.Redis,
) -> None:
    """e05: the renewal of a late grant has moved it to the owner's consumer when the cancel comes;
    the next maintain must free it by its id, not leave it for the reaper (a whole lease)."""
    clock = FakeClock(1000.0)
    core = LockCore.create("detail", 1, TTL, clock=clock)
    other = CountingLock(redis_client, "detail", limit=1, ttl=TTL, maintain_loop=False)
    runner = CommandRunner(redis_client)
    op = core.acquire(None)
    command = next(op)
    while command.__class__.__name__ != "ReadGrant":
        command = op.send(runner(command))
    clock.now += TTL / 2  # the reply comes late: the grant is confirmed (renewed) before use
    command = op.send(runner(command))
    assert command.name == "hold_again"
    runner(command)  # the confirmation ran in Redis (the grant moved to the owner's consumer) ...
    op.close()  # ... and the wait was cancelled before its reply was read
    assert other.try_acquire() is None
    drive(core.maintain(), runner, "detail")
    permit = other.try_acquire()
    assert permit is not None, "the cancelled wait's grant was not given back by the next maintain"
    other.close()


def test_renewal_is_due_an_interval_after_the_confirmation_not_its_reply(
    redis_client: redis.Redis,
) -> None:
    """e06: a grant whose reply took 40% of the ttl is confirmed, which starts its lease again at
    the confirmation's send: the renewal comes one interval after that, so the lease never runs out
    under a live holder however the ticks fall."""
    clock = FakeClock(1000.0)
    holder = CountingLock(
        redis_client, "detail", limit=1, ttl=TTL, maintain_loop=False, clock=clock
    )
    op = holder._core.acquire(None)
    runner = holder.runner
    command = next(op)
    while command.__class__.__name__ != "ReadGrant":
        command = op.send(runner(command))
    clock.now += 0.4 * TTL  # < ttl/2: used without a renewal
    command = op.send(runner(command))
    assert command.name == "hold_again"
    asked = clock.now
    reply = runner(command)
    clock.now += 0.1 * TTL  # the confirmation's reply is slow too
    try:
        op.send(reply)
    except StopIteration as stop:
        permit = stop.value
    assert permit.leased_at == asked and permit.valid_until == asked + TTL
    clock.now = asked + holder.renew_interval
    assert holder.renewal_due(), "not due one interval after the confirmation"
    holder.close()


def test_a_renewal_reads_no_owner_list(redis_client: redis.Redis) -> None:
    """e07: the lease in force is kept in meta; a renewal does not read every owner's ttl (HVALS),
    however many."""
    locks = [
        CountingLock(redis_client, "detail", limit=1, ttl=TTL, maintain_loop=False)
        for _ in range(50)
    ]
    for each in locks:
        each.maintain()
    redis_client.config_resetstat()
    for each in locks:
        each.maintain()
    stats = redis_client.info("commandstats")
    # the once-a-lease garbage pass
    assert "cmdstat_hvals" not in stats or stats["cmdstat_hvals"]["calls"] <= 1
    for each in locks:
        each.close()


def test_lowering_then_raising_the_limit_leaves_no_dead_entry(redis_client: redis.Redis) -> None:
    """e08: every stream entry is a free or a held slot, whatever the lowering and raising in
    between."""
    holder = CountingLock(redis_client, "detail", limit=3, ttl=30, maintain_loop=False)
    held = [holder.acquire(timeout=1) for _ in range(3)]
    for _ in range(20):
        holder.set_limit(1)
        assert holder.release(held.pop())  # its slot is not handed out again: the limit is 1
        holder.set_limit(3)  # before any reap
        held.append(holder.acquire(timeout=1))
    slots = holder.keys.slots
    last = redis_client.xinfo_groups(slots)[0]["last-delivered-id"].decode()
    free = len(redis_client.xrange(slots, "(" + last, "+"))
    pending = redis_client.xpending(slots, "holders")["pending"]
    assert (pending, free) == (3, 0)
    assert redis_client.xlen(slots) == pending + free, "entries that are neither free nor held"
    holder.close()


def test_a_survivor_that_releases_before_it_renews_gives_a_reserved_slot_back(
    rdb_server: RedisServer,
) -> None:
    """A holder whose request ends before its first renewal after the restart releases a grant Redis
    forgot, within its lease: it re-adopts a reserved slot and gives it straight back, so the slot
    comes back at once instead of after the reservation's lease."""
    admin = redis.Redis.from_url(rdb_server.url)
    holder, newcomer = lock(rdb_server), lock(rdb_server)
    holder.maintain()
    snapshot(admin)
    held = holder.acquire(timeout=1)
    restart_from_snapshot(rdb_server)
    assert newcomer.try_acquire() is None  # reserved
    # not held in Redis any more: it gave back the slot it re-adopted
    assert holder.release(held) is False
    permit = newcomer.try_acquire()
    assert permit is not None and permit.fence > held.fence
    assert newcomer.try_acquire() is None  # one slot: the cap holds
    holder.close(), newcomer.close(), admin.close()


def test_a_stale_holder_neither_re_adopts_nor_gives_back_a_reserved_slot(
    rdb_server: RedisServer,
) -> None:
    """A permit whose lease ran out on its holder's clock (a stall) may have had its slot reaped and
    given to another process before the restart: after the restart it must not take a reserved slot,
    nor free one by releasing."""
    admin = redis.Redis.from_url(rdb_server.url)
    stale, newcomer = lock(rdb_server), lock(rdb_server)
    stale.maintain()
    snapshot(admin)
    held = stale.acquire(timeout=1)
    restart_from_snapshot(rdb_server)
    held.valid_until = time.monotonic() - 0.1  # the holder stalled past its lease
    assert stale.maintain([held]) == [held] and held.lost  # lost, not re-adopted
    assert newcomer.try_acquire() is None  # the reserved slot stays reserved
    forged = lock(rdb_server)
    other = forged.maintain()  # a permit made by hand is not usable either
    assert other == []
    stale.close(), newcomer.close(), forged.close(), admin.close()
