"""The two lock-layer primitives behind keys met at run time, against a real redis-server:
``retire`` (a key's lock leaves Redis once nobody holds, waits or is registered) and the delay gate
(starts booked on Redis's clock, first come, first served)."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
import redis
import redis.asyncio

from scrapy_redislock import AsyncCountingLock
from scrapy_redislock.lock.base import CommandRunner
from scrapy_redislock.lock.delay import (
    book_start,
    confirm_start,
    delay_keys,
    push_rate,
    take_rate,
)
from scrapy_redislock.lock.protocol import adrive
from testing.redis_server import RedisServer

pytestmark = pytest.mark.integration
JITTER = 0.02  # seconds of rounding between Redis's clock and this process's, at most


def keys_of(client: redis.Redis, name: str = "key:a.com") -> list[bytes]:
    return sorted(client.scan_iter(f"redislock:{{{name}}}*"))


def test_retire_deletes_only_when_nobody_uses_the_lock(
    admin_url: str, redis_client: redis.Redis
) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(admin_url)
        a = AsyncCountingLock(client, "key:a.com", 1, 30.0, maintain_loop=False)
        b = AsyncCountingLock(client, "key:a.com", 1, 30.0, maintain_loop=False)
        permit = await a.acquire()
        waiter = asyncio.ensure_future(b.acquire())  # registers, then blocks in XREADGROUP
        while not b.busy or not keys_of(redis_client):
            await asyncio.sleep(0.001)
        await a.release(permit)
        await b.maintain()  # whoever waits stays registered: its wait goes on and gets the slot
        permit_b = await waiter
        assert await a.aclose(retire=True) == 0
        assert keys_of(redis_client)  # b holds: the lock stays
        await b.release(permit_b)
        assert await b.aclose(retire=True) == 0
        assert keys_of(redis_client) == []  # nobody holds, waits or is registered: gone
        # made anew, with its own limit
        c = AsyncCountingLock(client, "key:a.com", 2, 30.0, maintain_loop=False)
        again = await c.acquire(timeout=1)
        assert again.fence > permit_b.fence  # fences keep growing (ids start at Redis's clock)
        assert await c.aclose(retire=True) == 1
        assert keys_of(redis_client) == []
        await client.aclose()

    asyncio.run(main())


def test_retire_ignores_owners_gone_for_three_leases(
    admin_url: str, redis_client: redis.Redis
) -> None:
    """A process that registered and died (no release, no retire) does not keep the lock alive for
    ever."""

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(admin_url)
        dead = AsyncCountingLock(client, "key:a.com", 1, 0.1, maintain_loop=False)
        await dead.maintain()  # registers, holds nothing, then "dies"
        alive = AsyncCountingLock(client, "key:a.com", 1, 0.1, maintain_loop=False)
        await alive.release(await alive.acquire())
        assert (await alive.aclose(retire=True)) == 0
        assert keys_of(redis_client)  # the dead one was seen within 3 leases: kept
        later = AsyncCountingLock(client, "key:a.com", 1, 0.1, maintain_loop=False)
        await later.maintain()
        deadline = time.monotonic() + 5
        while keys_of(redis_client) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            await later.aclose(retire=True)
            later = AsyncCountingLock(client, "key:a.com", 1, 0.1, maintain_loop=False)
        assert keys_of(redis_client) == []
        await client.aclose()

    asyncio.run(main())


def test_delay_gate_books_starts_in_order_on_redis_clock(
    admin_url: str, redis_client: redis.Redis
) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(admin_url)
        runner = CommandRunner(client)
        keys = delay_keys("redislock", "key:a.com")
        gate = keys.gate
        booked: list[float] = []

        async def book(gap: float) -> tuple[float, float, float]:
            """The moment booked on Redis's clock, and on this process's clock no earlier than the
            first and no later than the second (Redis counted its wait at some instant between
            sending and reading the reply)."""
            sent = time.monotonic()
            booking = await adrive(book_start(keys, gap), runner, "gate")
            read = time.monotonic()
            booked.append(booking.at)
            return booking.at, sent + booking.wait, read + booking.wait

        first = [await book(0.1) for _ in range(5)]
        # Each booking is 0.1 s after the one before: 0, 0.1, 0.2 ... from the first (on this
        # process's clock, up to the reply's jitter).
        for (_, earliest, _), (_, _, latest) in itertools.pairwise(first):
            assert latest - earliest >= 0.1 - JITTER, first
        assert first[-1][1] - first[0][2] <= 0.4 + JITTER
        ttl = redis_client.pttl(gate)
        assert 0 < ttl <= 500
        # in the order Redis booked them
        concurrent = sorted(await asyncio.gather(*(book(0.1) for _ in range(10))))
        # after the last booking, in the order they came
        assert concurrent[0][2] >= first[-1][1] + 0.1 - JITTER
        for (_, earliest, _), (_, _, latest) in itertools.pairwise(concurrent):
            assert latest - earliest >= 0.1 - JITTER, concurrent
        # On Redis's clock the booked moments are exactly 0.1 s apart.
        for earlier, later in itertools.pairwise(sorted(booked)):
            assert later - earlier == pytest.approx(0.1, abs=1e-6), booked
        assert abs(booked[0] - time.time()) < 5  # seconds since the epoch
        await client.aclose()

    asyncio.run(main())
    deadline = time.monotonic() + 5
    while (
        redis_client.exists(delay_keys("redislock", "key:a.com").gate)
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    assert not redis_client.exists(delay_keys("redislock", "key:a.com").gate)  # idle: nothing left


def redis_micros(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def evalsha_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_starts_are_confirmed_against_the_previous_confirmed_start() -> None:
    """The booking gives the order, the confirmation the gap: a start confirmed late pushes the next
    one back by the whole gap from its own confirmed moment, on Redis's clock (exact to the µs); a
    free key's start is confirmed by its booking alone (one EVALSHA, counted on a server of its
    own, whatever ran before)."""
    with RedisServer() as server, redis.Redis.from_url(server.url) as redis_client:
        asyncio.run(confirmed_starts(server.url, redis_client))
        deadline = time.monotonic() + 5
        while keys_of(redis_client, "key:b.com") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert keys_of(redis_client, "key:b.com") == []  # idle: both strings expired


async def confirmed_starts(url: str, redis_client: redis.Redis) -> None:
    async with redis.asyncio.Redis.from_url(url) as client:
        runner = CommandRunner(client)
        keys = delay_keys("redislock", "key:b.com")
        # the script loaded first (a NOSCRIPT EVALSHA and its retry on a server that has not seen it)
        await adrive(book_start(delay_keys("redislock", "key:warm.com"), 0.2), runner, "gate")
        before = evalsha_calls(redis_client)
        first = await adrive(book_start(keys, 0.2), runner, "gate")
        assert first.confirmed and first.wait == 0
        assert evalsha_calls(redis_client) - before == 1  # nothing else for a free key
        second = await adrive(book_start(keys, 0.2), runner, "gate")
        assert not second.confirmed and second.at == pytest.approx(first.at + 0.2, abs=1e-6)
        # too soon (before the first start's gap has passed): told how long to wait, not recorded
        wait, now = await adrive(confirm_start(keys, 0.2), runner, "gate")
        assert wait > 0 and now + wait == pytest.approx(first.at + 0.2, abs=1e-6)
        # late: confirmed whenever it comes after the gap ...
        while redis_micros(redis_client) < round((first.at + 0.25) * 1_000_000):
            await asyncio.sleep(0.005)
        wait, late = await adrive(confirm_start(keys, 0.2), runner, "gate")
        assert wait == 0 and late >= first.at + 0.25
        # ... and the next start, although booked at first.at + 0.4, waits the gap after it
        third = await adrive(book_start(keys, 0.2), runner, "gate")
        assert third.at == pytest.approx(first.at + 0.4, abs=1e-6)
        wait, now = await adrive(confirm_start(keys, 0.2), runner, "gate")
        assert wait > 0 and now + wait == pytest.approx(late + 0.2, abs=1e-6)


def test_rate_window_lets_n_starts_in_any_window_on_redis_clock(
    admin_url: str, redis_client: redis.Redis
) -> None:
    """A rate of 5 starts per 0.3 s, asked by 3 concurrent askers as fast as they may: the starts
    let through are never more than 5 in any window (t - 0.3, t] on Redis's clock, each refused
    asker is told to wait exactly until the 5th newest start is a window old, each start says the
    places it left in its window, and an idle scope's log expires."""
    count, window = 5, 0.3
    keys = delay_keys("redislock", "key:proxy:p1")
    starts: list[float] = []
    refusals: list[tuple[float, float]] = []
    lefts: list[tuple[float, int]] = []  # places left in the window after a start

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(admin_url)
        runner = CommandRunner(client)
        serial = itertools.count()

        async def asker() -> None:
            while len(starts) < 20:
                member = f"t:{next(serial)}"
                wait, now, left = await adrive(
                    take_rate(keys, count, window, member), runner, "rate"
                )
                if not wait:
                    starts.append(now)
                    lefts.append((now, left))
                    continue
                assert left == 0
                refusals.append((now, wait))
                await asyncio.sleep(wait)

        await asyncio.gather(*(asker() for _ in range(3)))
        await client.aclose()

    asyncio.run(main())
    starts.sort()
    assert len(starts) >= 20 and refusals
    for now, wait in refusals:  # told to wait until the 5th newest start is a window old
        fifth = [start for start in starts if start <= now][-count]
        assert now + wait == pytest.approx(fifth + window, abs=2e-6)
    for i, start in enumerate(starts):
        in_window = [s for s in starts[: i + 1] if s > start - window]
        assert len(in_window) <= count, (start, in_window)
    for now, left in lefts:  # what the log held: the starts of the window up to this one
        assert left == count - len([s for s in starts if now - window < s <= now]), (now, left)
    # paced by the window: 20 starts at 5 per 0.3 s span at least 3 windows
    assert starts[19] - starts[0] >= 3 * window - 1e-6
    deadline = time.monotonic() + 5
    while redis_client.exists(keys.rate) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not redis_client.exists(keys.rate)  # idle: nothing left


def test_a_rate_start_moved_later_holds_its_place_in_the_window_from_there(
    admin_url: str, redis_client: redis.Redis
) -> None:
    """One start per 2 s: a start logged now and moved 1 s later (its request waited for another
    scope first) keeps the next start out until 3 s from now, not 2; the log lives a window past
    the moved start, also when another start is logged or moved after it; a start is only moved
    later, and one the log dropped is logged again where it goes."""
    keys = delay_keys("redislock", "key:proxy:p2")

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(admin_url)
        runner = CommandRunner(client)
        wait, at, left = await adrive(take_rate(keys, 1, 2.0, "a"), runner, "rate")
        assert wait == 0 and left == 0  # the window's one place taken
        assert await adrive(push_rate(keys, "a", at + 1.0, 2.0), runner, "rate")
        assert not await adrive(push_rate(keys, "a", at + 0.5, 2.0), runner, "rate")  # only later
        wait, now, _ = await adrive(take_rate(keys, 1, 2.0, "b"), runner, "rate")
        assert now + wait == pytest.approx(at + 3.0, abs=2e-6)
        assert redis_client.pttl(keys.rate) > (at + 3.0 - now) * 1000 - 50
        # an entry moved a little later beside one further ahead: the log still lives past the latter
        assert await adrive(push_rate(keys, "c", at + 0.1, 2.0), runner, "rate")  # dropped: logged
        assert redis_client.zscore(keys.rate, "c") is not None
        assert redis_client.pttl(keys.rate) > (at + 3.0 - now) * 1000 - 50
        # two per 2 s: a start let through beside a moved one keeps the log a window past it
        two = delay_keys("redislock", "key:proxy:p3")
        _, at, left = await adrive(take_rate(two, 2, 2.0, "a"), runner, "rate")
        assert left == 1
        assert await adrive(push_rate(two, "a", at + 1.0, 2.0), runner, "rate")
        wait, now, left = await adrive(take_rate(two, 2, 2.0, "b"), runner, "rate")
        assert wait == 0 and left == 0
        assert redis_client.pttl(two.rate) > (at + 3.0 - now) * 1000 - 50
        await client.aclose()

    asyncio.run(main())
