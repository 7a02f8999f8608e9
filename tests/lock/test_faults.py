"""Fault injection on the lock: real worker processes (testing/faultproc.py) against a real
redis-server per test.

After every scenario the test checks, from what the processes recorded themselves (hold intervals on
time.monotonic, the clock all processes on one machine share) and from Redis:

- the cap: the most holds open at one instant, never above the limit;
- lost work: holds whose lease was lost while the worker still held it;
- leaked permits: nothing left in the group's pending list (XPENDING) once every worker closed;
- recovery time: from the fault until the slots are handed out again.

Each prints one ``[faults]`` line with its figures (``pytest -s``); REDISLOCK_FAULTS_REPORT=file
collects them.
"""

from __future__ import annotations

import bisect
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from scrapy_redislock import CountingLock
from scrapy_redislock.lock.permit import LockKeys
from testing import lockstate
from testing.faultproc import (
    StartLine,
    Worker,
    jain,
    max_overlap,
    overlap_seconds,
    percentile,
    report,
)
from testing.redis_server import RedisServer
from testing.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.faults]

AOF = ["--appendonly", "yes", "--appendfsync", "always"]
SLACK = 0.3  # scheduling noise on a loaded 2-core machine, seconds


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A redis-server of the test's own, free to be killed, paused and restarted."""
    with RedisServer() as running:
        yield running


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.stop()


def client_of(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url, socket_timeout=10)


def renew_interval(ttl: float) -> float:
    return min(ttl, 3.0) / 3


def slots_key(name: str) -> str:
    return LockKeys.of("redislock", name).slots


def pending_by_consumer(client: redis.Redis, name: str) -> dict[str, int]:
    if not client.exists(slots_key(name)):
        return {}
    summary = client.xpending(slots_key(name), "holders")
    return {c["name"].decode(): int(c["pending"]) for c in summary["consumers"]}


def leaked(client: redis.Redis) -> int:
    """Grants still held in Redis over every lock (after every worker closed: leaked permits)."""
    return sum(
        int(client.xpending(key, "holders")["pending"])
        for key in client.scan_iter("redislock:*:slots")
    )


def blocked(client: redis.Redis) -> int:
    return int(client.info("clients")["blocked_clients"])


def hold_records(workers: list[Worker]) -> list[dict]:
    return [r for w in workers for r in w.all("hold")]


def intervals(records: list[dict]) -> list[tuple[float, float]]:
    return [(r["hold"][0], r["hold"][1]) for r in records]


def loopers(
    url: str,
    name: str,
    limit: int,
    ttl: float,
    count: int,
    seconds: float,
    hold_ms: float,
    *extra: object,
) -> list[Worker]:
    """``count`` loop workers, alternately on the blocking and the asyncio lock, started together
    once all are ready."""
    line = StartLine(Path(tempfile.gettempdir()))
    started = [
        Worker(
            "loop",
            url,
            name,
            limit,
            ttl,
            "--hold-ms",
            hold_ms,
            "--seconds",
            seconds,
            *line.args,
            "--front",
            "sync" if i % 2 == 0 else "async",
            *extra,
        )
        for i in range(count)
    ]
    line.go(started)
    return started


# -- a holder dies --


@pytest.mark.parametrize("victims", [1, 3])
def test_killed_holders_slots_come_back_within_ttl_and_a_renewal(
    server: RedisServer, workers: list[Worker], victims: int
) -> None:
    limit, ttl, name = 3, 0.9, "kill"
    client = client_of(server)
    held = [Worker("hold", server.url, name, limit, ttl) for _ in range(victims)]
    workers.extend(held)
    grants = [w.wait_for("acquired") for w in held]
    owners = [w.wait_for("ready")["owner"] for w in held]
    before_kill = 1.5 + 2 * ttl  # many renewals of the victims' leases while others contend
    # The loopers wait (and so reap) well past the kill: a dead holder's slot comes back to whoever
    # waits for it.
    live = loopers(server.url, name, limit, ttl, 4, before_kill + 3 * ttl + 1.0, 20)
    workers.extend(live)
    time.sleep(before_kill)
    assert all(pending_by_consumer(client, name).get(o) == 1 for o in owners), (
        "a live lease was reaped"
    )
    kill_sent = time.monotonic()
    for worker in held:
        worker.signal(signal.SIGKILL)
    killed = time.monotonic()
    for worker in held:
        worker.kill()
    back = {}  # owner -> the instant its slot was back
    for owner in owners:
        wait_until(
            lambda o=owner: not pending_by_consumer(client, name).get(o), 5, "slot back", step=0.002
        )
        back[owner] = time.monotonic()
    for worker in live:
        worker.finish()
    recovery = max(back.values()) - killed
    ri = renew_interval(ttl)
    # the last renewal was at most ri before the kill; a live process reaps every ri (the holders
    # died between kill_sent and killed: the lower bound is checked from the first, the upper from
    # the second)
    assert max(back.values()) - kill_sent >= ttl - ri - SLACK, max(back.values()) - kill_sent
    assert recovery <= ttl + ri + SLACK, recovery
    records = hold_records(live)
    spans = intervals(records) + [(g["acquired"], killed) for g in grants]
    cap = max_overlap(spans)
    assert cap <= limit
    after = [(s, e) for s, e in intervals(records) if s >= max(back.values())]
    assert max_overlap(after) == limit  # the slots were really handed out again
    assert min(r["fence"] for r in records if r["hold"][0] >= max(back.values())) > max(
        g["fence"] for g in grants
    )
    lost = sum(1 for r in records if r["lost"] or not r["released"])
    assert lost == 0
    assert leaked(client) == 0
    report(
        f"SIGKILL {victims} holder(s)",
        cap=cap,
        limit=limit,
        lost=lost,
        leaked=0,
        recovery_s=recovery,
        bound_s=ttl + ri,
        ttl=ttl,
    )


def test_a_paused_holder_loses_its_lease_notices_at_its_next_renewal_and_the_cap_holds(
    server: RedisServer, workers: list[Worker]
) -> None:
    """SIGSTOP past the TTL: others get the slot only after expiry; on SIGCONT the holder stops
    within a renewal."""
    limit, ttl, name = 1, 0.6, "stop"
    ri = renew_interval(ttl)
    client = client_of(server)
    holder = Worker("hold", server.url, name, limit, ttl)
    workers.append(holder)
    held = holder.wait_for("acquired")
    others = loopers(server.url, name, limit, ttl, 2, 3.5, 20)
    workers.extend(others)
    wait_until(lambda: blocked(client) == 2, 10, "both others waiting")
    time.sleep(2 * ttl)  # renewals keep the lease: nobody else got in
    assert not hold_records(others)
    # Each signal lands between the clock reads around it; every bound below uses the read that
    # cannot fail it spuriously (a lower bound the earlier, an upper bound the later).
    stop_sent = time.monotonic()
    holder.signal(signal.SIGSTOP)  # a GC pause, a frozen VM: the connection stays open
    stopped = time.monotonic()
    time.sleep(2.5 * ttl)
    continuing = time.monotonic()
    holder.signal(signal.SIGCONT)
    continued = time.monotonic()
    noticed = holder.wait_for("noticed_lost", timeout=5)
    # the stale release frees nothing of anybody else
    assert holder.wait_for("released")["released"] is False
    holder.finish()
    for worker in others:
        worker.finish()
    records = hold_records(others)
    first_other = min(r["hold"][0] for r in records)
    taken_after = first_other - stopped
    # only after the lease expired
    assert first_other - stop_sent >= ttl - ri - SLACK, first_other - stop_sent
    assert taken_after <= ttl + ri + SLACK, taken_after
    stale = noticed["noticed_lost"] - continuing
    # at its next renewal after SIGCONT
    assert stale >= 0 and noticed["noticed_lost"] - continued <= ri + SLACK, stale
    stale_work = [t for t in noticed["work"] if t >= continuing]
    # no work while stopped, of course
    assert not [t for t in noticed["work"] if stopped + 0.02 < t < continuing]
    # The cap, counting the holder as holding from its grant until it stopped, and again from
    # SIGCONT until it noticed: during the pause the cap holds; after SIGCONT it overlapped the new
    # holder for `stale` seconds at most, which is what fencing tokens are for: the new holder's
    # fence is higher.
    spans = intervals(records)
    assert max_overlap([*spans, (held["acquired"], stopped)]) == limit
    overlap = overlap_seconds(
        [*spans, (held["acquired"], stopped), (continuing, noticed["noticed_lost"])], limit
    )
    assert overlap <= stale
    assert all(r["fence"] > held["fence"] for r in records)
    assert not any(r["lost"] for r in records) and all(r["released"] for r in records)
    assert leaked(client) == 0
    report(
        "SIGSTOP holder past its TTL",
        cap_while_paused=limit,
        limit=limit,
        lost=0,
        leaked=0,
        others_in_after_s=taken_after,
        noticed_after_resume_s=stale,
        stale_work_steps=len(stale_work),
        ttl=ttl,
    )


# -- Redis restarts, pauses --


@pytest.mark.parametrize("persistence", ["none", "aof"])
def test_redis_restart_mid_run(workers: list[Worker], persistence: str) -> None:
    """kill -9 of redis-server, back 0.3 s later on the same port: workers reconnect, the cap holds
    throughout.

    Without persistence the lock is gone: the first worker that had used it recreates it in recovery
    mode (every slot held by ``__limbo__``), holders re-adopt slots at their next renewal, unclaimed
    ones come free after one TTL. With AOF (fsync always) the lock comes back as it was; the leases
    aged by the downtime (Redis's clock).
    """
    limit, ttl, name = 2, 1.0, "restart"
    ri = renew_interval(ttl)
    with RedisServer(extra_args=AOF if persistence == "aof" else None) as server:
        client = client_of(server)
        live = loopers(server.url, name, limit, ttl, 4, 5.0, 150)
        workers.extend(live)
        live[0].wait_for("hold")
        time.sleep(1.0)
        server.kill()
        down = time.monotonic()
        time.sleep(0.3)
        server.start()
        up = time.monotonic()
        for worker in live:
            worker.finish()
        records = hold_records(live)
        held_at_crash = sum(1 for r in records if r["hold"][0] <= down <= r["hold"][1])
        after = [r for r in records if r["hold"][0] > up]
        assert all(any(r["hold"][0] > up for r in w.all("hold")) for w in live), (
            "every worker got slots again"
        )
        recovery = min(r["hold"][0] for r in after) - up
        assert recovery <= ttl + ri + SLACK, recovery
        cap = max_overlap(intervals(records))
        assert cap <= limit
        assert max_overlap(intervals(after)) == limit
        lost = sum(1 for r in records if r["lost"])
        assert lost == 0  # downtime < TTL: every surviving holder kept (or re-adopted) its slot
        errors = sum(len(w.all("error")) for w in live)
        assert errors > 0  # the workers did see the outage
        wait_until(lambda: leaked(client) == 0, ttl + ri + SLACK, "unclaimed reserved slots reaped")
        report(
            f"redis-server restart ({persistence})",
            cap=cap,
            limit=limit,
            lost=lost,
            leaked=0,
            held_at_crash=held_at_crash,
            recovery_s=recovery,
            bound_s=ttl + ri,
            errors_seen=errors,
            ttl=ttl,
        )


def test_redis_restart_then_a_newcomer_the_documented_window(workers: list[Worker]) -> None:
    """The one unsafe case: Redis loses its data and a process that never saw the lock creates it
    afresh before the survivors renewed. Survivors learn of it at their next renewal (at most ttl/3,
    at most 1 s, later): their leases are reported lost and they stop. The overlap is bounded by
    that renewal interval."""
    limit, ttl, name = 1, 3.0, "window"
    ri = renew_interval(ttl)
    with RedisServer() as server:
        client = client_of(server)
        survivor = Worker("hold", server.url, name, limit, ttl)
        workers.append(survivor)
        held = survivor.wait_for("acquired")
        # the newcomer has a whole renewal interval to come first:
        keys = LockKeys.of("redislock", name)
        lockstate.after_a_renewal(client, keys, lockstate.pending_grants(client, keys)[0])
        server.kill()
        server.start()
        up = time.monotonic()
        newcomer = CountingLock(client, name, limit=limit, ttl=ttl)
        permit = newcomer.acquire(timeout=1)  # fresh lock: granted at once
        granted = time.monotonic()
        noticed = survivor.wait_for("noticed_lost", timeout=5)
        survivor.finish()
        window = noticed["noticed_lost"] - granted
        assert window <= ri + SLACK, window
        # ids start at Redis's clock: fences never go back, even after a loss
        assert permit.fence > held["fence"]
        assert newcomer.release(permit) is True
        newcomer.close()
        assert leaked(client) == 0
        report(
            "restart without persistence + new process",
            cap=limit + 1,
            limit=limit,
            window_s=window,
            bound_s=ri,
            newcomer_granted_after_s=granted - up,
            ttl=ttl,
        )


def test_redis_paused_waiters_wait_and_work_resumes(workers: list[Worker]) -> None:
    """SIGSTOP of redis-server for 3 s (longer than the TTL): waits wait, nothing crashes, grants go
    on after."""
    limit, ttl, name, pause = 2, 1.0, "pause", 3.0
    ri = renew_interval(ttl)
    with RedisServer() as server:
        client = client_of(server)
        live = loopers(server.url, name, limit, ttl, 4, 6.0, 30)
        workers.extend(live)
        for worker in live:  # every worker started and connected before the fault
            worker.wait_for("ready")
        live[0].wait_for("hold")
        os.kill(server.process.pid, signal.SIGSTOP)
        paused = time.monotonic()
        time.sleep(pause)
        # before SIGCONT: Redis may answer, and a worker note a grant, before kill returns
        resumed = time.monotonic()
        os.kill(server.process.pid, signal.SIGCONT)
        for worker in live:
            worker.finish()  # exit 0: nothing crashed
        records = hold_records(live)
        # A hold that a worker notes after the stop began was granted before it (Redis is frozen):
        # allow for the worker being scheduled late on a loaded machine.
        during = [r for r in records if paused + SLACK < r["hold"][0] < resumed]
        assert not during, (paused, resumed)  # no grant while Redis was frozen
        after = [r for r in records if r["hold"][0] >= resumed]
        assert all(any(r["hold"][0] >= resumed for r in w.all("hold")) for w in live)
        recovery = min(r["hold"][0] for r in after) - resumed
        assert recovery <= ri + SLACK, recovery
        cap = max_overlap(intervals(records))
        assert cap <= limit
        # Leases of slots held across the pause aged past the TTL on Redis's clock: a release that
        # reached Redis after a reaper's maintain found the grant reaped and returned False (the
        # work itself had ended).
        stale_releases = sum(1 for r in records if not r["released"])
        lost = sum(1 for r in records if r["lost"])
        assert lost == 0  # no hold had work going on when its lease was found gone
        assert leaked(client) == 0
        report(
            "redis-server paused 3 s",
            cap=cap,
            limit=limit,
            lost=lost,
            stale_releases=stale_releases,
            leaked=0,
            recovery_s=recovery,
            ttl=ttl,
        )


# -- clocks --


def test_skewed_wall_clocks_change_nothing(server: RedisServer, workers: list[Worker]) -> None:
    """Wall clocks an hour ahead and behind, blocking and asyncio locks, all reaping; a skewed
    holder is killed and its slot comes back on Redis's clock, not on any client's."""
    limit, ttl, name = 2, 0.6, "skew"
    ri = renew_interval(ttl)
    client = client_of(server)
    victim = Worker("hold", server.url, name, limit, ttl, "--skew", -3600)
    workers.append(victim)
    victim_grant = victim.wait_for("acquired")
    skews = [3600, -3600, 3600, -3600]
    line = StartLine(Path(tempfile.gettempdir()))
    live = [
        Worker(
            "loop",
            server.url,
            name,
            limit,
            ttl,
            "--hold-ms",
            10,
            "--seconds",
            3.0,
            *line.args,
            "--skew",
            skew,
            "--front",
            "sync" if i < 2 else "async",
        )
        for i, skew in enumerate(skews)
    ]
    workers.extend(live)
    for worker, skew in zip(live, skews, strict=True):
        # the clock really is off
        assert abs(worker.wait_for("ready")["wall"] - (time.time() + skew)) < 60
    line.go(live)
    live[0].wait_for("hold")
    time.sleep(1.0)
    killed = victim.kill()  # the instant before SIGKILL
    reaped = time.monotonic()  # and after it was reaped: the victim died in between
    owner = victim.wait_for("ready")["owner"]
    wait_until(
        lambda: not pending_by_consumer(client, name).get(owner),
        5,
        "skewed victim's slot back",
        step=0.002,
    )
    back = time.monotonic()
    for worker in live:
        worker.finish()
    records = hold_records(live)
    cap = max_overlap([*intervals(records), (victim_grant["acquired"], killed)])
    assert cap == limit
    lost = sum(1 for r in records if r["lost"] or not r["released"])
    assert lost == 0  # nobody's live lease was taken for expired by a skewed reaper
    recovery = back - killed
    assert recovery >= ttl - ri - SLACK and back - reaped <= ttl + ri + SLACK, recovery
    assert leaked(client) == 0
    report(
        "clocks skewed +-1 h",
        cap=cap,
        limit=limit,
        lost=lost,
        leaked=0,
        recovery_s=recovery,
        ttl=ttl,
    )


# -- many waiters --


def test_200_waiters_in_20_processes_are_served_in_arrival_order(
    server: RedisServer, workers: list[Worker]
) -> None:
    processes, threads, name = 20, 10, "fifo200"
    total = processes * threads
    client = client_of(server)
    gate = CountingLock(client, name, limit=1, ttl=30)
    held = gate.acquire(timeout=5)
    pool = [
        Worker(
            "waiters",
            server.url,
            name,
            1,
            30,
            "--threads",
            threads,
            "--fifo",
            "--hold-ms",
            1,
            stdin=True,
        )
        for _ in range(processes)
    ]
    workers.extend(pool)
    for worker in pool:
        worker.wait_for("ready")
    for i in range(total):  # one at a time, each queued in Redis before the next asks
        pool[i % processes].send(f"go {i}")
        wait_until(lambda n=i + 1: blocked(client) == n, 10, f"waiter {i} queued", step=0.0005)
    released = time.monotonic()
    assert gate.release(held) is True
    for worker in pool:
        worker.send("end")
    for worker in pool:
        worker.finish()
    grants = sorted((r for w in pool for r in w.all("granted")), key=lambda r: r["fence"])
    assert len(grants) == total  # nobody starved
    order = [int(r["granted"]) for r in grants]
    out_of_order = sum(1 for i, ident in enumerate(order) if ident != i)
    assert order == list(range(total)), f"{out_of_order} served out of arrival order"
    waits = [r["at"] - released for r in grants]
    gate.close()
    assert leaked(client) == 0
    report(
        "200 waiters / 20 processes, FIFO",
        waiters=total,
        out_of_order=out_of_order,
        starved=0,
        last_served_after_s=max(waits),
        leaked=0,
    )


def test_200_looping_waiters_no_starvation(server: RedisServer, workers: list[Worker]) -> None:
    """200 threads in 20 processes loop acquire/hold/release on a limit of 3 for 3 s. FIFO: while
    one waits, at most the 199 others can be served before it (plus the grants already on their way
    when it asked, and the grants made while its thread waited for the GIL or a CPU to send or
    record)."""
    processes, threads, limit, name, seconds = 20, 10, 3, "loop200", 3.0
    total = processes * threads
    client = client_of(server)
    CountingLock(client, name, limit=limit, ttl=30).set_limit(limit)
    line = StartLine(Path(tempfile.gettempdir()))
    pool = [
        Worker(
            "waiters",
            server.url,
            name,
            limit,
            30,
            "--threads",
            threads,
            "--seconds",
            seconds,
            "--hold-ms",
            5,
            *line.args,
        )
        for _ in range(processes)
    ]
    workers.extend(pool)
    line.go(pool)  # all 20 start together, however long each took to start
    for worker in pool:
        worker.finish(timeout=120)
    per_thread = [r for w in pool for r in w.all("thread")]
    assert len(per_thread) == total
    counts = [r["grants"] for r in per_thread]
    assert min(counts) >= 1, "a waiter starved"
    waits = [(asked, at) for r in per_thread for asked, at in r["waits"]]
    granted = sorted(at for _, at in waits)
    overtaken = [
        bisect.bisect_left(granted, at) - bisect.bisect_right(granted, asked) for asked, at in waits
    ]
    worst_overtaken = max(overtaken)
    # FIFO in Redis: at most the 199 others are served before a waiter. The instants are taken in
    # Python, though, around the call: with 10 threads a process sharing one GIL on 2 cores, "asked"
    # can precede the command reaching Redis by tens of ms (over 80 ms on a loaded machine: 259
    # overtakes were seen once), and grants made meanwhile count as overtaking. Half a round covers
    # that; an unfair lock overtakes a waiter by many rounds (redis-py's Lock: thousands).
    assert worst_overtaken <= (total - 1) * 1.5 + 2 * limit, worst_overtaken
    durations = [at - asked for asked, at in waits]
    fairness = jain(counts)
    assert fairness >= 0.95, fairness
    assert leaked(client) == 0
    report(
        "200 looping waiters / 20 processes, limit 3",
        grants=sum(counts),
        min_per_waiter=min(counts),
        max_per_waiter=max(counts),
        jain=fairness,
        max_overtaken=worst_overtaken,
        fifo_bound=total - 1,
        wait_p50_s=percentile(durations, 0.5),
        wait_p99_s=percentile(durations, 0.99),
        wait_max_s=max(durations),
    )
