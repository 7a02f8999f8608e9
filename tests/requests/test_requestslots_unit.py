"""The local hand-off of the request front's slots (requests/requestslots.py), fast: a crawler from
``scrapy.utils.test.get_crawler``, real Permit objects made by hand, a fake clock, no Redis (nothing
here sends a command: a slot passed on locally costs none; the one that goes back to Redis is only
started, and cancelled)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from scrapy import Request, Spider
from scrapy.utils.test import get_crawler

from scrapy_redislock.crawl.settings import read_settings
from scrapy_redislock.crawl.stagelocks import StageLocks
from scrapy_redislock.errors import AcquireTimeout
from scrapy_redislock.lock.permit import Permit
from scrapy_redislock.requests import requestslots
from scrapy_redislock.requests.kept import KeptSlots
from scrapy_redislock.requests.lines import SlotLine, SlotLines
from scrapy_redislock.requests.requestslots import RequestSlots
from testing.clock import FakeClock
from testing.waiting import until

REUSE = 5.0  # REDISLOCK_LOCAL_REUSE


class UnitSpider(Spider):
    name = "unit"


def slots_of(clock: FakeClock) -> RequestSlots:
    crawler = get_crawler(
        UnitSpider,
        {
            "REDISLOCK_URL": "redis://127.0.0.1:1",  # never reached
            "REDISLOCK_STAGES": {"detail": 1, "list": 1},
            "REDISLOCK_TTL": 30,
            "REDISLOCK_LOCAL_REUSE": REUSE,
        },
    )
    settings = read_settings(crawler.settings)
    return RequestSlots(
        crawler, settings, StageLocks(crawler, settings, settings.stages, clock=clock), clock=clock
    )


def granted(stage: str, clock: FakeClock) -> Permit:
    """A slot of ``stage`` as Redis grants it, now on ``clock``: leased for the TTL from now."""
    permit = Permit(name=stage, owner="unit", grant="1-1", fence=1, acquired_at=clock())
    permit.leased(clock(), 30.0)
    return permit


def waiting(slots: RequestSlots, stage: str, count: int) -> list[asyncio.Future[Permit]]:
    """``count`` requests of ``stage`` waiting in the middleware, oldest first (their line's waits
    in Redis are left out: no Redis here)."""
    line = slots.lines.lines.setdefault(stage, SlotLine(stage))
    return [line.join() for _ in range(count)]


def waits_in_redis(locks: StageLocks) -> list[asyncio.Future[Permit]]:
    """``locks``' waits in Redis, stood in for by futures in the order opened (the test grants
    them): no Redis here."""
    waits: list[asyncio.Future[Permit]] = []

    async def acquire(stage: str, timeout: float | None) -> Permit:
        waits.append(wait := asyncio.get_running_loop().create_future())
        return await wait

    locks.acquire = acquire  # type: ignore[method-assign]
    return waits


def test_a_finished_requests_slot_goes_to_the_oldest_waiter_of_its_stage_in_the_same_call() -> None:
    async def scenario() -> None:
        clock = FakeClock(1000.0)
        slots = slots_of(clock)
        oldest, next_one = waiting(slots, "detail", 2)
        (other_stage,) = waiting(slots, "list", 1)
        permit = granted("detail", clock)
        done = Request("http://example.com/1")
        slots.hold(done, permit)
        clock.now += REUSE - 0.1
        slots.finish(done)  # no await: passed on in this call
        assert oldest.done() and oldest.result() is permit
        assert not next_one.done() and not other_stage.done()
        assert slots.held(done) == []
        assert not slots.locks.releasing  # nothing sent to Redis
        assert slots.locks.stats.get_value("redislock/detail/reused") == 1

    asyncio.run(scenario())


def test_a_slot_older_than_the_local_reuse_bound_goes_back_to_redis() -> None:
    async def scenario() -> None:
        clock = FakeClock(1000.0)
        slots = slots_of(clock)
        (waiter,) = waiting(slots, "detail", 1)
        permit = granted("detail", clock)
        done = Request("http://example.com/1")
        slots.hand(done, permit)
        assert slots.take(done) is permit
        clock.now += REUSE  # REDISLOCK_LOCAL_REUSE since Redis granted it: no longer young
        slots.finish(done)
        assert not waiter.done()
        assert slots.locks.stats.get_value("redislock/detail/reused") is None
        releasing = list(slots.locks.releasing)  # back to Redis's line: a release was started
        assert len(releasing) == 1
        for task in releasing:
            task.cancel()
        await asyncio.gather(*releasing, return_exceptions=True)

    asyncio.run(scenario())


def test_a_young_slot_past_its_lease_on_the_clock_is_not_passed_on() -> None:
    """Its lease ran out unrenewed (a stall, Redis out of reach) while it is still young: dropped
    (counted, back to Redis), never handed to the waiter."""

    async def scenario() -> None:
        clock = FakeClock(1000.0)
        slots = slots_of(clock)
        (waiter,) = waiting(slots, "detail", 1)
        permit = granted("detail", clock)
        permit.valid_until = clock.now + 1.0  # its renewals stopped
        done = Request("http://example.com/1")
        slots.hold(done, permit)
        clock.now += 1.0
        slots.finish(done)
        assert not waiter.done()
        assert slots.locks.stats.get_value("redislock/detail/unusable") == 1
        assert slots.locks.stats.get_value("redislock/detail/reused") is None
        releasing = list(slots.locks.releasing)
        assert len(releasing) == 1
        for task in releasing:
            task.cancel()
        await asyncio.gather(*releasing, return_exceptions=True)

    asyncio.run(scenario())


def test_a_handed_stage_slot_no_longer_usable_is_dropped_with_the_slots_taken_after_it() -> None:
    """One record per request: its stage's slot and a key's, each freed through its own line. When
    the stage's slot can no longer go (its lease ran out unrenewed), the key's slot does not stay
    with the request while it waits for its stage's again (the one order: stage first): it passes
    on through the key's line, to the oldest request waiting there."""

    async def scenario() -> None:
        clock = FakeClock(1000.0)
        slots = slots_of(clock)
        keys = StageLocks(
            slots.crawler, read_settings(slots.crawler.settings), {"list": 1}, clock=clock
        )
        key_lines = SlotLines(
            KeptSlots(slots.crawler, keys, could_use=lambda name: 0, most=1, keep_asking=True),
            reuse_for=REUSE,
            kind="key",
            ask_timeout=None,
        )
        key_waiter = key_lines.lines.setdefault("list", SlotLine("list", "key")).join()
        stage, key = granted("detail", clock), granted("list", clock)
        stage.valid_until = clock.now + 1.0  # its renewals stopped
        request = Request("http://example.com/1")
        slots.hand(request, [(slots.lines, stage), (key_lines, key)])
        assert slots.permit_of(request) is stage
        assert slots.held(request) == [(slots.lines, stage), (key_lines, key)]
        clock.now += 1.0
        assert slots.take(request) is None  # it waits for its stage's slot again
        assert slots.held(request) == []
        assert key_waiter.done() and key_waiter.result() is key  # through the key's line
        assert slots.locks.stats.get_value("redislock/detail/unusable") == 1
        releasing = list(slots.locks.releasing)  # the stage's slot: back to Redis
        assert len(releasing) == 1 and not keys.releasing
        for task in releasing:
            task.cancel()
        await asyncio.gather(*releasing, return_exceptions=True)

    asyncio.run(scenario())


def test_a_grant_the_queued_requests_could_not_use_is_not_chased_by_another_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stage's queued requests cannot go now (their key is full here): each grant to the line's
    waits for them is kept, the engine's pass finds no request to go with it and gives it back.
    No new wait opens for them until the scheduler asks again (at a pass where one could go): a
    grant it gave back is not chased by another, in a loop of takes and releases."""

    async def scenario() -> None:
        clock = FakeClock(1000.0)
        slots = slots_of(clock)
        waits = waits_in_redis(slots.locks)
        # a running engine (get_crawler's has none: it would count as closing)
        monkeypatch.setattr(requestslots, "engine_closing", lambda crawler: False)
        slots.serve_scheduler(queued=lambda stage: 4, could_use=lambda stage: 4)
        slots.lines.ask("detail")
        await until(lambda: len(waits) == 2)  # REDISLOCK_WAITERS_PER_STAGE
        for wait in list(waits):
            wait.set_result(granted("detail", clock))
            await until(lambda: slots.kept.count("detail") == 1)
            slots.kept.release_all()  # the engine's pass: none of the queued requests may go
        assert slots.lines.asking("detail") == 0
        assert len(waits) == 2
        slots.lines.ask("detail")  # a pass where one of them could go: the owner asks again
        assert slots.lines.asking("detail") == 2

    asyncio.run(scenario())


def test_a_keys_line_opens_its_wait_again_as_soon_as_its_grant_is_kept() -> None:
    """A key's or scope's queued requests are asked for only when a take is refused: its line keeps
    one wait open beside what is kept while they want more (``keep_asking``)."""

    async def scenario() -> None:
        clock = FakeClock(1000.0)
        locks = slots_of(clock).locks
        lines = SlotLines(
            KeptSlots(locks.crawler, locks, could_use=lambda name: 3, most=1, keep_asking=True),
            reuse_for=REUSE,
        )
        waits = waits_in_redis(locks)
        lines.ask("detail")
        await until(lambda: len(waits) == 1)
        for kept in (1, 2):
            waits[-1].set_result(granted("detail", clock))
            await until(lambda kept=kept: lines.kept.count("detail") == kept)  # type: ignore[misc]
            assert lines.asking("detail") == 1  # the next wait, opened at once
        await until(lambda: len(waits) == 3)
        locks.closed = True  # the spider closes: the open wait is withdrawn, not left pending
        for ask in list(lines.lines["detail"].asks):
            ask.cancel()
        await until(lambda: lines.asking("detail") == 0)

    asyncio.run(scenario())


def test_a_wait_in_redis_cancelled_by_the_ending_loop_is_not_opened_again() -> None:
    """The event loop ends with a request waiting (``asyncio.run`` cancels every task, the
    registry still open): its wait in Redis is not opened again, as a task that would never run
    and that nothing would close; the request stops waiting. A wait withdrawn as surplus is the
    line's own cancel, and only then does the line look again at what it wants."""

    async def scenario() -> None:
        clock = FakeClock(1000.0)
        slots = slots_of(clock)
        waits = waits_in_redis(slots.locks)
        request = asyncio.ensure_future(slots.lines.wait("detail", None))
        await until(lambda: len(waits) == 1)
        (ask,) = slots.lines.lines["detail"].asks
        ask.cancel()  # not by the line: the loop's end
        await asyncio.wait({request}, timeout=5.0)  # it waited on, for ever, when opened again
        assert request.cancelled()
        assert slots.lines.asking("detail") == 0
        assert len(waits) == 1
        assert not slots.locks.closed

    asyncio.run(scenario())


def test_a_request_the_scheduler_still_holds_with_its_slots_is_not_swept() -> None:
    """The engine backs off (its downloader or scraper is full) for longer than two ticks: a request
    that got its slots in the scheduler and waits for the engine's next ask keeps them (and an error
    handed with it), where one that left the downloader unseen has its slots freed."""

    async def scenario() -> None:
        clock = FakeClock(1000.0)
        slots = slots_of(clock)
        slots.crawler.engine = SimpleNamespace(  # running, its downloader empty
            running=True,
            _slot=SimpleNamespace(closing=None),
            downloader=SimpleNamespace(active=set()),
        )
        ready, gone, failed = (Request(f"http://example.com/{i}") for i in range(3))
        slots.serve_scheduler(
            queued=lambda _: 0, could_use=lambda _: 0, ready=lambda: [ready, failed]
        )
        slots.hand(ready, granted("detail", clock))
        slots.hand(gone, granted("detail", clock))
        slots.hand(failed, AcquireTimeout("no slot"))
        slots.sweep()
        slots.sweep()
        assert slots.held(gone) == []
        assert slots.permit_of(ready) is not None
        assert isinstance(slots.take(failed), AcquireTimeout)

    asyncio.run(scenario())
