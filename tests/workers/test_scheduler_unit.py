"""StageWorkerScheduler in-process, on a fake clock (get_crawler; no Redis reached): what it hands
the engine while this worker may have been taken for dead, and what it says at start-up."""

from __future__ import annotations

import asyncio
import logging

import pytest
from scrapy import Request, Spider
from scrapy.utils.test import get_crawler

from scrapy_redislock.lock.permit import Permit
from scrapy_redislock.workers.mixin import StageWorkerMixin
from scrapy_redislock.workers.policy import liveness
from scrapy_redislock.workers.scheduler import StageWorkerScheduler
from testing.clock import FakeClock


class UnitWorker(StageWorkerMixin, Spider):
    name = "unit-worker"
    worker_stages = {"list": 1, "detail": None}


def scheduler(clock: FakeClock, **settings: object) -> StageWorkerScheduler:
    crawler = get_crawler(
        UnitWorker,
        {"REDISLOCK_URL": "redis://127.0.0.1:1", "REDISLOCK_TTL": 30, **settings},
    )
    return StageWorkerScheduler(crawler, clock=clock)


def test_a_stalled_worker_hands_out_no_request_with_no_stage_either() -> None:
    """No beat for far past what the last one promised: the others may have requeued what this
    worker's in-flight record holds, the requests with no stage its callbacks yielded too (each
    would then be fetched twice). Nothing is handed out until the next beat."""

    async def scenario() -> None:
        clock = FakeClock(100.0)
        sched = scheduler(clock)
        sched.state.took("detail", None)
        sched.heartbeat.beats.beaten(clock.now, clock.now, liveness(30, working=True))
        unstaged = Request("https://example.com/no-stage")
        sched.outbox.local.append((unstaged, 7))
        clock.advance(20)  # silent past the beat's promise
        assert sched.heartbeat.beats.stalled(clock.now)
        assert sched.next_request() is None
        sched.heartbeat.beats.beaten(clock.now, clock.now, liveness(30, working=True))
        assert sched.next_request() is unstaged

    asyncio.run(scenario())


@pytest.mark.parametrize(("timeout", "said"), [(180, True), (20, False)])
def test_a_download_timeout_past_the_lease_is_said_at_start_up(
    timeout: int, said: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """As on the request front: a capped stage's download is cut where its slot's lease ends, so
    a DOWNLOAD_TIMEOUT longer than REDISLOCK_TTL is said once, at INFO."""

    async def scenario() -> None:
        scheduler(FakeClock(100.0), DOWNLOAD_TIMEOUT=timeout)

    with caplog.at_level(logging.INFO, logger="scrapy_redislock"):
        asyncio.run(scenario())
    assert ("A capped request's download is cut where its slot's lease" in caplog.text) is said


def test_a_request_of_the_uncapped_stage_left_after_a_move_up_is_not_bounded_by_the_capped_slot() -> (
    None
):
    """The worker moved up from uncapped ``detail`` to capped ``list`` with a detail request still
    taken ahead: that request goes with its own DOWNLOAD_TIMEOUT, not cut at list's lease, and the
    loss of list's slot does not fail it; list's own requests are bounded."""

    async def scenario() -> None:
        clock = FakeClock(100.0)
        sched = scheduler(clock)
        sched.state.took("detail", None)
        sched.heartbeat.beats.beaten(clock.now, clock.now, liveness(30, working=True))
        detail = Request("https://example.com/d", meta={"redislock_stage": "detail"})
        listing = Request("https://example.com/l", meta={"redislock_stage": "list"})
        sched.inflight.buffer.extend([(detail, "1"), (listing, "2")])
        permit = Permit("workers:list", "unit", "1-1", 1, clock.now)
        permit.leased(clock.now, 30.0)
        sched.state.took("list", permit)  # what the move up's take does
        assert sched.next_request() is detail
        assert "download_timeout" not in detail.meta and detail not in sched._leases
        assert sched.next_request() is listing
        assert listing.meta["download_timeout"] < 30 and listing in sched._leases

    asyncio.run(scenario())
