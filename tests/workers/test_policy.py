"""The worker's stage choice and waits, as pure decisions (no Redis, no Scrapy)."""

from __future__ import annotations

import math

import pytest

from scrapy_redislock.workers.policy import (
    BeatClock,
    StagePolicy,
    keeps_slot,
    keeps_streak,
    liveness,
    may_reap,
    next_wake,
)

SHOP = StagePolicy.of({"list": 1, "detail": 3, "comments": None})


def test_preference_is_the_given_order_then_the_remaining_stages_in_their_own_order() -> None:
    policy = StagePolicy.of({"a": 1, "b": None, "c": 2}, ["c"])
    assert policy.preference == ("c", "a", "b")
    assert policy.capped == frozenset({"a", "c"})


def test_with_no_stage_every_stage_with_work_is_tried_in_preference_order() -> None:
    assert SHOP.to_try(None, {"list": 0, "detail": 5, "comments": 9}) == ["detail", "comments"]
    assert SHOP.to_try(None, {"list": 0, "detail": 0, "comments": 0}) == []


def test_a_worker_keeps_a_capped_stage_while_it_has_work_queued_or_here() -> None:
    assert SHOP.to_try("detail", {"list": 3, "detail": 1, "comments": 0}) == []
    assert SHOP.to_try("detail", {"list": 3, "detail": 0, "comments": 0}, has_work_here=True) == []


def test_a_worker_leaving_a_drained_stage_tries_every_stage_with_work() -> None:
    assert SHOP.to_try("detail", {"list": 3, "detail": 0, "comments": 4}) == ["list", "comments"]


def test_from_an_uncapped_stage_a_worker_moves_up_only_to_preferred_capped_stages_with_work() -> (
    None
):
    lengths = {"list": 2, "detail": 7, "comments": 50}
    assert SHOP.to_try("comments", lengths) == ["list", "detail"]
    assert SHOP.to_try("comments", {**lengths, "list": 0}) == ["detail"]
    assert SHOP.to_try("comments", {"list": 0, "detail": 0, "comments": 50}) == []
    # An uncapped stage preferred over the current one is not a reason to move.
    policy = StagePolicy.of({"a": None, "b": None})
    assert policy.to_try("b", {"a": 5, "b": 5}) == []


def test_an_idle_worker_listens_to_every_stage_but_capped_ones_it_found_full() -> None:
    assert SHOP.listens_to(None, empty=set(), full=set()) == ["list", "detail", "comments"]
    assert SHOP.listens_to(None, empty=set(), full={"detail"}) == ["list", "comments"]


def test_a_worker_on_a_stage_listens_only_once_its_queue_was_found_empty() -> None:
    assert SHOP.listens_to("detail", empty=set(), full=set()) == []
    assert SHOP.listens_to("detail", empty={"detail", "list"}, full=set()) == ["detail"]


@pytest.mark.parametrize(
    ("quiet_since", "idle_close", "expected"),
    [
        (None, None, 10.0),  # nothing to wait for but the heartbeat
        (None, 2.0, 10.0),  # the cluster was busy at the last look: the end wakes it, not a clock
        (99.0, 2.0, 1.0),  # found quiet at 99: look again when it has been quiet for 2 s
        (90.0, 2.0, 0.0),  # overdue: now
        (99.0, 30.0, 10.0),  # the heartbeat comes first
        (99.0, None, 10.0),  # never closes by itself
    ],
)
def test_the_next_look_is_the_heartbeat_or_the_idle_close_deadline(
    quiet_since: float | None, idle_close: float | None, expected: float
) -> None:
    assert math.isclose(next_wake(100.0, 110.0, quiet_since, idle_close), expected)


# -- a stage's limit lowered under its holders (issue 26, item 2) ----------------------------------


def test_the_newest_holders_leave_exactly_as_many_as_the_stage_is_over_its_limit() -> None:
    held = ["0-10", "0-11", "0-12"]  # oldest first, as XPENDING lists them
    # Lowered from 3 to 1: whichever holder decides first, the oldest stays and the two newest
    # leave.
    assert [keeps_slot(grant, held[:1], 1) for grant in held] == [True, False, False]
    # Once the newest has left, the middle one still sees itself beyond the limit: it leaves too.
    assert not keeps_slot("0-11", ["0-10"], 1)
    # Lowered to 2: only the newest leaves.
    assert [keeps_slot(grant, held[:2], 2) for grant in held] == [True, True, False]
    # Not over the limit (raised, or unchanged): everybody stays.
    assert all(keeps_slot(grant, held, 3) for grant in held)
    assert all(keeps_slot(grant, held, 5) for grant in held)


def test_a_paused_stage_keeps_no_holder() -> None:
    assert not keeps_slot("0-10", [], 0)
    assert not keeps_slot("0-10", ["0-10"], 0)


def test_a_worker_leaving_its_stage_listens_to_nothing_until_it_has_left() -> None:
    assert SHOP.listens_to("detail", empty={"detail"}, full=set(), leaving=True) == []
    assert SHOP.listens_to(None, empty=set(), full=set(), leaving=True) == [
        "list",
        "detail",
        "comments",
    ]


# -- liveness: beats, deadlines, reaping (issue 26, item 3) ----------------------------------------


# idle: a beat every ttl/3, dead after the ttl (nothing to requeue)
@pytest.mark.parametrize(
    ("ttl", "working", "interval", "grace"),
    [
        (30.0, True, 1.0, 5.0),  # with work: a pulse every second, dead after 5 s (not 30)
        (30.0, False, 10.0, 30.0),
        (3.0, True, 1.0, 3.0),  # a short ttl: never longer than before
        (1.5, True, 0.5, 1.5),
        (6.0, True, 1.0, 5.0),
    ],
)
def test_a_worker_with_work_beats_every_second_and_is_dead_after_a_few(
    ttl: float, working: bool, interval: float, grace: float
) -> None:
    plan = liveness(ttl, working)
    assert math.isclose(plan.interval, interval) and math.isclose(plan.grace, grace)
    assert plan.grace >= 3 * plan.interval  # three beats missed in a row before anyone reaps it


def test_a_gap_in_a_workers_own_beats_breaks_its_streak() -> None:
    assert keeps_streak(1.0, 1.0) and keeps_streak(2.4, 1.0)
    # this worker stalled, or Redis was slow or away: the others may be late too
    assert not keeps_streak(2.6, 1.0)
    assert keeps_streak(10.0, 10.0) and not keeps_streak(21.0, 10.0)


def test_a_worker_back_from_an_outage_reaps_nobody_until_the_others_had_a_back_off_to_beat() -> (
    None
):
    assert not may_reap(0.0, 30.0) and not may_reap(5.9, 30.0)
    assert may_reap(6.0, 30.0)
    assert may_reap(1.5, 1.5)  # a short ttl: never waits longer than the ttl


def test_the_beat_clock_schedules_the_next_beat_and_pulse_from_when_a_beat_was_sent() -> None:
    clock = BeatClock(ttl=30.0, now=100.0)
    clock.beaten(sent=100.0, replied=100.01, plan=liveness(30.0, working=True))
    assert (clock.beat_due, clock.pulse_due, clock.grace) == (110.0, 101.0, 5.0)
    clock.beaten(sent=101.0, replied=101.01, plan=liveness(30.0, working=True), pulse=True)
    assert (clock.beat_due, clock.pulse_due) == (110.0, 102.0)  # a pulse moves no heartbeat
    assert clock.beat_at == 101.0


def test_the_beat_clock_keeps_a_streak_only_while_beats_come_without_a_gap() -> None:
    clock = BeatClock(ttl=30.0, now=0.0)
    plan = liveness(30.0, working=True)
    clock.beaten(sent=0.0, replied=0.0, plan=plan)
    for second in range(1, 7):
        clock.beaten(sent=float(second), replied=float(second), plan=plan)
    assert clock.streak_since == 0.0 and clock.may_reap(6.0)
    clock.beaten(sent=10.0, replied=10.0, plan=plan)  # 4 s after the last reply: a gap
    assert clock.streak_since == 10.0 and not clock.may_reap(11.0)
    clock.broken()  # a call failed: nobody is reaped until a new streak is long enough
    assert not clock.may_reap(100.0)


def test_the_beat_clock_says_a_process_stalled_past_most_of_its_promise() -> None:
    clock = BeatClock(ttl=30.0, now=0.0)
    clock.beaten(sent=0.0, replied=0.0, plan=liveness(30.0, working=True))  # promises 5 s
    assert not clock.stalled(4.0)
    assert clock.stalled(4.1)
