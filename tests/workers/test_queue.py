"""The per-stage Redis queues of the worker mixin (StageQueues) against a real redis-server, without
Scrapy crawls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import pytest
import redis
import redis.asyncio
import scrapy
from scrapy.utils.test import get_crawler
from scrapy_redis.queue import FifoQueue

from scrapy_redislock.crawl import requestformat
from scrapy_redislock.errors import ConfigError
from scrapy_redislock.workers.queue import QueueKeys, StageQueues, queue_order, requeue_now
from scrapy_redislock.workers.scheduler import StageWorkerScheduler
from scrapy_redislock.workers.status import dead_letters, spider_status, spiders_in
from testing.lockstate import queued
from testing.netproxy import LatencyProxy
from testing.spiders.workerspider import StagedSpider
from testing.waiting import until

pytestmark = pytest.mark.integration

STAGES = ["list", "detail", "comments"]


def run(url: str, scenario: Callable[[Callable[..., StageQueues]], Awaitable[None]]) -> None:
    """Run a scenario with a factory of worker handles on one asyncio client."""

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(url)
        try:

            def worker(name: str, stages: list[str] = STAGES, ttl: float = 30.0) -> StageQueues:
                return StageQueues(client, "shop", stages, ttl=ttl, worker=name)

            await scenario(worker)
        finally:
            await client.aclose()

    asyncio.run(main())


def test_keys_share_the_spider_hash_tag() -> None:
    keys = QueueKeys.of("redislock", "shop")
    for key in (
        keys.dupefilter,
        keys.alive,
        keys.working,
        keys.ids,
        keys.queue("detail"),
        keys.inflight("h:1:a"),
    ):
        assert key.startswith("redislock:{shop}:"), key


def test_a_queue_going_from_empty_to_non_empty_puts_one_token_on_its_signal(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a = worker("a")
        await a.beat(None)
        signal = a.keys.signal("detail")
        await a.push_many([("detail", "", b"r0"), ("detail", "", b"r1")])
        await a.push("detail", "", b"r2")  # not empty before: no second token
        assert redis_client.lrange(signal, 0, -1) == [b"1"]
        assert redis_client.llen(a.keys.signal("comments")) == 0
        # A woken worker that pops a full batch hands the token on (the queue may hold more); a
        # short pop does not.
        redis_client.delete(signal)
        assert len(await a.pop("detail", 2, pass_on=True)) == 2
        assert redis_client.llen(signal) == 1
        redis_client.delete(signal)
        assert len(await a.pop("detail", 5, pass_on=True)) == 1
        assert redis_client.llen(signal) == 0
        # An idle worker blocked on the signals is served at once.
        waiter = asyncio.ensure_future(
            a.blocking.wait([signal, a.keys.signal("comments"), a.keys.wake], 30)
        )
        await asyncio.sleep(0.05)
        await a.push("comments", "", b"c0")
        assert await asyncio.wait_for(waiter, 5) == (a.keys.signal("comments"), b"1")
        await a.aclose()

    run(redis_url, scenario)


def test_the_ack_that_ends_the_crawl_wakes_every_worker_and_a_beat_names_the_dead(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a, b, c = worker("a"), worker("b"), worker("c")
        for handle in (a, b, c):
            await handle.beat(None)
        await a.push_many([("detail", "", b"r0"), ("comments", "", b"r1")])
        first = await a.pop("detail", 1)
        second = await b.pop("comments", 1)
        assert first and second and await a.in_flight() == 2
        await a.ack([first[0][0]])
        assert redis_client.llen(a.keys.wake) == 0  # b still has one in flight
        await b.ack([second[0][0]])
        assert redis_client.llen(a.keys.wake) == 3  # one token per registered worker
        assert await a.in_flight() == 0
        # The heartbeat names workers silent for the TTL; reaping them takes one script each.
        redis_client.zadd(a.keys.alive, {"c": 0})
        redis_client.zadd(a.keys.due, {"c": 0})  # its deadline long past
        new, holds, dead = await a.heartbeat(None)
        assert not new and holds == 0 and dead == ["c"]
        assert await a.reap(dead) == {"c": 0}
        assert redis_client.zscore(a.keys.alive, "c") is None

    run(redis_url, scenario)


def test_a_pop_whose_reply_was_lost_is_found_by_the_beat_and_given_back(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A pop ran in Redis but its reply never reached the worker (a failover): the beat says the
    in-flight record holds more than the worker knows of, and reclaim gives back exactly those, to
    the front of their queues, oldest first; what the worker knows of stays, and the in-flight
    counter counts what is left."""

    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a = worker("a")
        await a.beat(None)
        await a.push_many(
            [("detail", "", f"d{n}".encode()) for n in range(6)] + [("comments", "", b"c0")]
        )
        known = await a.pop("detail", 2)  # d0, d1: the worker has them
        assert (await a.heartbeat("detail")).holds == 2
        lost = await a.pop("detail", 2) + await a.pop("comments", 1)  # d2, d3, c0: replies "lost"
        assert (await a.heartbeat("detail")).holds == 5 and await a.in_flight() == 5
        redis_client.delete(a.keys.signal("comments"))  # its token was taken
        assert await a.reclaim([i for i, _ in known]) == 3
        assert (await a.heartbeat("detail")).holds == 2 and await a.in_flight() == 2
        # back at the front, in order
        assert [d for _, d in await a.pop("detail", 3)] == [b"d2", b"d3", b"d4"]
        assert [d for _, d in await a.pop("comments", 1)] == [b"c0"]
        # its queue was empty: an idle worker is told
        assert redis_client.llen(a.keys.signal("comments")) == 1
        # nothing known but d0, d1
        assert len(lost) == 3 and await a.reclaim([i for i, _ in known]) == 4
        assert await a.ack([i for i, _ in known]) == 2 and await a.in_flight() == 0

    run(redis_url, scenario)


def test_the_dupefilter_is_shared_by_workers_and_stages(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a, b = worker("a"), worker("b")
        assert await a.push("detail", "fp1", b"r1")
        assert not await b.push("detail", "fp1", b"r1 again")  # another worker, same fingerprint
        # another stage, same fingerprint
        assert not await b.push("comments", "fp1", b"r1 elsewhere")
        assert await b.push("detail", "", b"unfiltered")
        assert await b.push("detail", "", b"unfiltered")  # dont_filter: queued every time
        assert await a.seen("fp1")
        assert not await a.seen("fp2") and await a.seen("fp2")  # seen() records the fingerprint
        assert (await a.look())[0] == {"list": 0, "detail": 3, "comments": 0}

    run(redis_url, scenario)


def test_a_kept_request_with_no_stage_is_in_the_record_with_its_fingerprint_and_goes_home(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """queue_keep (issue 39): a request with no stage enters the worker's in-flight record together
    with its fingerprint; a dead worker's kept requests go to the front of their home stage's queue
    (at their priority's head in the sorted set); an unregistered worker's go there at once."""
    keys = QueueKeys.of("redislock", "shop")

    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a, b = worker("a", ttl=0.05), worker("b")
        await a.beat("detail")
        await a.push("detail", "", b"queued before")
        marks = [a.mark(0), a.mark(5)]
        assert marks == ["", "{P-5:0000000000000000}"]
        ids = await a.keep("detail", [("fp1", marks[0], b"r1"), ("fp2", marks[1], b"r2")])
        assert all(n > 0 for n in ids) and await a.in_flight() == 2
        assert await b.keep("list", [("fp1", "", b"r1 again"), ("fp3", "", b"")]) == [0, -1]
        assert await b.seen("fp3")  # recorded, though only in memory
        assert (await a.look())[0]["detail"] == 1
        await asyncio.sleep(0.1)
        assert await b.reap([a.worker]) == {a.worker: 2}
        popped = await b.pop("detail", 3) if await b.beat("detail") else None
        assert [data for _, data in popped or []] == [b"r2", b"r1", b"queued before"]
        # a worker taken for dead (not registered) queues them in its home stage at once
        assert await a.keep("list", [("fp4", "", b"r4")]) == [-2]
        assert redis_client.lrange(keys.queue("list"), 0, -1) == [b"r4"]
        assert redis_client.llen(keys.signal("list")) == 1

    run(redis_url, scenario)


def test_fifo_pop_into_the_in_flight_record_and_ack(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a = worker("a")
        for n in range(4):
            await a.push("detail", f"fp{n}", f"r{n}".encode())
        assert await a.beat("detail")  # registers: True the first time
        assert not await a.beat("detail")
        registered = redis_client.zscore(a.keys.due, "a")
        await asyncio.sleep(0.01)
        popped = await a.pop("detail", 3)
        assert [data for _, data in popped] == [b"r0", b"r1", b"r2"]
        assert redis_client.hlen(a.inflight_key) == 3
        # a pop is a sign of life: its deadline moves
        assert redis_client.zscore(a.keys.due, "a") > registered
        assert await a.in_flight() == 3  # the scripts' counter, read instead of every worker's hash
        assert await a.ack([popped[0][0], popped[1][0]]) == 2
        assert await a.ack([popped[0][0]]) == 0
        assert redis_client.hlen(a.inflight_key) == 1
        assert await a.in_flight() == 1
        # Given back (a lost slot): to the front, in the order they were popped.
        assert await a.give_back([popped[2][0]]) == 1
        assert await a.in_flight() == 0
        assert [data for _, data in await a.pop("detail", 5)] == [b"r2", b"r3"]
        assert await a.in_flight() == 2

    run(redis_url, scenario)


def test_a_silent_worker_is_reaped_by_the_others_and_a_beating_one_is_not(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario(worker: Callable[..., StageQueues]) -> None:
        ttl = 1.0  # a beating worker outlasts a busy machine's stall by well over 0.5 s
        dead, alive, other = (
            worker("dead", ttl=ttl),
            worker("alive", ttl=ttl),
            worker("other", ttl=ttl),
        )
        for n in range(6):
            await other.push("detail" if n < 4 else "comments", f"fp{n}", f"r{n}".encode())
        for handle in (dead, alive, other):
            await handle.beat("detail")
        taken = await dead.pop("detail", 2)  # r0, r1
        await dead.pop("comments", 1)  # r4
        await alive.pop("detail", 1)  # r2
        assert await other.reap() == {}  # nobody silent yet
        deadline = time.monotonic() + 2 * ttl
        while time.monotonic() < deadline:  # "alive" beats, "dead" does not
            await alive.beat("detail")
            await asyncio.sleep(0.05)
        assert await other.reap() == {"dead": 3}
        assert redis_client.exists(dead.inflight_key) == 0
        assert redis_client.zscore(dead.keys.alive, "dead") is None
        assert redis_client.hget(dead.keys.working, "dead") is None
        assert redis_client.hlen(alive.inflight_key) == 1
        # Back at the front, oldest first: the next pops get them before the rest of the queue.
        assert [d for _, d in await other.pop("detail", 3)] == [d for _, d in taken] + [b"r3"]
        assert [d for _, d in await other.pop("comments", 2)] == [b"r4", b"r5"]
        await asyncio.sleep(ttl + 0.05)
        await other.beat("detail")
        assert await other.reap() == {"alive": 1}  # stopped beating meanwhile
        assert await alive.beat("detail")  # it learns that it was taken for dead
        # its request is back in the queue
        assert [d for _, d in await alive.pop("detail", 1)] == [b"r2"]

    run(redis_url, scenario)


def test_leave_gives_back_the_unfinished_and_unregisters(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a, b = worker("a"), worker("b")
        for n in range(3):
            await a.push("list", f"fp{n}", f"r{n}".encode())
        await a.beat("list")
        popped = await a.pop("list", 3)
        await a.ack([popped[0][0]])
        assert await a.leave() == 2
        assert redis_client.exists(a.inflight_key, a.keys.alive) == 0
        await b.beat("list")
        assert [d for _, d in await b.pop("list", 5)] == [b"r1", b"r2"]

    run(redis_url, scenario)


def test_requests_of_a_stage_the_reaper_does_not_know_stay(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario(worker: Callable[..., StageQueues]) -> None:
        dead = worker("dead", ttl=0.2)
        await dead.beat(None)
        await dead.push("list", "fp0", b"r0")
        await dead.push("comments", "fp1", b"r1")
        await dead.pop("list", 1)
        await dead.pop("comments", 1)
        await asyncio.sleep(0.3)
        reaper = worker("reaper", stages=["list"], ttl=0.2)
        assert await reaper.reap() == {"dead": 1}
        # not dropped: kept for a worker that knows "comments"
        assert redis_client.hlen(dead.inflight_key) == 1

    run(redis_url, scenario)


def test_clear_only_when_no_other_worker_is_alive(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """SCHEDULER_PERSIST = False / SCHEDULER_FLUSH_ON_START: never delete what a live worker works
    on."""

    async def scenario(worker: Callable[..., StageQueues]) -> None:
        ttl = 1.0  # "dead" still counts as alive for one TTL: long enough to outlast a busy machine's stall
        a, b, dead = worker("a", ttl=ttl), worker("b", ttl=ttl), worker("dead", ttl=ttl)
        await dead.push("detail", "fp0", b"r0")
        await dead.push("detail", "fp1", b"r1")
        await dead.beat("detail")
        await dead.pop("detail", 1)
        await a.beat("detail")
        await b.beat("detail")
        assert not await a.clear_if_alone()
        assert (
            redis_client.llen(a.keys.queue("detail")) == 1
            and redis_client.scard(a.keys.dupefilter) == 2
        )
        await b.leave()
        assert not await a.clear_if_alone()  # "dead" still counts as alive for one TTL
        await asyncio.sleep(ttl + 0.1)
        await a.beat(None)
        assert await a.clear_if_alone()
        # queues, dupefilter, dead worker's record: all gone
        assert redis_client.keys("redislock:{shop}:*") == []

    run(redis_url, scenario)


def test_the_stage_queues_are_scrapy_redis_fifo_queues(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Same layout as scrapy-redis: its FifoQueue class reads a stage queue (e.g. to inspect or
    migrate it), with the safe request format as its SCHEDULER_SERIALIZER."""
    spider = scrapy.Spider(name="shop")
    requests = [
        scrapy.Request(f"http://shop.test/detail/{n}", meta={"redislock_stage": "detail"})
        for n in range(3)
    ]

    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a = worker("a")
        for n, request in enumerate(requests):
            await a.push("detail", f"fp{n}", requestformat.dumps(request.to_dict(spider=spider)))

    run(redis_url, scenario)
    key = QueueKeys.of("redislock", "shop").queue("detail")
    queue = FifoQueue(redis_client, spider, key, serializer=requestformat)  # SCHEDULER_SERIALIZER
    assert len(queue) == 3
    popped = [queue.pop() for _ in range(3)]
    assert [r.url for r in popped] == [r.url for r in requests]
    assert popped[0].meta["redislock_stage"] == "detail"


# -- a worker taken for dead that pops before it beats (issue 17, finding 11) ----------------------


def stall(client: redis.Redis, queues: StageQueues) -> None:
    """The worker's last beat is long past (a stall longer than the TTL), without waiting for it."""
    client.zadd(queues.keys.alive, {queues.worker: 0}, xx=True)
    client.zadd(queues.keys.due, {queues.worker: 0}, xx=True)


def test_a_worker_taken_for_dead_cannot_pop_until_it_beats(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario(worker: Callable[..., StageQueues]) -> None:
        stalled, reaper = worker("stalled"), worker("reaper")
        for n in range(4):
            await reaper.push("detail", f"fp{n}", f"r{n}".encode())
        await stalled.beat("detail")
        await reaper.beat("detail")
        assert len(await stalled.pop("detail", 2) or []) == 2
        stall(redis_client, stalled)
        assert await reaper.reap() == {"stalled": 2}
        # Resumed in its fill step, before its beat: refused, nothing moves into a record nobody
        # watches.
        assert await stalled.pop("detail", 2) is None
        assert redis_client.exists(stalled.inflight_key) == 0 and (await reaper.look())[0] == {
            "list": 0,
            "detail": 4,
            "comments": 0,
        }
        assert await stalled.beat("detail")  # it learns it was taken for dead ...
        # ... and pops again
        assert [d for _, d in await stalled.pop("detail", 2) or []] == [b"r0", b"r1"]

    run(redis_url, scenario)


def worker_scheduler(redis_url: str) -> StageWorkerScheduler:
    """A worker of stage ``a`` (CONCURRENT_REQUESTS 2) over an engine that is not started: the
    scheduler only pokes it, and nothing is in progress there."""
    crawler = get_crawler(StagedSpider, {"REDIS_URL": redis_url, "REDISLOCK_WORKER_STAGES": {"a": None},
                                         "CONCURRENT_REQUESTS": 2})  # fmt: skip
    crawler.spider = crawler._create_spider()
    crawler.engine = crawler._create_engine()
    scheduler = StageWorkerScheduler.from_crawler(crawler)
    scheduler.spider = crawler.spider
    return scheduler


async def push_named(
    queues: StageQueues, scheduler: StageWorkerScheduler, name: str, n: int
) -> None:
    """Queue ``n`` requests of stage ``a`` named ``/<name>/<i>``."""
    for i in range(n):
        request = scrapy.Request(f"http://shop.test/{name}/{i}", meta={"redislock_stage": "a"})
        await queues.push("a", "", scheduler.encode(request))


async def working_on_a(queues: StageQueues, scheduler: StageWorkerScheduler, n: int) -> int:
    """``n`` requests "old" queued, the worker registered and on stage ``a``; how many it popped."""
    await push_named(queues, scheduler, "old", n)
    await scheduler.heartbeat.beat("a")
    scheduler.state.current = "a"
    return await scheduler.loop.fill()


def test_the_scheduler_strands_nothing_when_it_pops_just_after_being_taken_for_dead(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The order of the review's reproduction, forced: the worker takes requests ahead, stalls, is
    reaped, then its loop resumes in its fill step (which pops) before it beats. Every request must
    end up either in the queue or in the worker's buffer with its in-flight id, never in an
    in-flight record nobody will requeue."""
    urls = [f"http://shop.test/a/{n}" for n in range(3)]

    async def main() -> None:
        scheduler = worker_scheduler(redis_url)
        client = scheduler.queues.client
        reaper = StageQueues(client, "staged", ["a"], worker="reaper")
        try:
            await reaper.beat("a")
            for url in urls:
                request = scrapy.Request(url, meta={"redislock_stage": "a"})
                await reaper.push("a", "", scheduler.encode(request))
            scheduler.state.current = "a"
            await scheduler.queues.beat("a")
            # taken ahead (room for 2 x CONCURRENT_REQUESTS = 4)
            assert await scheduler.loop.fill() == 3
            stall(redis_client, scheduler.queues)
            assert await reaper.reap() == {scheduler.worker: 3}
            await scheduler.loop.fill()  # the loop resumes here, before its beat
            await scheduler.heartbeat.beat("a")
            buffered = {
                inflight_id: request.url for request, inflight_id in scheduler.inflight.buffer
            }
            recorded = {
                str(k.decode()): v
                for k, v in redis_client.hgetall(scheduler.queues.inflight_key).items()
            }
            queued = redis_client.llen(scheduler.queues.keys.queue("a"))
            assert set(recorded) == set(buffered), (
                f"stranded in {scheduler.queues.inflight_key}: {recorded}"
            )
            assert len(set(buffered.values())) + queued == len(urls)
        finally:
            await client.aclose()

    asyncio.run(main())


def test_requests_in_progress_when_redis_lost_the_state_never_ack_the_new_records_ids(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Redis lost the crawl state (a restart without persistence, FLUSHALL) while this worker had
    three requests in progress: the new record's ids start again from 1, and the new requests it
    pops get the ids the old ones had. When the old ones finish, their acks must not drop the new
    entries: they did, the in-flight counter fell to 0 (the crawl could read as ended), and the new
    requests could not be given back."""

    async def main() -> None:
        scheduler = worker_scheduler(redis_url)
        queues, inflight = scheduler.queues, scheduler.inflight
        try:
            assert await working_on_a(queues, scheduler, 3) == 3
            old = [inflight.hand() for _ in range(3)]
            assert all(old)
            redis_client.flushall()  # Redis lost the crawl state
            await push_named(queues, scheduler, "new", 3)
            await scheduler.heartbeat.beat("a")  # reads another epoch
            assert scheduler.heartbeat.lost
            assert await scheduler.loop.fill() == 3
            new_ids = {inflight_id for _, inflight_id in inflight.buffer}
            inflight.ack_finished()  # the old ones are done (none in progress in the engine)
            await asyncio.gather(*inflight.tasks)
            recorded = {k.decode() for k in redis_client.hgetall(queues.inflight_key)}
            assert recorded == new_ids
            assert int(redis_client.get(queues.keys.in_flight) or 0) == 3
            assert await inflight.give_back_ahead() == 3
            assert redis_client.llen(queues.keys.queue("a")) == 3
        finally:
            await queues.client.aclose()

    asyncio.run(main())


def test_an_ack_whose_reply_was_lost_leaves_the_count_of_what_the_worker_holds_right_at_its_next_beat(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A worker's ack ran in Redis and its reply was lost; the ack sent again drops nothing, so the
    worker went on counting the requests as its own. Another worker's two requests in flight then
    read as this worker's (the cluster's counter was not above its own), and an idle worker could
    close while work was still in progress elsewhere. The next beat counts them again from the
    record."""

    async def main() -> None:
        scheduler = worker_scheduler(redis_url)
        queues, inflight = scheduler.queues, scheduler.inflight
        other = StageQueues(queues.client, "staged", ["a"], worker="other")
        try:
            for n in range(8):
                request = scrapy.Request(f"http://shop.test/a/{n}", meta={"redislock_stage": "a"})
                await queues.push("a", "", scheduler.encode(request))
            await scheduler.heartbeat.beat("a")
            scheduler.state.current = "a"
            popped = await scheduler.loop.fill()
            assert 0 < popped <= 6 and inflight.own == popped
            await other.beat("a")
            assert len(await other.pop("a", 2) or []) == 2
            handed = [inflight.hand() for _ in range(popped)]
            ids = [inflight.handed[request] for request in handed if request is not None]
            # the first ack: it ran in Redis, its reply lost
            assert await queues.ack(ids) == popped
            inflight.ack_finished()  # sent again: it drops nothing
            await asyncio.gather(*inflight.tasks)
            assert inflight.own == popped  # what the lost reply left behind
            await scheduler.heartbeat.beat("a")
            assert inflight.own == 0
            assert await queues.in_flight() == 2 > inflight.own  # the other's: work in progress
        finally:
            await queues.client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("acking", [False, True], ids=["quiet", "an-ack-under-way"])
def test_requests_a_beat_gives_back_are_not_counted_as_held(
    redis_url: str, redis_client: redis.Redis, acking: bool
) -> None:
    """A pop ran in Redis and its reply was lost: the beat finds more in the record than the worker
    knows of, and gives those back. What the worker holds is then the record's length again,
    whether the beat counted the record (quiet) or not (an ack under way: it went below 0)."""

    async def main() -> None:
        scheduler = worker_scheduler(redis_url)
        queues, inflight = scheduler.queues, scheduler.inflight
        try:
            for n in range(4):
                request = scrapy.Request(f"http://shop.test/a/{n}", meta={"redislock_stage": "a"})
                await queues.push("a", "", scheduler.encode(request))
            await scheduler.heartbeat.beat("a")
            lost = await queues.pop("a", 2)  # its reply lost: the worker never had these
            assert lost is not None and len(lost) == 2 and inflight.own == 0
            if acking:
                inflight.tasks.add(asyncio.get_running_loop().create_future())  # never done
            await scheduler.heartbeat.beat("a")
            assert redis_client.hlen(queues.inflight_key) == 0 == inflight.own
            assert redis_client.llen(queues.keys.queue("a")) == 4
        finally:
            await queues.client.aclose()

    asyncio.run(main())


@pytest.mark.faults
def test_an_ack_retried_through_an_outage_in_which_redis_lost_the_state_drops_nothing_new(
    redis_url: str, redis_client: redis.Redis, redis_proxy: Callable[[], LatencyProxy]
) -> None:
    """A worker's ack of two finished requests gets no answer; meanwhile Redis loses the crawl
    state and the worker pops two new requests. The ack sent before the loss and delivered after
    it (a command a silent network held), and the ack retried once Redis answers, must not drop the
    new entries: the new state's ids start from Redis's clock, never at an id of the lost one
    (they started again from 1, so the two new entries had the two old ids)."""
    proxy = redis_proxy()
    port = urlsplit(redis_url).port
    proxied = redis_url.replace(f":{port}", f":{proxy.port}", 1) + "?socket_timeout=1"

    async def main() -> None:
        scheduler = worker_scheduler(proxied)
        queues, inflight = scheduler.queues, scheduler.inflight
        admin = redis.asyncio.Redis.from_url(redis_url)
        direct = StageQueues(admin, "staged", ["a"], worker=queues.worker)  # the worker, unproxied
        try:
            assert await working_on_a(direct, scheduler, 2) == 2
            old = {inflight.handed[r] for r in [inflight.hand(), inflight.hand()] if r is not None}
            proxy.blackhole()
            inflight.ack_finished()  # the ack gets no answer: retried after a back-off
            await until(lambda: scheduler.outage.down, 30, "the ack to fail")
            redis_client.flushall()  # Redis lost the crawl state
            inflight.detach()  # what the beat that reads another epoch does
            await push_named(direct, scheduler, "new", 2)
            await direct.beat("a")  # registered again in the new state
            new = await direct.pop("a", 2)
            assert new is not None and not {i for i, _ in new} & old  # ids of the new state's own
            # the ack sent before the loss, delivered after it (held by the network): nothing
            assert await direct.ack(sorted(old)) == 0
            proxy.heal()
            await asyncio.wait_for(asyncio.gather(*inflight.tasks), 30)
            assert redis_client.hlen(direct.inflight_key) == 2
            assert int(redis_client.get(direct.keys.in_flight) or 0) == 2
        finally:
            await admin.aclose()
            await queues.client.aclose()

    asyncio.run(main())


# -- batches of any size (review 2, finding e09: Lua's unpack stops at about 8000 values) ----------

BIG = 10_000  # 2 x CONCURRENT_REQUESTS 5000: well over what one unpack takes (2 values per popped request)


def test_one_pop_takes_10000_requests_and_records_every_one(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a = worker("a")
        await a.beat("detail")
        await a.push_many([("detail", "", f"r{n}".encode()) for n in range(BIG)])
        popped = await a.pop("detail", BIG)
        # FIFO
        assert popped is not None and [d for _, d in popped] == [
            f"r{n}".encode() for n in range(BIG)
        ]
        record = {k.decode(): v for k, v in redis_client.hgetall(a.inflight_key).items()}
        assert record == {i: b"detail\n" + d for i, d in popped}
        assert redis_client.llen(a.keys.queue("detail")) == 0 and await a.in_flight() == BIG

    run(redis_url, scenario)


def test_one_ack_drops_10000_ids(redis_url: str, redis_client: redis.Redis) -> None:
    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a = worker("a")
        await a.beat("detail")
        await a.push_many([("detail", "", f"r{n}".encode()) for n in range(BIG)])
        ids = [i for _ in range(5) for i, _ in await a.pop("detail", BIG // 5) or []]
        assert len(ids) == BIG and redis_client.hlen(a.inflight_key) == BIG
        assert await a.ack(ids) == BIG
        assert redis_client.exists(a.inflight_key) == 0 and await a.in_flight() == 0
        # the crawl has ended: the registered worker is told
        assert redis_client.llen(a.keys.wake) == 1

    run(redis_url, scenario)


def test_a_pop_that_cannot_record_leaves_the_queue_as_it_was(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Redis keeps what a script wrote before it failed: a pop must not take requests off the queue
    before they are in the in-flight record (here the record cannot be written: its key holds a
    string)."""

    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a = worker("a")
        await a.beat("detail")
        await a.push_many([("detail", "", f"r{n}".encode()) for n in range(3)])
        redis_client.set(a.inflight_key, "not a hash")
        with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
            await a.pop("detail", 2)
        assert redis_client.lrange(a.keys.queue("detail"), 0, -1) == [b"r2", b"r1", b"r0"]
        assert await a.in_flight() == 0
        redis_client.delete(a.inflight_key)
        assert [d for _, d in await a.pop("detail", 2) or []] == [b"r0", b"r1"]

    run(redis_url, scenario)


def test_clear_deletes_the_records_of_10000_registered_workers(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """One key per registered worker's in-flight record: a clear of a spider with many silent
    workers."""

    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a = worker("a")
        await a.push("detail", "fp0", b"r0")
        redis_client.zadd(a.keys.alive, {f"gone{n}": 0 for n in range(BIG)})  # silent for ever
        redis_client.hset(a.keys.inflight(f"gone{BIG - 1}"), "1", "detail\nr1")
        await a.beat(None)
        assert await a.clear_if_alone()
        assert redis_client.keys("redislock:{shop}:*") == []

    run(redis_url, scenario)


# -- the order of a stage queue: scrapy-redis's SCHEDULER_QUEUE_CLASS (issue 27, item 6) -----------

ORDERS = ["priority", "fifo", "lifo"]
# (name, priority) in push order; pushed in two calls, so that ties span calls too.
PUSHED = [
    ("a0", 0),
    ("b5", 5),
    ("c-5", -5),
    ("d5", 5),
    ("e0", 0),
    ("f10", 10),
    ("g-5", -5),
    ("h0", 0),
]
EXPECTED = {
    # scrapy-redis's PriorityQueue: higher priority first (score -priority); equal priorities in
    # push order.
    "priority": ["f10", "b5", "d5", "a0", "e0", "h0", "c-5", "g-5"],
    "fifo": [name for name, _ in PUSHED],  # FifoQueue ignores priorities
    "lifo": [name for name, _ in reversed(PUSHED)],  # LifoQueue too
}


async def push_pushed(queues: StageQueues, stage: str = "detail") -> None:
    entries = [(stage, "", name.encode(), priority) for name, priority in PUSHED]
    await queues.push_many(entries[:3])
    await queues.push_many(entries[3:])


def names(popped: list[tuple[str, bytes]] | None) -> list[str]:
    return [data.decode() for _, data in popped or []]


@pytest.mark.parametrize("order", ORDERS)
def test_each_order_pops_as_its_scrapy_redis_queue_and_counts_both_parts(
    redis_url: str, redis_client: redis.Redis, order: str
) -> None:
    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a = worker("a")
        a.order = order
        await a.beat("detail")
        await push_pushed(a)
        assert (await a.look())[0] == {"list": 0, "detail": 8, "comments": 0}
        assert (await a.look())[0]["detail"] == 8
        popped = names(await a.pop("detail", 3)) + names(await a.pop("detail", 10))
        assert popped == EXPECTED[order]
        assert await a.in_flight() == 8 and (await a.look())[0] == {
            "list": 0,
            "detail": 0,
            "comments": 0,
        }

    run(redis_url, scenario)
    keys = QueueKeys.of("redislock", "shop")
    # the sorted set holds scrapy-redis's scores; priority 0 stays in the list
    if order == "priority":
        # one order number per request of priority != 0
        assert int(redis_client.get(keys.sequence)) == 5


def test_priority_order_keeps_priority_0_in_the_list_and_scores_the_rest_as_scrapy_redis(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario(worker: Callable[..., StageQueues]) -> None:
        await push_pushed(worker("a"))

    run(redis_url, scenario)
    keys = QueueKeys.of("redislock", "shop")
    # FifoQueue's orientation
    assert redis_client.lrange(keys.queue("detail"), 0, -1) == [b"h0", b"e0", b"a0"]
    scored = redis_client.zrange(keys.scored("detail"), 0, -1, withscores=True)
    assert [(member[16:], score) for member, score in scored] == [
        (b"f10", -10.0),
        (b"b5", -5.0),
        (b"d5", -5.0),
        (b"c-5", 5.0),
        (b"g-5", 5.0),
    ]
    # the order number: ties in push order
    assert all(member[:16].isdigit() for member, _ in scored)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("how", ["give_back", "reclaim", "reap", "leave", "requeue_now"])
def test_requests_given_back_return_to_their_own_place_in_every_order(
    redis_url: str, redis_client: redis.Redis, order: str, how: str
) -> None:
    """Whatever puts popped requests back (a lost slot, a lost reply, a dead worker, a close, an
    operator's requeue), they are popped again exactly as if they had never left: the order is not
    disturbed, nothing is lost or doubled, and the in-flight counter counts what is left."""

    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a, other = worker("a", ttl=0.2 if how == "reap" else 30.0), worker("other")
        a.order = other.order = order
        await a.beat("detail")
        await other.beat("detail")
        await push_pushed(a)
        first = await a.pop("detail", 2)
        taken = await a.pop("detail", 3)
        assert names(first) + names(taken) == EXPECTED[order][:5]
        assert await a.ack([i for i, _ in first]) == 2
        if how == "give_back":
            assert await a.give_back([i for i, _ in taken]) == 3
        elif how == "reclaim":
            assert await a.reclaim([]) == 3
        elif how == "reap":
            await asyncio.sleep(0.3)
            await other.beat("detail")
            assert await other.reap() == {"a": 3}
        elif how == "leave":
            assert await a.leave() == 3
        else:
            sync = redis.Redis.from_url(redis_url)
            try:
                assert requeue_now(sync, a.keys, "a") == (3, 0)
            finally:
                sync.close()
        assert await a.in_flight() == 0 and redis_client.exists(a.inflight_key) == 0
        assert names(await other.pop("detail", 10)) == EXPECTED[order][2:]

    run(redis_url, scenario)


def test_a_stage_that_goes_from_empty_to_non_empty_in_either_part_gets_one_token(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a = worker("a")
        await a.beat("detail")
        signal = a.keys.signal("detail")
        await a.push("detail", "", b"p5", priority=5)  # the sorted set: the stage was empty
        assert redis_client.lrange(signal, 0, -1) == [b"1"]
        redis_client.delete(signal)
        # the list goes 0 -> 1, but the stage was not empty: no token
        await a.push("detail", "", b"p0")
        await a.push("detail", "", b"q5", priority=5)
        assert redis_client.llen(signal) == 0
        popped = await a.pop("detail", 3)
        assert names(popped) == ["p5", "q5", "p0"]
        # back into an empty stage: an idle worker is told
        await a.give_back([i for i, _ in popped])
        assert redis_client.lrange(signal, 0, -1) == [b"1"]
        redis_client.delete(signal)
        assert await a.give_back([]) == 0
        popped = await a.pop("detail", 1)
        await a.give_back([i for i, _ in popped])  # the stage still held two: no token
        assert redis_client.llen(signal) == 0

    run(redis_url, scenario)


def test_the_crawl_has_not_ended_while_the_sorted_set_holds_work(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a = worker("a")
        await a.beat("detail")
        await a.push_many([("detail", "", b"r0", 0), ("comments", "", b"c-1", -1)])
        popped = await a.pop("detail", 1)
        await a.ack([i for i, _ in popped])
        assert redis_client.llen(a.keys.wake) == 0  # comments' sorted set still holds one
        assert (
            await a.clear_if_finished() == -1 and redis_client.zcard(a.keys.scored("comments")) == 1
        )
        popped = await a.pop("comments", 5)
        assert names(popped) == ["c-1"]
        await a.ack([i for i, _ in popped])
        assert redis_client.llen(a.keys.wake) == 1
        assert await a.clear_if_finished() == 1
        # the sorted sets and the order counter too
        assert redis_client.keys("redislock:{shop}:*") == []

    run(redis_url, scenario)


def test_a_queue_of_the_previous_fifo_layout_is_read_as_priority_0(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Migration: the previous version kept each stage queue as one FIFO list (whatever the
    priorities), in-flight values "<stage>\\n<request>". That list is the priority-0 part of the
    priority order: read as it was, after what has a higher priority, before what has a lower one;
    an in-flight record of the previous version is given back to it."""
    keys = QueueKeys.of("redislock", "shop")
    # as the previous queue_push did
    redis_client.lpush(keys.queue("detail"), b"old0", b"old1", b"old2")
    # a dead worker of the previous version
    redis_client.hset(keys.inflight("gone"), "7", b"detail\nold-in-flight")
    redis_client.set(keys.in_flight, 1)
    redis_client.zadd(keys.alive, {"gone": 0})

    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a = worker("a")
        await a.beat("detail")
        assert await a.reap(["gone"]) == {"gone": 1}  # back at the list's front
        await a.push_many(
            [("detail", "", b"new5", 5), ("detail", "", b"new-5", -5), ("detail", "", b"new0", 0)]
        )
        assert names(await a.pop("detail", 10)) == [
            "new5",
            "old-in-flight",
            "old0",
            "old1",
            "old2",
            "new0",
            "new-5",
        ]

    run(redis_url, scenario)


@pytest.mark.parametrize("order", ["fifo", "lifo"])
def test_a_fifo_or_lifo_worker_takes_what_the_sorted_set_holds_once_its_list_is_empty(
    redis_url: str, redis_client: redis.Redis, order: str
) -> None:
    """Workers with different SCHEDULER_QUEUE_CLASS (a misconfiguration, or a change between two
    runs): nothing is stranded. A FIFO or LIFO worker pops its list first, then the sorted set in
    priority order, and says which ids came from there (the scheduler warns once)."""

    async def scenario(worker: Callable[..., StageQueues]) -> None:
        writer, reader = worker("writer"), worker("reader")
        reader.order = order
        await reader.beat("detail")
        await push_pushed(writer)  # in priority order
        popped = await reader.pop("detail", 10)
        listed = ["a0", "e0", "h0"] if order == "fifo" else ["h0", "e0", "a0"]
        assert names(popped) == [*listed, "f10", "b5", "d5", "c-5", "g-5"]
        assert reader.scored_ids == {i for i, data in popped if data.decode() not in listed}
        assert await reader.give_back([i for i, _ in popped]) == 8  # each back in its own part
        assert redis_client.llen(reader.keys.queue("detail")) == 3
        assert redis_client.zcard(reader.keys.scored("detail")) == 5

    run(redis_url, scenario)


@pytest.mark.parametrize(
    ("queue_class", "order"),
    [
        (None, "priority"),
        ("", "priority"),
        ("scrapy_redis.queue.PriorityQueue", "priority"),
        ("scrapy_redis.queue.SpiderPriorityQueue", "priority"),
        ("scrapy_redis.queue.FifoQueue", "fifo"),
        ("scrapy_redis.queue.SpiderQueue", "fifo"),
        ("scrapy_redis.queue.LifoQueue", "lifo"),
        ("scrapy_redis.queue.SpiderStack", "lifo"),
    ],
)
def test_scheduler_queue_class_names_the_order(queue_class: str | None, order: str) -> None:
    assert queue_order(queue_class) == order


def test_scheduler_queue_class_given_as_a_class_names_the_order_too() -> None:
    from scrapy_redis.queue import FifoQueue as Fifo
    from scrapy_redis.queue import LifoQueue, PriorityQueue

    assert [queue_order(c) for c in (PriorityQueue, Fifo, LifoQueue)] == [
        "priority",
        "fifo",
        "lifo",
    ]


@pytest.mark.parametrize(
    "queue_class",
    ["scrapy.squeues.FifoMemoryQueue", "scrapy_redis.queue.Base", "no.such.Queue", "Nonsense"],
)
def test_any_other_scheduler_queue_class_is_refused_naming_the_setting(queue_class: str) -> None:
    with pytest.raises(ConfigError) as refused:
        queue_order(queue_class)
    message = str(refused.value)
    assert f"SCHEDULER_QUEUE_CLASS = {queue_class!r}" in message
    for accepted in ("PriorityQueue", "FifoQueue", "LifoQueue"):
        assert f"scrapy_redis.queue.{accepted}" in message


def test_a_subclass_of_a_scrapy_redis_queue_is_refused_too() -> None:
    class Custom(FifoQueue):
        pass

    with pytest.raises(ConfigError, match="SCHEDULER_QUEUE_CLASS"):
        queue_order(Custom)


def test_one_pop_takes_10000_scored_requests_and_a_give_back_puts_them_all_back(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The sorted set's writes are chunked as the list's are: one push of 10000 scored requests, one
    pop of all of them (HSET and ZREM 1000 at a time), one give-back."""

    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a = worker("a")
        await a.beat("detail")
        await a.push_many([("detail", "", f"r{n}".encode(), 1 + n % 3) for n in range(BIG)])
        assert redis_client.zcard(a.keys.scored("detail")) == BIG
        popped = await a.pop("detail", BIG)
        assert popped is not None and len(popped) == BIG and len(a.scored_ids) == BIG
        expected = [f"r{n}" for p in (3, 2, 1) for n in range(BIG) if 1 + n % 3 == p]
        assert names(popped) == expected
        assert redis_client.zcard(a.keys.scored("detail")) == 0 and await a.in_flight() == BIG
        assert await a.give_back([i for i, _ in popped]) == BIG
        assert names(await a.pop("detail", BIG)) == expected

    run(redis_url, scenario)


def test_a_pop_that_cannot_record_leaves_the_sorted_set_as_it_was(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a = worker("a")
        await a.beat("detail")
        await a.push_many([("detail", "", f"r{n}".encode(), 1) for n in range(3)])
        before = redis_client.zrange(a.keys.scored("detail"), 0, -1, withscores=True)
        redis_client.set(a.inflight_key, "not a hash")
        with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
            await a.pop("detail", 2)
        assert redis_client.zrange(a.keys.scored("detail"), 0, -1, withscores=True) == before
        redis_client.delete(a.inflight_key)
        assert names(await a.pop("detail", 2)) == ["r0", "r1"]

    run(redis_url, scenario)


def test_status_counts_both_parts_and_shows_a_dead_letters_stage_without_its_mark(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario(worker: Callable[..., StageQueues]) -> None:
        a = worker("a")
        await a.beat("detail")
        await a.push_many(
            [("detail", "", b"r0", 0), ("detail", "", b"r1", 3), ("comments", "", b"c1", -2)]
        )
        popped = await a.pop("comments", 1)
        assert await a.bury([(popped[0][0], '{"error": "x"}')]) == 1

    run(redis_url, scenario)
    found = spiders_in({"shop": {":queue:detail", ":pqueue:detail", ":alive"}})
    status = spider_status(redis_client, "redislock", "shop", 30.0, found["shop"])
    assert status.queues["detail"] == 2
    (letters,) = dead_letters(redis_client, "redislock")
    assert letters.newest[0].stage == "comments" and letters.newest[0].excerpt == "b'c1'"
    assert queued(redis_client, QueueKeys.of("redislock", "shop"), "detail") == 2
