"""Property-based test: random operations by several lock objects on one lock, against a simple model.

The model: ``limit`` slots; a grant is possible while fewer than ``limit`` permits are live; lowering the
limit revokes nothing; a permit stops being live when it is released, reaped after its lease expired, or its
object is closed. Checked after every step against Redis itself: the live grants are exactly the group's
pending entries, each under its owner; no grant ever made holders exceed the limit; fences strictly increase.

Lease expiry is made to happen without waiting: the lease's idle time in Redis is set past the ttl
(``XCLAIM ... IDLE``, the clock the lock reads) and then the real reaper runs (another object's maintain), or
the owner's own renew notices. Expiry in real time is covered by tests/test_lock.py.
"""

from __future__ import annotations

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from scrapy_redislock import AcquireTimeout, CountingLock, LockLost, Permit

pytestmark = pytest.mark.integration

NAME = "model"
TTL = 10.0  # long: no lease expires by accident while a run goes on
OWNERS = 3


class LockMachine(RuleBasedStateMachine):
    url = ""
    permits = Bundle("permits")

    def __init__(self) -> None:
        super().__init__()
        self.client = redis.Redis.from_url(self.url)
        self.client.flushdb()
        self.locks = [CountingLock(self.client, NAME, 1, TTL) for _ in range(OWNERS)]
        self.reaper = CountingLock(self.client, NAME, 1, TTL)
        self.by_owner = {lock.owner: lock for lock in self.locks}
        self.limit = 0
        self.live: dict[str, Permit] = {}  # grant id -> permit
        self.unnoticed: dict[str, Permit] = {}  # reaped, and its object has not been told yet
        self.release_called: set[str] = set()
        self.last_fence = 0

    # -- helpers ------------------------------------------------------------------------------------------------

    def free(self) -> int:
        return max(0, self.limit - len(self.live))

    def granted(self, permit: Permit, lock: CountingLock) -> Permit:
        assert permit.owner == lock.owner and permit.grant not in self.live
        assert permit.fence > self.last_fence, (permit.fence, self.last_fence)
        self.last_fence = permit.fence
        self.live[permit.grant] = permit
        assert len(self.live) <= self.limit, "a grant made holders exceed the limit"
        return permit

    def owner_of(self, permit: Permit) -> CountingLock:
        return self.by_owner[permit.owner]

    def is_live(self, permit: Permit) -> bool:
        return self.live.get(permit.grant) is permit

    def age(self, permit: Permit) -> None:
        """Make the lease older than the ttl, on Redis's clock."""
        self.client.xclaim(
            self.reaper.keys.slots, "holders", permit.owner, 0, [permit.grant], idle=int(TTL * 1000) + 1000, justid=True
        )

    # -- rules ----------------------------------------------------------------------------------------------------

    @initialize(limit=st.integers(0, 3))
    def create(self, limit: int) -> None:
        assert self.locks[0].set_limit(limit) is None  # new lock
        self.limit = limit

    @rule(target=permits, index=st.integers(0, OWNERS - 1))
    def acquire(self, index: int) -> Permit | object:
        lock = self.locks[index]
        if self.free():
            return self.granted(lock.acquire(timeout=0.5), lock)
        with pytest.raises(AcquireTimeout):
            lock.acquire(timeout=0)
        return multiple()

    @rule(target=permits, index=st.integers(0, OWNERS - 1))
    def try_acquire(self, index: int) -> Permit | object:
        lock = self.locks[index]
        permit = lock.try_acquire()
        if not self.free():
            assert permit is None
            return multiple()
        assert permit is not None
        return self.granted(permit, lock)

    @rule(permit=permits)
    def release(self, permit: Permit) -> None:
        expected = self.is_live(permit)
        assert self.owner_of(permit).release(permit) is expected  # a stale permit: False, never an error
        self.live.pop(permit.grant, None)
        self.unnoticed.pop(permit.grant, None)
        self.release_called.add(permit.grant)

    @rule(permit=permits, index=st.integers(0, OWNERS - 1))
    def release_someone_elses(self, permit: Permit, index: int) -> None:
        """A permit naming another owner but this grant (forged or mixed up) frees nothing."""
        lock = self.locks[index]
        if lock.owner == permit.owner:
            return
        forged = Permit(permit.name, lock.owner, permit.grant, permit.fence, permit.acquired_at)
        assert lock.release(forged) is False

    @rule(permit=permits)
    def renew(self, permit: Permit) -> None:
        lock = self.owner_of(permit)
        if self.is_live(permit):
            lock.renew(permit)
        elif permit.grant not in self.release_called:  # reaped, or its object was closed
            with pytest.raises(LockLost):
                lock.renew(permit)
            assert permit.lost
            self.unnoticed.pop(permit.grant, None)

    @rule(index=st.integers(0, OWNERS - 1))
    def maintain(self, index: int) -> None:
        """Renews the object's live permits and reports exactly its reaped ones it was not told of yet."""
        lock = self.locks[index]
        expected = {g for g, p in self.unnoticed.items() if p.owner == lock.owner}
        lost = lock.maintain()
        assert {p.grant for p in lost} == expected and all(p.lost for p in lost)
        for grant in expected:
            del self.unnoticed[grant]

    @rule(limit=st.integers(0, 4))
    def set_limit(self, limit: int) -> None:
        assert self.locks[limit % OWNERS].set_limit(limit) == self.limit
        self.limit = limit

    @rule(permit=permits)
    def expire_and_reap(self, permit: Permit) -> None:
        if not self.is_live(permit):
            return
        self.age(permit)
        assert self.reaper.maintain() == []
        del self.live[permit.grant]
        self.unnoticed[permit.grant] = permit

    @rule(permit=permits)
    def expire_and_renew(self, permit: Permit) -> None:
        """The owner renews too late: LockLost, and the slot is free again."""
        if not self.is_live(permit):
            return
        self.age(permit)
        with pytest.raises(LockLost):
            self.owner_of(permit).renew(permit)
        assert permit.lost
        del self.live[permit.grant]

    @rule(index=st.integers(0, OWNERS - 1))
    def close(self, index: int) -> None:
        lock = self.locks[index]
        mine = [g for g, p in self.live.items() if p.owner == lock.owner]
        assert lock.close() == len(mine)
        for grant in mine:
            del self.live[grant]
        for grant in [g for g, p in self.unnoticed.items() if p.owner == lock.owner]:
            del self.unnoticed[grant]

    # -- invariants -----------------------------------------------------------------------------------------------

    @invariant()
    def redis_agrees(self) -> None:
        if not self.client.exists(self.reaper.keys.slots):
            assert not self.live
            return
        entries = self.client.xpending_range(self.reaper.keys.slots, "holders", "-", "+", 100)
        in_redis = {e["message_id"].decode(): e["consumer"].decode() for e in entries}
        assert in_redis == {g: p.owner for g, p in self.live.items()}
        for lock in self.locks:  # what each object believes it holds
            believed = {g for g, p in [*self.live.items(), *self.unnoticed.items()] if p.owner == lock.owner}
            assert {p.grant for p in lock.held} == believed

    def teardown(self) -> None:
        for lock in [*self.locks, self.reaper]:
            lock.close()
        self.client.close()


def test_lock_against_the_model(redis_url: str) -> None:
    LockMachine.url = redis_url
    machine_settings = settings(
        max_examples=200,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    run_state_machine_as_test(LockMachine, settings=machine_settings)
