"""The recovery window after Redis restarted empty lasts only as long as a survivor may still hold.

A process that saw the lock recreates a missing one with every slot reserved (``__limbo__``) for the
holders that survived; it names the owners alive at its last renewal (maintain's roster), and the
reservation ends once each of them has reported (set up holding nothing, renewed all it holds, or released all) and two
renewal intervals have passed, not after a whole lease. A survivor that has not reported keeps its
slots reserved (the cap holds). Real redis-server, restarted empty (no persistence)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from importlib import resources

import pytest
import redis

from scrapy_redislock import CountingLock
from scrapy_redislock.lock.consumers import ROSTER_MAX
from scrapy_redislock.lock.permit import Permit
from scrapy_redislock.lock.protocol import Command, RunScript, drive
from testing.redis_server import RedisServer
from testing.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.faults]

TTL = 30.0  # a lease far longer than the waits below: waiting it out would time them out
WAIT = 10.0


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as started:
        yield started


def lock(server: RedisServer, limit: int = 2, renews: bool = False) -> CountingLock:
    """``renews``: renewed in the background every renewal interval, as in a crawl (whose renewals
    end the recovery: a blocked wait does not look)."""
    client = redis.Redis.from_url(server.url)
    return CountingLock(client, "detail", limit=limit, ttl=TTL, maintain_loop=renews)


def redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def renew_all_after(holder: CountingLock, first: Callable[[], object]) -> list[Permit]:
    """The renewal loop's renewal of everything ``holder`` holds, its script sent to Redis only
    after ``first()`` ran (which overtakes it there); the permits it found lost."""
    overtaken = False

    def overtake_then_run(command: Command) -> object:
        nonlocal overtaken
        if isinstance(command, RunScript) and command.name == "maintain" and not overtaken:
            overtaken = True
            first()
        return holder.runner(command)

    lost: list[Permit] = drive(holder._core.maintain(), overtake_then_run, holder.name)
    assert overtaken
    return lost


def test_the_roster_bound_agrees_with_the_scripts() -> None:
    lib = (resources.files("scrapy_redislock.lock") / "scripts" / "_lib.lua").read_text()
    found = re.search(r"local ROSTER_MAX = (\d+)", lib)
    assert found is not None and int(found.group(1)) == ROSTER_MAX


def test_a_lone_survivor_does_not_wait_out_the_window(server: RedisServer) -> None:
    """One process, Redis restarted empty: it re-adopts its grant, and the slot reserved for other
    survivors comes free within a couple of renewal intervals, not after the 30 s lease."""
    only = lock(server, renews=True)
    held = only.acquire(timeout=1)
    only.maintain()  # its roster: itself alone
    server.restart()  # SIGKILL and start again, empty
    assert only.maintain() == []  # recreated in limbo; it re-adopts its grant
    assert only.held == [held]
    started = time.monotonic()
    second = only.acquire(timeout=WAIT)  # would time out if it waited the lease out
    assert time.monotonic() - started < WAIT
    assert only.try_acquire() is None  # never more than the limit
    assert only.release(second) and only.release(held)
    only.close()


def test_a_survivor_that_has_not_reported_keeps_its_slots_reserved(server: RedisServer) -> None:
    """Two processes hold one slot each; Redis restarts empty. The first to renew recreates the lock
    and names both: past the floor, the other's slot stays reserved until it reports (the cap
    holds), then a released slot goes to a newcomer at once."""
    a, b = lock(server), lock(server)
    pa, pb = a.acquire(timeout=1), b.acquire(timeout=1)
    a.maintain(), b.maintain()  # rosters: both
    server.restart()
    assert a.maintain() == [] and a.held == [pa]  # a recreates in limbo, waits for b
    admin = redis.Redis.from_url(server.url)
    floor = int(admin.hget(a.keys.meta, "recover_floor") or 0)
    assert floor and admin.hget(a.keys.meta, "awaiting") == b.owner.encode()
    # past the floor and past the next reap of a renewal: still reserved for b
    wait_until(lambda: redis_ms(admin) > floor + 1100, WAIT, "the floor and a reap interval")
    assert a.maintain() == []
    newcomer = lock(server)
    assert newcomer.try_acquire() is None
    assert b.maintain() == [] and b.held == [pb]  # b re-adopts its slot, and reports
    assert newcomer.try_acquire() is None  # both slots held: the cap holds
    assert b.release(pb)
    granted = newcomer.acquire(timeout=WAIT)
    assert newcomer.try_acquire() is None
    assert newcomer.release(granted) and a.release(pa)
    for each in (a, b, newcomer):
        each.close()
    admin.close()


def test_a_survivor_that_releases_reports_too(server: RedisServer) -> None:
    """The awaited survivor closes (gives everything back) instead of renewing: the recovery ends
    all the same."""
    a, b = lock(server, renews=True), lock(server)
    pa = a.acquire(timeout=1)
    b.acquire(timeout=1)
    a.maintain(), b.maintain()
    server.restart()
    assert a.maintain() == []
    b.close()  # release_owner: reported
    started = time.monotonic()
    granted = a.acquire(timeout=WAIT)
    assert time.monotonic() - started < WAIT - 1  # a's renewals end the recovery
    assert a.try_acquire() is None
    assert a.release(granted) and a.release(pa)
    a.close()


def test_an_owner_that_knows_no_roster_waits_out_the_lease(server: RedisServer) -> None:
    """A holder that never renewed cannot tell who may hold: the reservation is for a lease, as
    before."""
    holder = lock(server, limit=1)
    holder.acquire(timeout=1)  # no renewal yet: no roster
    server.restart()
    assert len(holder.maintain()) == 0
    admin = redis.Redis.from_url(server.url)
    assert admin.hget(holder.keys.meta, "awaiting") is None
    admin.close()
    holder.close()


def test_a_survivor_that_sets_up_before_renewing_is_still_awaited(server: RedisServer) -> None:
    """A survivor's first script after the restart is a take (it sets the lock up again, in limbo),
    and its next renewal is late: past the floor, its grant, not re-adopted yet, keeps its slot
    reserved. Reporting at the setup let a newcomer have it (CI, a crawl's 4th request of a stage
    capped at 3)."""
    a = lock(server, limit=2)
    pa = a.acquire(timeout=1)
    a.maintain()  # roster: a alone
    server.restart()
    assert a.try_acquire() is None  # set up in limbo; both slots reserved
    admin = redis.Redis.from_url(server.url)
    floor = int(admin.hget(a.keys.meta, "recover_floor") or 0)
    assert floor and admin.hget(a.keys.meta, "awaiting") == a.owner.encode()
    wait_until(lambda: redis_ms(admin) > floor + 1100, WAIT, "the floor and a reap interval")
    newcomer = lock(server, limit=2)
    assert newcomer.try_acquire() is None  # a holds pa: the cap holds
    assert a.maintain() == [] and a.held == [pa]  # re-adopted; a reports
    granted = newcomer.acquire(timeout=WAIT)  # the other slot comes free at once
    assert newcomer.try_acquire() is None and a.try_acquire() is None
    assert newcomer.release(granted) and a.release(pa)
    for each in (a, newcomer):
        each.close()
    admin.close()


def test_a_survivor_that_releases_one_grant_is_awaited_for_the_others(server: RedisServer) -> None:
    """A survivor holding two grants releases one after the restart: that renewal re-adopts only the
    one it gives back, so it does not report; past the floor its other grant keeps its slot."""
    a, c = lock(server, limit=2), lock(server, limit=2)
    pa, pb = a.acquire(timeout=1), a.acquire(timeout=1)
    assert c.try_acquire() is None  # c registers, holding nothing
    a.maintain(), c.maintain()  # rosters: a and c
    server.restart()
    assert c.try_acquire() is None  # c recreates the lock in limbo; it holds nothing: reported
    admin = redis.Redis.from_url(server.url)
    floor = int(admin.hget(a.keys.meta, "recover_floor") or 0)
    assert floor and admin.hget(a.keys.meta, "awaiting") == a.owner.encode()
    a.release(pa)  # Redis forgot it: pa's slot re-adopted and given back at once
    wait_until(lambda: redis_ms(admin) > floor + 1100, WAIT, "the floor and a reap interval")
    first = c.try_acquire()  # pa's slot
    assert first is not None
    assert c.try_acquire() is None  # pb's stays reserved: the cap holds
    assert a.maintain() == [] and a.held == [pb]
    assert c.release(first) and a.release(pb)
    for each in (a, c):
        each.close()
    admin.close()


def test_two_renewals_that_list_one_forgotten_grant_adopt_one_slot_for_it(
    server: RedisServer,
) -> None:
    """A release's renewal and the renewal loop's both list a grant Redis forgot (CI: a crawl's
    fourth request of a stage capped at 3). Redis runs the release's first: the loop's finds the
    grant adopted already and renews that slot, rather than taking a second reserved slot for it
    and leaving another grant without one (lost, its request still running)."""
    a = lock(server, limit=2)
    pa, pb = a.acquire(timeout=1), a.acquire(timeout=1)
    a.maintain()
    server.restart()
    assert a.try_acquire() is None  # recreated in limbo, both slots reserved
    core = a._core

    def alone() -> None:
        assert drive(core.maintain([pa]), a.runner, a.name) == []

    # the loop's renewal listed pa's old id, and pb's
    assert renew_all_after(a, alone) == []
    assert not pa.lost and not pb.lost
    assert sorted(a.held, key=id) == sorted([pa, pb], key=id)
    newcomer = lock(server, limit=2)
    assert newcomer.try_acquire() is None  # one slot each: nothing left over
    assert a.release(pa) and a.release(pb)
    assert newcomer.acquire(timeout=WAIT) is not None
    for each in (a, newcomer):
        each.close()


def test_a_release_that_overtakes_the_renewal_loop_leaves_the_other_grants_their_slots(
    server: RedisServer,
) -> None:
    """The crawl's case: a request ends and its grant, forgotten by Redis, is released (its renewal
    adopts a reserved slot and gives it straight back) while the loop's renewal, which listed it
    too, waits its turn: the loop's must not adopt a second slot for it, or another grant whose
    request still runs is lost and its slot handed to a newcomer."""
    a = lock(server, limit=2)
    pa, pb = a.acquire(timeout=1), a.acquire(timeout=1)
    a.maintain()
    server.restart()
    assert a.try_acquire() is None  # recreated in limbo, both slots reserved
    # Redis forgot pa: its release adopts a slot and gives it back
    assert renew_all_after(a, lambda: a.release(pa)) == []
    assert not pb.lost and a.held == [pb]
    newcomer = lock(server, limit=2)
    granted = newcomer.try_acquire()  # pa's slot, given back
    assert granted is not None
    assert newcomer.try_acquire() is None  # pb's is pb's: the cap holds
    assert a.release(pb) and newcomer.release(granted)
    for each in (a, newcomer):
        each.close()


def test_the_loops_reply_read_first_keeps_the_slot_the_renewal_before_it_adopted(
    server: RedisServer,
) -> None:
    """The other order: a renewal of pa alone runs first in Redis, the loop's second, and the loop's
    reply is read first. Both name the same slot for pa; neither reading loses a permit."""
    a = lock(server, limit=2)
    pa, pb = a.acquire(timeout=1), a.acquire(timeout=1)
    a.maintain()
    server.restart()
    assert a.try_acquire() is None
    core = a._core
    alone = core.maintain([pa])
    reply = a.runner(next(alone))  # run in Redis; its reply not read yet
    assert drive(core.maintain(), a.runner, a.name) == []
    slot = pa.grant
    with pytest.raises(StopIteration) as done:
        alone.send(reply)
    assert done.value.value == [] and pa.grant == slot and not pa.lost
    assert sorted(a.held, key=id) == sorted([pa, pb], key=id)
    newcomer = lock(server, limit=2)
    assert newcomer.try_acquire() is None
    assert a.release(pa) and a.release(pb)
    for each in (a, newcomer):
        each.close()


def test_a_slot_adopted_for_a_grant_whose_owner_never_heard_goes_back_with_it(
    server: RedisServer,
) -> None:
    """A renewal adopted a slot for each grant, and its reply never came (the connection broke):
    pa's release, by its old id, frees the slot it was adopted in; pb, listed with its lease run out
    on the owner's clock (stalled), gives its slot back; pc's renewal renews its slot."""
    a = lock(server, limit=3)
    pa, pb, pc = (a.acquire(timeout=1) for _ in range(3))
    a.maintain()
    server.restart()
    assert a.try_acquire() is None
    core = a._core
    # all adopted in Redis (none left reserved); the reply is lost
    a.runner(next(core.maintain([pa, pb, pc])))
    assert a.release(pa)  # by its old id: the slot it was adopted in is freed
    newcomer = lock(server, limit=3)
    first = newcomer.try_acquire()
    assert first is not None and newcomer.try_acquire() is None
    pb.valid_until = 0.0  # stalled: its lease ran out on a's clock
    assert a.maintain([pb]) == [pb]  # lost, and its adopted slot given back
    second = newcomer.try_acquire()
    assert second is not None and newcomer.try_acquire() is None  # pc's slot stays pc's
    assert a.maintain() == [] and a.held == [pc]
    for permit in (first, second):
        assert newcomer.release(permit)
    assert a.release(pc)
    for each in (a, newcomer):
        each.close()
