"""The request front's slots over StageLocks in-process (scrapy.utils.test.get_crawler, a real
Redis): the permit hand-off from the scheduler to the middleware, the one left-the-downloader sweep,
the local hand-off of a freed slot with its fairness bound, and the commands on a stage's way to its
first grant."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable

import pytest
import redis
from scrapy import Request

from scrapy_redislock import CountingLock
from scrapy_redislock._redis import without_flags
from scrapy_redislock.crawl.stagelocks import out_of_lease, within_lease
from scrapy_redislock.errors import AcquireTimeout
from scrapy_redislock.lock.core import lock_scripts
from testing.crawlproc import leftover
from testing.inprocess import front, held, request
from testing.monitor import Monitor, commands
from testing.netproxy import LatencyProxy
from testing.waiting import until

pytestmark = pytest.mark.integration


def test_hand_take_finish(redis_url: str, redis_client: redis.Redis) -> None:
    """A slot handed with a request stays held while the request has it; an error is given once;
    finish frees it."""

    async def scenario() -> None:
        async with front(redis_url, {"detail": 2}, scheduler=False) as f:
            permit = await f.locks.acquire("detail", None)
            one, two = request("detail", 1), request("detail", 2)
            f.slots.hand(one, permit)
            f.slots.hand(two, AcquireTimeout("no slot"))
            assert f.slots.take(one) is permit
            assert f.slots.take(one) is permit  # still held: the request has it until it finishes
            assert isinstance(f.slots.take(two), AcquireTimeout)
            assert f.slots.take(two) is None  # an error is given once
            assert held(redis_client, "detail") == [permit.grant]
            f.slots.finish(one)
            # a second finish (process_response after request_left) does nothing
            f.slots.finish(one)
            await until(lambda: leftover(redis_client) == 0)
            assert f.crawler.stats.get_value("redislock/detail/reused") is None

    asyncio.run(scenario())


def test_the_sweep_frees_a_request_gone_from_the_downloader_at_two_ticks(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario() -> None:
        async with front(redis_url, {"detail": 2}, scheduler=False) as f:
            inside, gone = request("detail", 1), request("detail", 2)
            f.slots.hand(inside, await f.locks.acquire("detail", None))
            f.slots.hand(gone, await f.locks.acquire("detail", None))
            f.active.add(inside)
            # No await from here to the second sweep: no renewal tick of the process can run in
            # between.
            f.slots.sweep()
            assert f.slots.take(gone) is not None  # one tick out of the downloader is not enough
            f.slots.sweep()
            assert f.slots.take(gone) is None
            assert f.slots.take(inside) is not None
            await until(lambda: leftover(redis_client) == 1)
            f.active.discard(inside)

    asyncio.run(scenario())


def test_a_freed_slot_is_kept_for_a_queued_request_without_redis_and_keeps_its_grant(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Within REDISLOCK_LOCAL_REUSE the slot is kept for a queued request in the finish call itself
    (no await: no Redis round trip), the same grant stays held in Redis, and the fence is the
    grant's."""

    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, scheduler=False, REDISLOCK_LOCAL_REUSE=30) as f:
            f.slots.serve_scheduler(queued=lambda stage: 1, could_use=lambda stage: 1)
            permit = await f.locks.acquire("detail", None)
            one = request("detail", 1)
            f.slots.hand(one, permit)
            f.slots.finish(one)
            assert f.slots.kept.count("detail") == 1
            assert held(redis_client, "detail") == [permit.grant]
            assert permit.fence == int(permit.grant.split("-")[1])
            assert f.crawler.stats.get_value("redislock/detail/reused") == 1
            assert f.slots.kept.take("detail") is permit
            await f.locks.release(permit)
            assert leftover(redis_client) == 0

    asyncio.run(scenario())


def test_an_older_slot_goes_back_to_redis_and_one_no_queued_request_could_use_too(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Past REDISLOCK_LOCAL_REUSE since Redis's grant, or when no queued request could use it, the
    slot is released to Redis."""

    async def scenario() -> None:
        async with front(
            redis_url, {"detail": 1}, scheduler=False, REDISLOCK_LOCAL_REUSE=0.05
        ) as f:
            wanted = [1]
            f.slots.serve_scheduler(queued=lambda stage: 1, could_use=lambda stage: wanted[0])
            permit = await f.locks.acquire("detail", None)
            await until(lambda: time.monotonic() - permit.acquired_at > 0.05)
            f.slots.lines.free(permit)
            assert f.slots.kept.count("detail") == 0
            await until(lambda: leftover(redis_client) == 0)

            wanted[0] = 0
            permit = await f.locks.acquire("detail", None)
            f.slots.lines.free(permit)
            assert f.slots.kept.count("detail") == 0
            await until(lambda: leftover(redis_client) == 0)
            assert f.crawler.stats.get_value("redislock/detail/reused") is None

    asyncio.run(scenario())


def test_kept_slots_beyond_what_the_queued_requests_could_use_go_back_at_the_tick(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The tick's prune keeps, oldest first, as many kept slots as the stage's queued requests
    could use now, and gives the rest back to Redis."""

    async def scenario() -> None:
        async with front(redis_url, {"detail": 2}, scheduler=False, REDISLOCK_LOCAL_REUSE=30) as f:
            wanted = [2]
            f.slots.serve_scheduler(queued=lambda stage: 2, could_use=lambda stage: wanted[0])
            first = await f.locks.acquire("detail", None)
            second = await f.locks.acquire("detail", None)
            f.slots.lines.free(first)
            f.slots.lines.free(second)
            assert f.slots.kept.outcomes("detail") == (first, second)
            wanted[0] = 1
            f.slots.kept.prune()
            assert f.slots.kept.outcomes("detail") == (first,)
            await until(lambda: held(redis_client, "detail") == [first.grant])
            wanted[0] = 0
            f.slots.kept.prune()
            assert f.slots.kept.count("detail") == 0
            await until(lambda: leftover(redis_client) == 0)

    asyncio.run(scenario())


def test_a_slot_past_its_lease_is_not_taken(redis_url: str, redis_client: redis.Redis) -> None:
    """Its lease ran out unrenewed on this process's clock (a stall, a partition): take() drops it
    (back to Redis) and the request waits for another. No await between the clock check and take():
    no renewal can move it."""

    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, scheduler=False) as f:
            permit = await f.locks.acquire("detail", None)
            one = request("detail", 1)
            f.slots.hand(one, permit)
            permit.valid_until = time.monotonic()
            assert f.slots.take(one) is None
            assert f.slots.take(one) is None  # dropped, not handed later
            assert f.crawler.stats.get_value("redislock/detail/unusable") == 1
            await until(lambda: leftover(redis_client) == 0)

    asyncio.run(scenario())


def test_a_slot_past_its_lease_is_not_passed_on(redis_url: str, redis_client: redis.Redis) -> None:
    async def scenario() -> None:
        async with front(redis_url, {"detail": 1}, scheduler=False, REDISLOCK_LOCAL_REUSE=30) as f:
            f.slots.serve_scheduler(queued=lambda stage: 1, could_use=lambda stage: 1)
            permit = await f.locks.acquire("detail", None)
            one = request("detail", 1)
            f.slots.hold(one, permit)
            permit.valid_until = time.monotonic()
            f.slots.finish(one)
            assert f.slots.kept.count("detail") == 0
            assert f.crawler.stats.get_value("redislock/detail/unusable") == 1
            assert f.crawler.stats.get_value("redislock/detail/reused") is None
            await until(lambda: leftover(redis_client) == 0)

    asyncio.run(scenario())


# -- the way to a stage's first grant ------------------------------------------------------------


def script_names() -> dict[str, str]:
    """sha1 of each lock script (with and without its Lua flags: Redis 6.2) -> its name; FCALL's
    function is ``redislock_<sha1>``."""
    names = {}
    for name, source in lock_scripts().items():
        for variant in (source, without_flags(source)):
            names[hashlib.sha1(variant.encode()).hexdigest()] = name
    return names


def lock_commands(raw: bytes, but: str | None = None) -> list[tuple[str, str]]:
    """(connection, what) of the scripts (by name), blocking reads, script loads and PINGs clients
    sent, in order, from MONITOR's lines; with ``but``, not those of the connections that named
    that owner."""
    names = script_names()
    lines = [(source, args) for _, source, args in commands(raw) if source != "lua"]
    others = {s for s, args in lines if but and any(but.encode() in arg for arg in args)}
    sent = []
    for source, args in lines:
        command = args[0].decode().lower()
        if source in others:
            continue
        if command in ("evalsha", "fcall"):
            sent.append((source, names.get(args[1].decode().removeprefix("redislock_"), "?")))
        elif command in ("xreadgroup", "script", "ping"):
            sent.append((source, command))
    return sent


def test_a_stage_with_a_free_slot_is_granted_by_a_take_on_its_way_to_the_first_grant(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """From the start to the first grant, one script after another, each waiting for the one before:
    the limits, the first renewal, a take (its reply is the owner's word: no guard, blocking read
    and confirmation, three round trips where a take is one), and no script loaded on the way (the
    start loads them with its first PING)."""
    port = redis_client.connection_pool.connection_kwargs["port"]
    monitor = Monitor(port)

    async def scenario() -> None:
        async with front(redis_url, {"detail": 3}, scheduler=False) as f:
            permit = await f.slots.lines.wait("detail", None)  # the line looks first
            assert held(redis_client, "detail") == [permit.grant]
            sent = lock_commands(monitor.stop(redis_client))
            names = [name for _, name in sent]
            # a named user's first script goes as EVALSHA, refused, then as FCALL (REDISLOCK_TEST_ACL)
            scripts = [
                name
                for i, name in enumerate(names)
                if name not in ("script", "ping") and name not in names[i - 1 : i]
            ]
            assert scripts[:3] == ["set_limit", "maintain", "take"], names
            assert not {"guard", "xreadgroup", "hold_again"} & set(names), names
            start = names.index("set_limit")
            # every SCRIPT LOAD (none with REDISLOCK_TEST_ACL) went in the start's pipeline
            assert "script" not in names[start:], names
            # and the take's connection was opened then, beside it (not on the take's way while
            # the start's report of why stages wait reads on the first)
            took_on = next(source for source, name in sent if name == "take")
            assert took_on in {source for source, _ in sent[:start]}, sent
            await f.locks.release(permit)

    asyncio.run(scenario())


def test_a_stage_another_process_is_at_is_waited_for_in_the_line_with_no_take_in_front(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Another owner alive at the stage when this process's first renewal of it ran (at start): its
    slots may all be held, and a look would be a round trip and a take more; the wait joins the
    line in Redis at once (a blocking read, the grant confirmed)."""
    port = redis_client.connection_pool.connection_kwargs["port"]
    holder = CountingLock(redis_client, "detail", limit=1, ttl=3)
    try:
        holding = holder.acquire(timeout=5)  # the stage is full
        monitor = Monitor(port)

        async def scenario() -> list[str]:
            async with front(redis_url, {"detail": 1}, scheduler=False) as f:
                lock = f.locks.locks["detail"]
                wait = asyncio.ensure_future(f.slots.lines.wait("detail", None))
                await until(lambda: lock.busy)
                holder.release(holding)
                await f.locks.release(await wait)
                return [name for _, name in lock_commands(monitor.stop(redis_client), holder.owner)]

        sent = asyncio.run(scenario())
        assert "take" not in sent, sent
        assert sent.count("xreadgroup") == 1 and sent.count("hold_again") == 1, sent
    finally:
        holder.close()


def test_a_stage_found_full_by_a_look_is_looked_at_once_then_its_waits_join_the_line(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Nobody else at the stage at start, but another process took every slot since: the look
    costs one take, once; the wait that found the stage full and every later one are served through
    the line in Redis (a blocking read, the grant confirmed), with no take in front."""
    port = redis_client.connection_pool.connection_kwargs["port"]
    holder = CountingLock(redis_client, "detail", limit=1, ttl=3)
    try:
        monitor = Monitor(port)

        async def scenario() -> list[str]:
            async with front(redis_url, {"detail": 1}, scheduler=False) as f:
                lock = f.locks.locks["detail"]
                for _ in range(2):
                    holding = holder.acquire(timeout=5)  # the stage is full
                    wait = asyncio.ensure_future(f.slots.lines.wait("detail", None))
                    await until(lambda: "detail" in f.locks.looked_full and lock.busy)
                    holder.release(holding)
                    await f.locks.release(await wait)
                return [name for _, name in lock_commands(monitor.stop(redis_client), holder.owner)]

        sent = asyncio.run(scenario())
        assert sent.count("take") == 1, sent
        assert sent.count("xreadgroup") == 2 and sent.count("hold_again") == 2, sent
        assert sent.index("take") < sent.index("xreadgroup"), sent
    finally:
        holder.close()


def test_a_look_under_way_when_the_locks_close_is_cancelled_with_the_waits(
    redis_proxy: Callable[[], LatencyProxy], redis_client: redis.Redis
) -> None:
    """A line's look (its take before a wait) has taken a slot in Redis, its reply still on the way,
    when the locks close: the look is cancelled as a wait is, and close frees the slot. Nothing
    goes to the request waiting in the line (a look once ran outside the waits close cancels: the
    request got the slot close had freed)."""
    proxy = redis_proxy()
    monitor = Monitor(redis_client.connection_pool.connection_kwargs["port"])

    async def scenario() -> None:
        async with front(proxy.url, {"detail": 1}, scheduler=False) as f:
            proxy.down = 2.0  # Redis's replies come 2 s after it ran the command
            waiter = asyncio.ensure_future(f.slots.lines.wait("detail", None))
            await until(lambda: bool(held(redis_client, "detail")))  # the look took it in Redis
            assert not waiter.done()
            await f.locks.close()
            await until(waiter.done)
            assert waiter.cancelled(), waiter
            assert held(redis_client, "detail") == []

    asyncio.run(scenario())
    sent = [name for _, name in lock_commands(monitor.stop(redis_client))]
    assert "take" in sent and "xreadgroup" not in sent, sent  # a look, not a wait in the line


def test_the_keys_registry_uses_the_stages_clients_and_the_last_to_close_closes_them(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """One pool of connections per process for stage and key slots: the keys' registry borrows the
    request stages' clients. StageScheduler closes the stages' registry before the middleware
    closes the keys': the clients stay open for the keys' until then, and are closed after."""

    async def scenario() -> None:
        before = len(redis_client.client_list())
        settings = {"REDISLOCK_STAGE_KEY": "domain", "REDISLOCK_KEY_LIMIT": 1}
        async with front(redis_url, {"detail": 1}, scheduler=False, **settings) as f:
            throttle = f.middleware.throttle
            assert throttle is not None
            keys = throttle.locks
            assert keys.deployment is f.locks.deployment and keys.client is f.locks.client
            assert await keys.start_once()  # as spider_opened would
            first = request("detail", 1)
            await asyncio.wait_for(f.send(first), 10)
            assert [p.name for _, p in f.slots.held(first)] == ["detail", "key:127.0.0.1"]
            f.middleware.request_left(first, f.crawler.spider)
            f.active.discard(first)
            await until(lambda: leftover(redis_client) == 0)
            await f.locks.close()  # the stages' registry first, as StageScheduler closes it
            opened = connections_received(redis_client)
            assert await keys.client.ping()  # still the keys', open: no connection made again
            assert await keys.take("127.0.0.1") is not None
            assert connections_received(redis_client) == opened
            await throttle.close()  # the last: its key slot freed, then the clients go
            await until(lambda: len(redis_client.client_list()) <= before)
            assert not list(redis_client.scan_iter("redislock:*key:*"))  # retired: nothing left

    asyncio.run(scenario())


def connections_received(client: redis.Redis) -> int:
    """Connections Redis accepted so far (this one's INFO is on a connection made already)."""
    return int(client.info("stats")["total_connections_received"])


def test_a_lease_bound_copied_with_another_requests_meta_gives_way() -> None:
    """A capped request's download_timeout is bounded by its slot's lease, its own kept in meta. A
    request that copies its meta (``response.follow(url, meta=response.meta)``) is not bound by
    it: holding no slot, it gets the timeout the first request had of its own; given a timeout of
    its own, that is its own (the first's own once won); a retry, which copies meta, starts from
    the first's own again."""
    first = Request("http://shop.test/list/1")
    assert within_lease(first, 29.5, 180.0)
    assert first.meta["download_timeout"] == 29.5
    uncapped = Request("http://shop.test/other", meta=dict(first.meta))
    out_of_lease(uncapped)
    assert uncapped.meta == {"download_timeout": 180.0}
    given = Request("http://shop.test/big", meta={**first.meta, "download_timeout": 600})
    within_lease(given, 1000.0, 180.0)
    assert given.meta["download_timeout"] == 600.0
    retry = first.replace()  # RetryMiddleware's copy
    within_lease(retry, 100.0, 180.0)
    assert retry.meta["download_timeout"] == 100.0
    assert not within_lease(retry, 1000.0, 180.0)
    assert retry.meta["download_timeout"] == 180.0
    plain = Request("http://shop.test/plain", meta={"download_timeout": 5})
    out_of_lease(plain)  # nothing of ours: left as it is
    assert plain.meta == {"download_timeout": 5}
