"""What a name's queued requests have and want (requests/kept.py), one copy for a stage's and a
key's, fast: a crawler from ``scrapy.utils.test.get_crawler``, Permit objects made by hand, a fake
clock, no Redis (a slot sent back is only started, and cancelled)."""

from __future__ import annotations

from scrapy import Spider
from scrapy.utils.test import get_crawler

from scrapy_redislock.crawl.settings import read_settings
from scrapy_redislock.crawl.stagelocks import StageLocks
from scrapy_redislock.errors import AcquireTimeout
from scrapy_redislock.lock.permit import Permit
from scrapy_redislock.requests.kept import KeptSlots
from testing.clock import FakeClock


class UnitSpider(Spider):
    name = "unit"


def kept_slots(clock: FakeClock, queued: list[int], *, most: int, keep_asking: bool) -> KeptSlots:
    crawler = get_crawler(
        UnitSpider,
        {
            "REDISLOCK_URL": "redis://127.0.0.1:1",
            "REDISLOCK_STAGES": {"detail": 5},
        },  # never reached
    )
    settings = read_settings(crawler.settings)
    locks = StageLocks(crawler, settings, settings.stages, clock=clock)
    return KeptSlots(
        crawler, locks, could_use=lambda name: queued[0], most=most, keep_asking=keep_asking
    )


def granted(clock: FakeClock, grant: str) -> Permit:
    permit = Permit(name="detail", owner="unit", grant=grant, fence=1, acquired_at=clock())
    permit.leased(clock(), 30.0)
    return permit


def test_a_stage_wants_its_waits_less_what_is_kept_a_key_one_wait_beside_it() -> None:
    """A stage: REDISLOCK_WAITERS_PER_STAGE (2) slots in hand or asked for; a key: one wait while
    its queued requests outnumber what is kept. Neither more than the queued requests could use."""
    clock = FakeClock(1000.0)
    queued = [5]
    stage = kept_slots(clock, queued, most=2, keep_asking=False)
    key = kept_slots(clock, queued, most=1, keep_asking=True)
    assert (stage.wanted("detail"), key.wanted("detail")) == (2, 1)
    for kept in (stage, key):
        assert kept.offer("detail", granted(clock, "1-1"))
    assert (stage.wanted("detail"), key.wanted("detail")) == (1, 1)
    for kept in (stage, key):
        assert kept.offer("detail", granted(clock, "1-2"))
    assert (stage.wanted("detail"), key.wanted("detail")) == (0, 1)
    queued[0] = 2  # both queued requests have a slot kept
    assert (stage.wanted("detail"), key.wanted("detail")) == (0, 0)


def test_what_no_queued_request_could_use_is_not_kept_and_a_kept_error_is_counted() -> None:
    clock = FakeClock(1000.0)
    queued = [1]
    kept = kept_slots(clock, queued, most=2, keep_asking=False)
    first, second = granted(clock, "1-1"), granted(clock, "1-2")
    assert kept.offer("detail", first)
    assert not kept.offer("detail", second)  # the one queued request has a slot kept
    assert kept.outcomes("detail") == (first,)
    queued[0] = 3
    error = AcquireTimeout("stage 'detail': no slot within 1 s")
    assert kept.offer("detail", error)  # the next queued request fails with it
    assert kept.locks.crawler.stats.get_value("redislock/detail/timeouts") == 1
    clock.advance(31.0)  # past second's lease on this process's clock: never kept
    assert not kept.offer("detail", second)
    assert kept.outcomes("detail") == (first, error)


def test_the_queued_requests_wait_from_the_first_ask_until_one_leaves_or_none_is_left() -> None:
    """A stage's: the wait counted for a request that leaves with a kept slot runs from its name's
    first ask with nothing kept (its owner asks at every pass); a name whose queued requests are
    all gone at the tick starts again."""
    clock = FakeClock(1000.0)
    queued = [2]
    kept = kept_slots(clock, queued, most=2, keep_asking=False)
    kept.asked("detail")
    clock.advance(3.0)
    kept.asked("detail")  # asked again: still waiting since the first
    assert kept.waited("detail") == 3.0
    clock.advance(2.0)  # its owner has not asked again (the next one's slot is in hand)
    assert kept.waited("detail") == 0.0
    kept.asked("detail")
    clock.advance(10.0)
    queued[0] = 0  # its queued requests went (dropped, or left to wait in the middleware)
    kept.prune()
    queued[0] = 1
    kept.asked("detail")
    clock.advance(1.0)
    assert kept.waited("detail") == 1.0


def test_the_requests_left_queued_with_nothing_kept_wait_from_the_last_one_leaving() -> None:
    """A key's queued requests are asked for once, when a take is refused; the line's wait then
    brings grant after grant. Each request leaving with one counts its wait from the one before
    (not 0 for every one after the first)."""
    clock = FakeClock(1000.0)
    queued = [3]
    kept = kept_slots(clock, queued, most=1, keep_asking=True)
    kept.asked("detail")
    for waited in (2.0, 5.0, 1.5):
        clock.advance(waited)
        assert kept.offer("detail", granted(clock, "1-1"))
        assert kept.take("detail") is not None
        assert kept.waited("detail") == waited
    # not from then while a slot is still kept for the next one, nor with none left queued
    assert kept.offer("detail", granted(clock, "1-2"))
    assert kept.offer("detail", granted(clock, "1-3"))
    assert kept.take("detail") is not None
    assert kept.waited("detail") == 0.0
    clock.advance(4.0)
    assert kept.take("detail") is not None
    assert kept.waited("detail") == 0.0
    queued[0] = 0
    assert kept.waited("detail") == 0.0
    clock.advance(3.0)
    queued[0] = 1
    assert kept.waited("detail") == 0.0
