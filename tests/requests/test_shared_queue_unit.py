"""The shared queue over scrapy-redis on a fake clock (testing/clock.py), with no Redis:
SharedStageQueues' pauses (a sub-queue found empty is not asked again within its pause, an outage
pauses them all, and its end is said with how long it lasted) and QueueWatch's word on a queue Redis
lost. scrapy-redis's queue is stood in for by :class:`ListQueue` (a list; the real queue
over Redis is in test_queue_loss.py), driven synchronously (no reactor, no queue thread), so these
tests time only what the clock decides; those that run it as under an engine (a queue thread, an
event loop) say so."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import redis.exceptions
from redis.crc import key_slot
from scrapy import Request, Spider
from scrapy.utils.test import get_crawler

from scrapy_redislock.crawl.epoch import SharedQueueKeys
from scrapy_redislock.requests.queueloss import QueueWatch
from scrapy_redislock.requests.stagequeue import (
    EMPTY_PAUSE,
    EMPTY_PAUSE_MOST,
    ENGINE_HEARTBEAT,
    QueueThread,
    Route,
    SharedStageQueues,
)
from testing.clock import FakeClock
from testing.waiting import until

# a test reads its own lines only: an earlier test's task the garbage collector finds logs on asyncio's
QUEUE_LOGGER = "scrapy_redislock.requests.stagequeue"
WATCH_LOGGER = "scrapy_redislock.requests.queueloss"


class ShopSpider(Spider):
    name = "shop"


class Server:
    """What the sub-queues share: whether Redis answers."""

    def __init__(self) -> None:
        self.down = False
        self.refused = False  # the user may not run the queue's commands (an ACL)


class ListQueue:
    """scrapy-redis's queue as a list, on a shared :class:`Server`; counts its pops."""

    def __init__(self, server: Server, spider: object, key: str, serializer: object) -> None:
        self.server, self.spider, self.key, self.serializer = server, spider, key, serializer
        self.requests: list[Request] = []
        self.pops = 0

    def _answer(self) -> None:
        if self.server.down:
            raise redis.exceptions.ConnectionError("Error 111 connecting to localhost:6379.")
        if self.server.refused:
            raise redis.exceptions.NoPermissionError(
                "this user has no permissions to run the 'zadd' command"
            )

    def push(self, request: Request) -> None:
        self._answer()
        self.requests.append(request)

    def pop(self, timeout: float = 0) -> Request | None:
        self._answer()
        self.pops += 1
        return self.requests.pop(0) if self.requests else None

    def __len__(self) -> int:
        self._answer()
        return len(self.requests)


class OpenGate:
    """Every sub-queue may go; a request's stage is its meta's ``stage``."""

    def route(self, request: Request) -> Route:
        return (request.meta.get("stage"), None)

    def may_go(self, route: Route) -> bool:
        return True

    def queue_route(self, request: Request) -> Route:
        return self.route(request)

    def divert(self, request: Request, route: Route) -> Route | None:
        return None

    def emptied(self, route: Route) -> None:
        pass


def shared_queues(clock: FakeClock) -> tuple[SharedStageQueues, list[float]]:
    """The shared queue with one capped stage, ``detail``, and the pauses it asked to be woken
    after."""
    base = ListQueue(Server(), spider=None, key="shop:requests", serializer=None)
    paused: list[float] = []
    shared = SharedStageQueues(
        base,
        ["detail"],
        OpenGate(),
        prefix="redislock",
        asked_while_paused=paused.append,
        clock=clock,
    )
    return shared, paused


def threaded_shared_queues(
    gate: OpenGate, clock: FakeClock | None = None
) -> tuple[SharedStageQueues, QueueThread]:
    """The shared queue with one capped stage, ``detail``, its scrapy-redis calls in a queue
    thread, as under an engine (run it inside an event loop); on ``clock`` if given."""
    thread = QueueThread()
    thread.engine = True
    base = ListQueue(Server(), spider=None, key="shop:requests", serializer=None)
    shared = SharedStageQueues(
        base,
        ["detail"],
        gate,
        prefix="redislock",
        asked_while_paused=lambda pause: None,
        thread=thread,
        **({} if clock is None else {"clock": clock}),
    )
    return shared, thread


def pops(shared: SharedStageQueues) -> dict[str | None, int]:
    return {stage: queue.pops for stage, queue in shared.queues.items()}


def test_a_sub_queue_found_empty_is_asked_again_only_after_its_pause() -> None:
    clock = FakeClock(100.0)
    shared, paused = shared_queues(clock)
    assert shared.pop() is None  # 100: both sub-queues asked, both empty
    assert pops(shared) == {None: 1, "detail": 1}
    assert not shared.may_have("detail") and paused == []

    clock.advance(EMPTY_PAUSE / 4)  # within the pause (half to all of EMPTY_PAUSE): not asked
    assert shared.pop() is None
    assert pops(shared) == {None: 1, "detail": 1}
    assert len(paused) == 1 and 0 < paused[0] <= EMPTY_PAUSE * 3 / 4  # woken when it ends

    clock.advance(EMPTY_PAUSE)  # past it: asked again, empty again; the next pause is longer
    assert shared.pop() is None
    assert pops(shared) == {None: 2, "detail": 2}
    clock.advance(EMPTY_PAUSE * 0.9)  # the second pause is half to all of 2 * EMPTY_PAUSE
    assert shared.pop() is None and pops(shared) == {None: 2, "detail": 2}
    clock.advance(EMPTY_PAUSE * 1.1)
    assert shared.pop() is None and pops(shared) == {None: 3, "detail": 3}

    request = Request("https://shop.test/1", meta={"stage": "detail"})
    shared.push(request)  # pushed here: asked at once, whatever its pause
    assert shared.may_have("detail") and shared.pop() is request


def test_an_outage_pauses_every_sub_queue_and_its_end_says_how_long_it_lasted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock(100.0)
    shared, paused = shared_queues(clock)
    looks: list[float] = []
    shared.check = lambda: looks.append(clock.now)  # QueueWatch.look_now
    server = shared.base.server
    server.down = True
    with caplog.at_level(logging.INFO, logger="scrapy_redislock.requests.stagequeue"):
        assert shared.pop() is None  # 100: Redis does not answer
        assert len(paused) == 1 and EMPTY_PAUSE / 2 <= paused[0] <= EMPTY_PAUSE
        assert not shared.may_have(None) and not shared.may_have("detail")
        clock.advance(paused[0])  # the back-off is over: asked again, still down
        assert shared.pop() is None and len(paused) == 2
        server.down = False
        clock.advance(7.5)  # 107.5 and more: Redis answers
        shared.pop()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    elapsed = clock.now - 100.0
    assert said == [f"Shared queue in Redis reachable again after {elapsed:.1f} s"]
    assert looks == [clock.now]  # a restart may have emptied it: the epoch is read at once


def test_under_an_engine_a_sub_queue_found_empty_is_looked_at_not_popped_until_it_has_requests() -> (
    None
):
    """Under an engine (the queue thread), a sub-queue a fetch found empty is not popped again
    however often the engine asks, past any pause: a look at the keys' lengths finds what another
    process pushed, and wakes the engine for it; a look that finds nothing wakes nothing, unless
    has_requests() answered True while it ran. Looks come after a pause of at most EMPTY_PAUSE_MOST
    while this process moves requests, once per engine heartbeat when it is idle. An idle process
    polled about 8 times a second, each poll waking the engine (and the RedisSpider's feed read)."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        # what is fresh and what is idle on a fake clock (a stall of the machine changes neither);
        # the looks' timers on the loop's
        shared, thread = threaded_shared_queues(OpenGate(), FakeClock(100.0))
        wakes: list[int] = []
        shared.wake = lambda: wakes.append(1)
        looks: list[int] = []

        async def look() -> None:
            looks.append(1)
            shared.looked(await thread.run(shared.lengths))

        shared.look = look
        began = loop.time()
        assert shared.pop() is None  # a fetch: both sub-queues found empty
        await until(lambda: shared._fetch is None)
        assert pops(shared) == {None: 1, "detail": 1} and not shared.may_have("detail")
        assert shared._probe is not None  # idle: the next look at the engine's heartbeat
        assert shared._probe.when() - began >= ENGINE_HEARTBEAT
        woken = len(wakes)  # once: detail's kept slots (none here) go back to Redis
        deadline = loop.time() + 3 * EMPTY_PAUSE_MOST
        while loop.time() < deadline:  # the engine asks and asks: nothing popped, nothing woken
            assert shared.pop() is None
            await asyncio.sleep(0.01)
        assert pops(shared) == {None: 1, "detail": 1} and (len(wakes), looks) == (woken, [])

        assert shared.has_requests()  # no look yet: it starts one, and is owed an answer
        await until(lambda: bool(looks) and shared._looking is None)
        assert len(wakes) == woken + 1 and not shared.has_requests()  # woken once, now it knows
        await look()  # found nothing: wakes nothing
        assert len(wakes) == woken + 1

        theirs = Request("https://shop.test/detail/1", meta={"stage": "detail"})
        shared.queues["detail"].requests.append(theirs)  # another process pushes
        await look()  # the next look finds it: the engine is woken to pop it
        assert len(wakes) == woken + 2 and shared.may_have("detail")
        assert shared.pop() is None  # the fetch starts
        await until(lambda: shared.ahead is not None)
        assert shared.pop() is theirs and pops(shared)["detail"] == 2

        assert shared.pop() is None  # found empty again: this process moves, so looks come sooner
        await until(lambda: shared._fetch is None and shared._probe is not None)
        assert shared._probe is not None
        assert shared._probe.when() - loop.time() <= EMPTY_PAUSE_MOST
        ours = Request("https://shop.test/detail/2", meta={"stage": "detail"})
        shared.push(ours)  # this process's own push: popped at once, no look first
        assert shared.may_have("detail")
        assert shared.pop() is None
        await until(lambda: shared.ahead is not None)
        assert shared.pop() is ours
        await shared.settle()
        thread.close()

    asyncio.run(scenario())


def test_a_busy_process_looks_soon_at_a_sub_queue_a_fetch_found_empty_on_its_way_to_a_request() -> (
    None
):
    """Under an engine: a fetch asks detail's sub-queue (empty), then the spider's own key, which
    gives a request. Detail is found empty, and a look at it comes within EMPTY_PAUSE_MOST (this
    process moves requests), finding what another process pushed there. Only a fetch that found
    nothing planned a look: detail waited for the renewal tick's, 5 s later, and asked no slot
    meanwhile."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        shared, thread = threaded_shared_queues(OpenGate(), FakeClock(100.0))

        async def look() -> None:
            shared.looked(await thread.run(shared.lengths))

        shared.look = look
        first, second = (Request(f"https://shop.test/list/{n}") for n in (1, 2))
        shared.base.requests += [first, second]  # another process pushed them
        assert shared.pop() is None
        await until(lambda: shared.ahead is not None)
        assert shared.pop() is first  # the spider's key had its turn: detail's comes first now
        assert shared.pop() is None  # the next fetch
        await until(lambda: shared.ahead is not None)
        assert pops(shared) == {None: 2, "detail": 1} and not shared.may_have("detail")
        assert shared._probe is not None
        assert shared._probe.when() - loop.time() <= EMPTY_PAUSE_MOST
        theirs = Request("https://shop.test/detail/1", meta={"stage": "detail"})
        shared.queues["detail"].requests.append(theirs)  # another process pushes
        await until(lambda: shared.may_have("detail"))  # the look found it
        assert shared.pop() is second
        assert shared.pop() is None  # the next fetch
        await until(lambda: shared.ahead is not None)
        assert shared.pop() is theirs
        await shared.settle()
        thread.close()

    asyncio.run(scenario())


def test_an_idle_process_whose_look_finds_redis_down_says_it_once_and_backs_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Under an engine, idle (every sub-queue found empty, so no fetch asks Redis): a look that
    finds Redis down starts the outage (one WARNING; has_requests() answers True and starts no
    look), the next look comes after the outage's back-off, and the one that reads Redis ends it
    (one INFO line). The failed look was swallowed: has_requests() started another at once, and the
    engine was woken for each, for as long as Redis was down, with nothing said."""

    async def scenario() -> None:
        shared, thread = threaded_shared_queues(OpenGate(), FakeClock(100.0))
        looks: list[int] = []

        async def look() -> BaseException | None:
            looks.append(1)
            try:
                lengths = await thread.run(shared.lengths)
            except redis.exceptions.ConnectionError as exc:  # as QueueWatch.look answers
                return exc
            shared.looked(lengths)
            return None

        shared.look = look
        assert shared.pop() is None  # both sub-queues found empty
        await until(lambda: shared._fetch is None)
        shared.base.server.down = True
        with caplog.at_level(logging.INFO, logger="scrapy_redislock.requests.stagequeue"):
            assert shared.has_requests()  # no look yet: one starts
            await until(lambda: shared._out_since is not None)
            for _ in range(20):  # the engine asks again and again: no look of its own
                assert shared.has_requests()
                await asyncio.sleep(0)
            assert len(looks) == 1 and shared._probe is not None
            shared.base.server.down = False
            await until(lambda: shared._out_since is None)  # a look after the back-off
        said = [r.getMessage() for r in caplog.records if r.name == QUEUE_LOGGER]
        assert len(said) == 2
        assert said[0].startswith("Shared queue in Redis unreachable (ConnectionError")
        assert said[1].startswith("Shared queue in Redis reachable again after")
        await shared.settle()
        thread.close()

    asyncio.run(scenario())


def test_a_look_redis_refuses_is_raised_and_one_that_empties_the_queue_wakes_the_engine() -> None:
    """Under an engine, every sub-queue found empty: a look Redis refuses (an ACL) is raised from
    the engine's next ask, as a pop's refusal is (it was dropped, and the engine woken to look again
    at once, for ever); and after has_requests() said the queue had requests, the look that finds
    it emptied (other processes took them) wakes the engine, which may tell the spider idle now,
    not at its next heartbeat."""

    async def scenario() -> None:
        clock = FakeClock(100.0)
        shared, thread = threaded_shared_queues(OpenGate(), clock)
        wakes: list[int] = []
        shared.wake = lambda: wakes.append(1)
        refusal: list[BaseException] = []

        async def look() -> BaseException | None:
            if refusal:
                return refusal.pop()
            shared.looked(await thread.run(shared.lengths))
            return None

        shared.look = look
        assert shared.pop() is None  # both sub-queues found empty
        await until(lambda: shared._fetch is None)
        theirs = Request("https://shop.test/detail/1", meta={"stage": "detail"})
        shared.queues["detail"].requests.append(theirs)  # another process pushes
        await look()
        assert shared.has_requests()  # from the fresh look: told there are requests
        shared.queues["detail"].requests.clear()  # another process took it
        woken = len(wakes)
        await look()
        assert len(wakes) == woken + 1 and not shared.has_requests()

        refusal.append(redis.exceptions.NoPermissionError("this user has no permissions"))
        clock.advance(1.0)  # the look is stale: has_requests() starts one, which Redis refuses
        assert shared.has_requests()
        await until(lambda: shared._looking is None)
        with pytest.raises(redis.exceptions.NoPermissionError):
            shared.pop()
        await shared.settle()
        thread.close()

    asyncio.run(scenario())


# -- QueueWatch: a queue Redis lost --------------------------------------------------------------


def test_a_lost_queue_is_said_with_what_the_last_look_saw_and_how_long_before(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock(100.0)
    shared, _ = shared_queues(clock)
    crawler = get_crawler(ShopSpider)
    watch = QueueWatch(crawler, shared, "redislock", clock=clock)
    with caplog.at_level(logging.WARNING, logger="scrapy_redislock.requests.queueloss"):
        watch._judge(
            "epoch-1", {None: 1, "detail": 2}, shared.moved
        )  # 100: a look (a renewal tick) reads 3 queued
        assert (watch.queued, watch.looked_at) == (3, 100.0) and not caplog.records
        clock.advance(4.25)  # 104.25: the next look finds another epoch: Redis lost the queue
        watch._judge("epoch-2", {None: 0, "detail": 0}, shared.moved)
    [error] = [r for r in caplog.records if r.name == WATCH_LOGGER]
    assert error.levelno == logging.ERROR
    assert "the 3 request(s) queued there at this process's last look (4.2 s before)" in (
        error.getMessage()
    )
    assert crawler.stats.get_value("redislock/queue_lost") == 1  # type: ignore[union-attr]
    assert (watch.queued, watch.looked_at) == (0, 104.25)


def test_a_lost_queue_this_process_knew_nothing_of_is_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock(100.0)
    shared, _ = shared_queues(clock)
    crawler = get_crawler(ShopSpider)
    watch = QueueWatch(crawler, shared, "redislock", clock=clock)
    with caplog.at_level(logging.WARNING, logger="scrapy_redislock.requests.queueloss"):
        watch._judge("epoch-1", {None: 0, "detail": 0}, shared.moved)
        clock.advance(60.0)
        watch._judge(
            "epoch-2", {None: 0, "detail": 0}, shared.moved
        )  # empty before, nothing pushed or taken since
    assert [r.levelno for r in caplog.records if r.name == WATCH_LOGGER] == [logging.WARNING]
    assert crawler.stats.get_value("redislock/queue_lost") is None  # type: ignore[union-attr]
    assert watch.losses == 0


def test_a_request_redis_refuses_to_take_back_is_lost_and_said_so() -> None:
    """A request given back to the shared queue (fetched ahead, or back from the scheduler at close)
    that Redis refuses (the user may not run the queue's commands): it is lost, so it goes to
    ``lost`` (QueueWatch: ERROR, no clean finish), and the refusal is raised at the engine's next
    ask. It was only raised: the request was gone and the crawl could finish as ``finished``."""

    async def scenario() -> None:
        server = Server()
        base = ListQueue(server, spider=None, key="shop:requests", serializer=None)
        thread = QueueThread()
        thread.engine = True  # in the queue thread, as under an engine
        shared = SharedStageQueues(
            base,
            ["detail"],
            OpenGate(),
            prefix="redislock",
            asked_while_paused=lambda pause: None,
            thread=thread,
        )
        lost: list[tuple[Request, BaseException]] = []
        shared.lost = lambda request, exc: lost.append((request, exc))
        server.refused = True
        given = Request("http://shop.test/detail/1", meta={"stage": "detail"})
        shared.give_back(given)
        await thread.drain()
        thread.close()
        assert [(r, type(e)) for r, e in lost] == [(given, redis.exceptions.NoPermissionError)]
        with pytest.raises(redis.exceptions.NoPermissionError):
            shared.pop()

    asyncio.run(scenario())


def test_held_requests_are_queued_again_one_seen_all_the_same_one_unwritable_lost() -> None:
    """Requests held while Redis did not answer are queued again at the next pop, in order. One
    the dupefilter reads as seen (its first try ran, the reply lost) is pushed all the same and said
    (``seen_again``). One scrapy-redis cannot queue now (its serializer refuses it) is lost and said
    (``lost``), and those behind it go on. It was tried again at every pop, raising into the engine,
    and nothing behind it was ever queued."""
    shared, _ = shared_queues(FakeClock())
    recorded: set[str] = set()  # scrapy-redis's dupefilter

    def enqueue(request: Request) -> bool:
        if request.meta.get("unwritable"):
            raise ValueError("Function <lambda> is not an instance method in: <ShopSpider>")
        if request.url in recorded:
            return False
        recorded.add(request.url)
        shared.push(request)
        return True

    shared.enqueue = enqueue
    seen_again: list[Request] = []
    lost: list[tuple[Request, type[BaseException]]] = []
    shared.seen_again = seen_again.append
    shared.lost = lambda request, exc: lost.append((request, type(exc)))
    unwritable = Request("http://shop.test/detail/1", meta={"stage": "detail", "unwritable": 1})
    its_reply_lost = Request("http://shop.test/detail/2", meta={"stage": "detail"})
    recorded.add(its_reply_lost.url)  # Redis ran its SADD
    fresh = Request("http://shop.test/detail/3", meta={"stage": "detail"})
    for request in (unwritable, its_reply_lost, fresh):
        shared.hold(request, redis.exceptions.TimeoutError("Timeout reading from localhost:6379"))

    assert [shared.pop(), shared.pop(), shared.pop()] == [its_reply_lost, fresh, None]
    assert seen_again == [its_reply_lost]
    assert lost == [(unwritable, ValueError)]
    assert not shared.in_memory


def test_a_held_request_redis_refuses_once_it_answers_is_lost_and_the_refusal_raised() -> None:
    """A request held during an outage that Redis refuses to queue once it answers (the user may
    no longer run the queue's commands): lost and said (``lost``), and the refusal raised at the
    engine's next ask, as scrapy-redis's own call would raise it; not retried at every pop, each
    raising."""
    shared, _ = shared_queues(FakeClock())

    def refused(request: Request) -> bool:
        raise redis.exceptions.NoPermissionError(
            "this user has no permissions to run the 'zadd' command"
        )

    shared.enqueue = refused
    lost: list[Request] = []
    shared.lost = lambda request, exc: lost.append(request)
    held = Request("http://shop.test/detail/1", meta={"stage": "detail"})
    shared.hold(held, redis.exceptions.ConnectionError("Error 111 connecting to localhost:6379."))
    assert shared.pop() is None
    assert lost == [held] and not shared.in_memory
    with pytest.raises(redis.exceptions.NoPermissionError):
        shared.pop()
    assert shared.pop() is None


def test_a_held_request_queued_again_is_seen_by_the_next_look_not_read_from_an_older_one() -> None:
    """A request held (its dupefilter's SADD timed out) while the fetch behind it found Redis
    answering: the outage ends with it still in memory; a renewal tick's look reads the queue empty;
    the next fetch queues it into its stage's key, which has no slot to be asked. The queue still
    has it: has_requests() looks again instead of answering from the look before. It answered
    False, and the engine closed the spider "finished" with the request in Redis (flushed unless
    SCHEDULER_PERSIST)."""

    class NoSlotForDetail(OpenGate):
        def may_go(self, route: Route) -> bool:
            return route[0] is None

    async def scenario() -> None:
        shared, thread = threaded_shared_queues(NoSlotForDetail())
        lost_replies = [redis.exceptions.TimeoutError("Timeout reading from localhost:6379")]

        def enqueue(request: Request) -> bool:
            if lost_replies:
                raise lost_replies.pop()
            shared.push(request)
            return True

        async def look() -> None:
            shared.looked(await thread.run(shared.lengths))

        shared.enqueue = enqueue
        shared.look = look
        held = Request("http://shop.test/detail/1", meta={"stage": "detail"})
        shared.schedule(held)  # its SADD times out: held
        shared.pop()  # a fetch, behind it, finds Redis answering
        ran = threading.Event()
        thread.run(ran.set)
        # both ran in the queue thread before their answers reached this one (the reactor's): the
        # fetch had nothing in memory to queue
        assert ran.wait(10)
        await thread.drain()
        assert shared.in_memory == 1 and shared._out_since is None
        await look()  # a renewal tick's look: nothing in Redis
        shared.pop()  # the next fetch queues it into detail's key
        await thread.drain()
        assert shared.queues["detail"].requests == [held] and not shared.in_memory
        assert shared.has_requests()  # and it starts a look
        await until(lambda: shared._looking is None)
        assert shared.has_requests() and len(shared) == 1
        thread.close()

    asyncio.run(scenario())


def test_requests_held_in_memory_go_to_redis_at_close_if_it_answers() -> None:
    """A request held during an outage, and the spider closes before the next fetch: if Redis
    answers now, settle() queues it (kept with SCHEDULER_PERSIST, for the next run); none is lost.
    It was counted lost (ERROR, redislock_queue_lost), though one push would have kept it."""

    async def scenario() -> None:
        shared, thread = threaded_shared_queues(OpenGate())
        shared.enqueue = lambda request: shared.push(request) or True
        held = Request("http://shop.test/detail/1", meta={"stage": "detail"})
        shared.hold(
            held, redis.exceptions.ConnectionError("Error 111 connecting to localhost:6379.")
        )
        await shared.settle()
        assert shared.queues["detail"].requests == [held]
        assert shared.close() == 0
        thread.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("sub_queue", ["shop:requests:detail", "{shop}:requests:detail"])
def test_a_pops_record_is_in_its_sub_queues_cluster_slot(sub_queue: str) -> None:
    """The record of a process's last pop and the sub-queue are one script's keys: one Cluster
    slot, whether the queue key has a hash tag (SCHEDULER_QUEUE_KEY = "{%(spider)s}:requests", as a
    Cluster deployment sets it) or none."""
    record = SharedQueueKeys.popped("redislock", sub_queue, "a1b2c3")
    assert key_slot(record.encode()) == key_slot(sub_queue.encode())
    assert record.endswith(f":popped:a1b2c3:{sub_queue}")
