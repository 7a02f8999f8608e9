"""The worker's shared state: its named transitions, pure (no Redis, no Scrapy)."""

from __future__ import annotations

import asyncio

from scrapy_redislock.lock.permit import Permit
from scrapy_redislock.workers.state import WorkerState


def permit(grant: str) -> Permit:
    return Permit(name="workers:detail", owner="me", grant=grant, fence=1, acquired_at=0.0)


def test_taking_a_stage_resets_what_was_known_of_the_previous_one() -> None:
    state = WorkerState(["list", "detail"])
    state.looked({"list": 0, "detail": 4})
    assert state.empty == {"list"}
    state.leaving, state.limit_checked = True, (3, "1-0")
    assert state.took("detail", permit("5-0")) is None
    assert (state.current, state.leaving, state.limit_checked) == ("detail", False, None)
    assert state.permit is not None and state.permit.grant == "5-0"
    assert state.on_stage_with_work()


def test_an_uncapped_stage_taken_keeps_no_slot_and_leaving_hands_back_the_one_held() -> None:
    state = WorkerState(["list", "comments"])
    state.took("list", permit("1-0"))
    assert state.took("comments", None) == "list"
    stage, held = state.left()
    assert stage == "comments" and held is not None and held.grant == "1-0"
    assert (state.current, state.permit, state.look_due) == (None, None, True)


def test_looking_again_forgets_which_queues_were_empty() -> None:
    state = WorkerState(["a"])
    state.looked({"a": 0})
    state.look_due = False
    state.look_again()
    assert (state.empty, state.look_due) == (set(), True)


def test_wake_sets_the_loops_event_once_it_exists() -> None:
    state = WorkerState(["a"])
    state.wake()  # before the spider opens: nothing to wake
    state.wakeup = asyncio.Event()
    state.wake()
    assert state.wakeup.is_set()


def test_seeing_work_restarts_the_idle_clock() -> None:
    state = WorkerState(["a"])
    state.quiet_since, state.busy_at = 1.0, 1.0
    state.busy()
    assert state.quiet_since is None and state.busy_at > 1.0
