"""Property-based test: random operations by several lock objects on one lock, against a simple
model.

The model: ``limit`` slots; a grant is possible while fewer than ``limit`` slots are taken, by live
permits, by grants Redis handed to waits that were abandoned before their reply was read ("ghosts"),
or by slots reserved after a data loss ("limbo"); lowering the limit revokes nothing. A permit stops
being live when it is released, reaped after its lease expired, or its object is closed; a ghost is
freed by its owner's next maintain (or close, or the reaper). Checked after every step against Redis
itself: the live grants and the ghosts are exactly the group's pending entries outside limbo, each
under its owner; every permit an object believes it holds is live or not yet told it was lost; no
grant ever made holders exceed the limit; fences strictly increase, across a data loss too.

Interleavings are forced through the sans-IO core: a wait whose reply is lost (``cancel_wait``), a
grant made between a renewal's decision and its script (``grant_during_maintain``), a release that
reaches Redis before a renewal tick (``release_during_maintain``), partial renewals (``renew`` of
one permit) and a data loss with re-adoption (``data_loss``, then any operation recreates the lock
in limbo).

Lease expiry is made to happen without waiting: the lease's idle time in Redis is set past the ttl
(``XCLAIM ... IDLE``, the clock the lock reads) and then the real reaper runs (another object's
maintain), or the owner's own renew notices. Expiry in real time is covered by
tests/lock/test_sync.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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
    precondition,
    rule,
    run_state_machine_as_test,
)

from scrapy_redislock import AcquireTimeout, CountingLock, LockLost, Permit
from scrapy_redislock.lock.permit import LIMBO, owner_of
from scrapy_redislock.lock.protocol import Operation
from scrapy_redislock.lock.wait import grant_from
from testing import lockstate

pytestmark = pytest.mark.integration

NAME = "model"
TTL = 10.0  # long: no lease expires by accident while a run goes on
OWNERS = 3
AGED_MS = int(TTL * 1000) + 1000


def run_to_end(lock: CountingLock, op: Operation, command: Any) -> Any:
    """Carry an operation's commands to Redis from ``command`` on (the first one already taken by
    the caller)."""
    while True:
        try:
            reply, error = lock.runner(command), None
        except redis.exceptions.RedisError as exc:
            reply, error = None, exc
        try:
            command = op.send(reply) if error is None else op.throw(error)
        except StopIteration as stop:
            return stop.value


class LockMachine(RuleBasedStateMachine):
    url = ""
    permits = Bundle("permits")

    def __init__(self) -> None:
        super().__init__()
        self.client = redis.Redis.from_url(self.url)
        self.client.flushdb()
        # No loops of their own: every maintain of the run is one the machine chose.
        self.locks = [
            CountingLock(self.client, NAME, 1, TTL, maintain_loop=False) for _ in range(OWNERS)
        ]
        self.reaper = CountingLock(self.client, NAME, 1, TTL, maintain_loop=False)
        self.everyone = [*self.locks, self.reaper]
        self.by_owner = {lock.owner: lock for lock in self.everyone}
        # what each object recreates the lock with
        self.known_limit = {lock.owner: 1 for lock in self.everyone}
        self.limit: int | None = 0  # None: Redis lost the lock and nobody recreated it yet
        self.live: dict[str, Permit] = {}  # grant id -> permit
        self.unnoticed: dict[str, Permit] = {}  # reaped, and its object has not been told yet
        # believed held when Redis lost its data; not re-adopted yet
        self.orphans: dict[str, Permit] = {}
        self.ghosts: dict[str, str] = {}  # grant id -> owner: handed to a wait nobody will read
        self.release_called: set[str] = set()
        self.last_fence = 0
        self.fence_at_loss = 0
        # DUMPs of the lock's keys, as an RDB file keeps them
        self.snapshot: dict[str, bytes | None] | None = None
        self.snapshot_limit: int | None = None

    # -- helpers -----------------------------------------------------------------------------------

    def limbo(self) -> int:
        if not self.client.exists(self.reaper.keys.slots):
            return 0
        return len(
            self.client.xpending_range(self.reaper.keys.slots, "holders", "-", "+", 100, LIMBO)
        )

    def free(self) -> int:
        if self.limit is None:
            return 0
        return max(0, self.limit - len(self.live) - len(self.ghosts) - self.limbo())

    def granted(self, permit: Permit, lock: CountingLock) -> Permit:
        assert permit.owner == lock.owner and permit.grant not in self.live
        self.fence_seen(permit)
        self.live[permit.grant] = permit
        assert self.limit is not None and len(self.live) <= self.limit, (
            "a grant made holders exceed the limit"
        )
        return permit

    def fence_seen(self, permit: Permit) -> None:
        assert permit.fence > self.last_fence, (permit.fence, self.last_fence)
        self.last_fence = permit.fence

    def owner_of(self, permit: Permit) -> CountingLock:
        return self.by_owner[permit.owner]

    def is_live(self, permit: Permit) -> bool:
        return self.live.get(permit.grant) is permit

    def age(self, grant: str) -> None:
        """Make a lease older than the ttl, on Redis's clock."""
        lockstate.age_grant(self.client, self.reaper.keys, grant, AGED_MS)

    def touched(self, lock: CountingLock, creates: bool = True) -> None:
        """An operation of ``lock`` reaches Redis: after a data loss it recreates the lock, every
        slot in limbo."""
        if self.limit is None and creates:
            self.limit = self.known_limit[lock.owner]

    def maintained(
        self, lock: CountingLock, listed: list[Permit], lost: list[Permit], old: dict[int, str]
    ) -> None:
        """Account for one maintain of ``lock`` that listed ``listed`` (their grants before it ran
        in ``old``)."""
        self.ghosts_freed(lock)
        for permit in listed:
            before = old[id(permit)]
            if permit.grant != before:  # re-adopted a limbo slot after a data loss
                assert before in self.orphans, before
                del self.orphans[before]
                # above every fence before the loss; grants made since (a raised limit) may have
                # higher ones
                assert permit.fence > self.fence_at_loss, (permit.fence, self.fence_at_loss)
                self.last_fence = max(self.last_fence, permit.fence)
                self.live[permit.grant] = permit
            elif before in self.orphans or before in self.unnoticed:
                assert permit in lost and permit.lost
                self.orphans.pop(before, None)
                self.unnoticed.pop(before, None)
            else:
                assert permit not in lost and self.is_live(permit), permit
        assert len(self.live) + len(self.ghosts) <= (self.limit or 0) or not self.free()

    def ghosts_freed(self, lock: CountingLock) -> None:
        """A maintain of ``lock`` frees the grants handed to its abandoned waits."""
        for grant in [g for g, owner in self.ghosts.items() if owner == lock.owner]:
            del self.ghosts[grant]

    def maintain_of(self, lock: CountingLock, permits: list[Permit] | None = None) -> list[Permit]:
        listed = list(lock.held) if permits is None else permits
        old = {id(p): p.grant for p in listed}
        self.touched(lock)
        lost = lock.maintain(permits)
        self.maintained(lock, listed, lost, old)
        return lost

    # -- rules -------------------------------------------------------------------------------------

    @initialize(limit=st.integers(0, 3))
    def create(self, limit: int) -> None:
        assert self.locks[0].set_limit(limit) is None  # new lock
        self.limit = limit
        self.known_limit[self.locks[0].owner] = limit
        # each object has seen the lock: after a data loss it recreates it in limbo
        for lock in self.everyone:
            lock.maintain()

    @rule(target=permits, index=st.integers(0, OWNERS - 1))
    def acquire(self, index: int) -> Permit | object:
        lock = self.locks[index]
        free = self.free()  # 0 after a data loss: the lock comes back with every slot in limbo
        self.touched(lock)
        if free:
            return self.granted(lock.acquire(timeout=0.5), lock)
        with pytest.raises(AcquireTimeout):
            lock.acquire(timeout=0)
        return multiple()

    @rule(target=permits, index=st.integers(0, OWNERS - 1))
    def try_acquire(self, index: int) -> Permit | object:
        lock = self.locks[index]
        free = self.free()
        self.touched(lock)
        permit = lock.try_acquire()
        if not free:
            assert permit is None
            return multiple()
        assert permit is not None
        return self.granted(permit, lock)

    @rule(index=st.integers(0, OWNERS - 1), delivered=st.booleans())
    def cancel_wait(self, index: int, delivered: bool) -> None:
        """A wait is cancelled, or its connection dies, after Redis handed it a slot (or before
        anything came)."""
        lock = self.locks[index]
        if self.limit is None:
            return
        op = lock._core.acquire(None)
        command = next(op)
        while command.__class__.__name__ != "ReadGrant":  # a setup first (data loss, quiet spell)
            command = op.send(lock.runner(command))
        if delivered and self.free():
            reply = lock.runner(dataclasses.replace(command, block_ms=1))
            grant = grant_from(reply)
            assert grant is not None
            self.ghosts[grant] = lock.owner
        op.close()  # the reply is never read
        assert lock._core.consumers.abandoned

    @rule(index=st.integers(0, OWNERS - 1))
    def grant_during_maintain(self, index: int) -> None:
        """Finding 2: a wait of the same object is granted after the renewal decided what to send,
        before it runs."""
        lock = self.locks[index]
        if self.limit is None or not self.free():
            return
        listed = list(lock.held)
        old = {id(p): p.grant for p in listed}
        op = lock._core.maintain()
        command = next(op)
        permit = self.granted(lock.acquire(timeout=0.5), lock)
        lost = run_to_end(lock, op, command)
        self.maintained(lock, listed, lost, old)
        assert self.is_live(permit) and not permit.lost

    @rule(permit=permits)
    def release(self, permit: Permit) -> None:
        expected = self.is_live(permit)
        lock = self.owner_of(permit)
        # a stale permit: False, never an error
        assert lock.release(permit) is expected
        if not lock._core.consumers.abandoned:
            # a release that found Redis restarted ran a maintain (release.py), which freed the
            # grants of this object's abandoned waits
            self.ghosts_freed(lock)
        self.forget(permit)

    def forget(self, permit: Permit) -> None:
        for grants in (self.live, self.unnoticed, self.orphans):
            if grants.get(permit.grant) is permit:
                del grants[permit.grant]
        self.release_called.add(permit.grant)

    @rule(permit=permits)
    def release_during_maintain(self, permit: Permit) -> None:
        """Finding 5: a release reaches Redis between a renewal's decision and its script (limbo or
        not)."""
        lock = self.owner_of(permit)
        if self.limit is None or permit not in lock.held:
            return
        listed = list(lock.held)
        old = {id(p): p.grant for p in listed}
        op = lock._core.maintain()
        command = next(op)
        assert lock.release(permit) is self.is_live(permit)
        self.forget(permit)
        lost = run_to_end(lock, op, command)
        listed.remove(permit)
        assert permit not in lost and permit not in lock.held and permit.grant == old[id(permit)]
        self.maintained(lock, listed, lost, old)

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
        """Finding 1: renewing one permit touches no other permit of its object."""
        lock = self.owner_of(permit)
        if permit.grant in self.release_called:
            self.touched(lock)
            # a released permit: nothing to say (abandoned waits are freed all the same)
            lock.renew(permit)
            self.maintained(lock, [], [], {})
            return
        if permit not in lock.held:
            return
        old = {id(permit): permit.grant}
        self.touched(lock)
        try:
            lock.renew(permit)
            lost = []
        except LockLost:
            lost = [permit]
        self.maintained(lock, [permit], lost, old)

    @rule(index=st.integers(0, OWNERS))
    def maintain(self, index: int) -> None:
        """Renews the object's live permits and reports exactly its lost ones it was not told of
        yet."""
        self.maintain_of(self.everyone[index])

    @precondition(lambda self: self.limit is not None)
    @rule(limit=st.integers(0, 4), index=st.integers(0, OWNERS - 1))
    def set_limit(self, limit: int, index: int) -> None:
        lock = self.locks[index]
        assert lock.set_limit(limit) == self.limit
        self.limit = limit
        self.known_limit[lock.owner] = limit

    @rule(permit=permits)
    def expire_and_reap(self, permit: Permit) -> None:
        if not self.is_live(permit):
            return
        self.age(permit.grant)
        self.reap()
        del self.live[permit.grant]
        self.unnoticed[permit.grant] = permit

    @rule()
    def expire_limbo_and_ghosts(self) -> None:
        if self.limit is None:
            return
        for entry in self.client.xpending_range(self.reaper.keys.slots, "holders", "-", "+", 100):
            grant = entry["message_id"].decode()
            if entry["consumer"].decode() == LIMBO or grant in self.ghosts:
                self.age(grant)
                self.ghosts.pop(grant, None)
        self.reap()
        assert self.limbo() == 0

    def reap(self) -> None:
        """Run the reaper now (its gate lets one run per renewal interval: the test opens it)."""
        self.client.hdel(self.reaper.keys.meta, "reap_at")
        self.maintain_of(self.reaper)

    @rule(permit=permits)
    def expire_and_renew(self, permit: Permit) -> None:
        """The owner renews too late: LockLost, and the slot is free again."""
        if not self.is_live(permit):
            return
        self.age(permit.grant)
        with pytest.raises(LockLost):
            self.owner_of(permit).renew(permit)
        assert permit.lost
        del self.live[permit.grant]
        self.ghosts_freed(self.owner_of(permit))

    @rule()
    def data_loss(self) -> None:
        """Redis restarts empty: every believed-held permit waits for re-adoption into a limbo
        slot."""
        self.client.flushdb()
        self.orphans.update(self.live)
        # reaped before the loss, its object not told: believed held too
        self.orphans.update(self.unnoticed)
        self.unnoticed.clear()
        self.live.clear()
        self.fence_at_loss = self.last_fence
        self.ghosts.clear()
        self.limit = None

    def lock_keys(self) -> list[str]:
        k = self.reaper.keys
        return [k.slots, k.meta, k.owners, k.ttls, k.seen]

    @rule()
    def save_snapshot(self) -> None:
        """Redis writes a snapshot (RDB): the lock's keys as they are now."""
        self.snapshot = {key: self.client.dump(key) for key in self.lock_keys()}
        self.snapshot_limit = self.limit

    @rule()
    def back_from_an_older_snapshot(self) -> None:
        """Redis comes back from its last snapshot (RDB; AOF everysec after a crash; a replica that
        lagged): the lock's state rolls back, and the server is another run. Grants made since are
        forgotten and their slots look free: the first script must reserve every slot for
        re-adoption, with fences above every earlier one."""
        if self.snapshot is None:
            return
        self.client.delete(*self.lock_keys())
        for key, dumped in self.snapshot.items():
            if dumped is not None:
                self.client.restore(key, 0, dumped, replace=True)
        lock_kept = self.client.exists(self.reaper.keys.slots) and self.client.hexists(
            self.reaper.keys.meta, "limit"
        )
        if lock_kept:
            # what the server's previous run wrote
            self.client.hset(self.reaper.keys.meta, "run", "f" * 40)
        self.orphans.update(self.live)
        self.orphans.update(self.unnoticed)
        self.unnoticed.clear()
        self.live.clear()
        self.ghosts.clear()
        self.fence_at_loss = self.last_fence
        self.limit = self.snapshot_limit if lock_kept else None
        if lock_kept:
            self.maintain_of(self.reaper)  # any script notices the restart first
            assert self.limbo() == self.limit, "not every slot was reserved after the restart"

    @rule(index=st.integers(0, OWNERS - 1))
    def close(self, index: int) -> None:
        lock = self.locks[index]
        mine = [g for g, p in self.live.items() if p.owner == lock.owner]
        ghosts = [g for g, owner in self.ghosts.items() if owner == lock.owner]
        assert lock.close() == len(mine) + len(ghosts)
        for grants in (self.live, self.unnoticed, self.orphans):
            for grant in [g for g, p in grants.items() if p.owner == lock.owner]:
                del grants[grant]
        for grant in ghosts:
            del self.ghosts[grant]

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def redis_agrees(self) -> None:
        if not self.client.exists(self.reaper.keys.slots):
            assert not self.live and not self.ghosts
            return
        entries = self.client.xpending_range(self.reaper.keys.slots, "holders", "-", "+", 100)
        in_redis = {e["message_id"].decode(): owner_of(e["consumer"].decode()) for e in entries}
        in_redis = {g: owner for g, owner in in_redis.items() if owner != LIMBO}
        assert in_redis == {g: p.owner for g, p in self.live.items()} | self.ghosts
        for lock in self.everyone:  # what each object believes it holds
            believed = {
                g
                for grants in (self.live, self.unnoticed, self.orphans)
                for g, p in grants.items()
                if p.owner == lock.owner
            }
            assert {p.grant for p in lock.held} == believed

    def teardown(self) -> None:
        for lock in self.everyone:
            lock.close()
        self.client.close()


def test_lock_against_the_model(redis_url: str) -> None:
    LockMachine.url = redis_url
    machine_settings = settings(
        max_examples=300,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    run_state_machine_as_test(LockMachine, settings=machine_settings)
