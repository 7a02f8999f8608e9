"""The worker's shared state: its named transitions, pure (no Redis, no Scrapy), with a fake clock."""

from __future__ import annotations

import asyncio

from scrapy_redislock.lock.permit import Permit
from scrapy_redislock.workers.state import WorkerState
from testing.clock import FakeClock


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


def test_idle_time_counts_from_the_last_work_seen_and_from_an_outage_end() -> None:
    clock = FakeClock()
    state = WorkerState(["list", "detail"], clock=clock)
    state.looking()
    clock.now = 105.0
    state.saw_work(False)  # quiet since the last work seen (at 100)
    assert state.quiet_since == 100.0 and not state.look_due
    state.idle_due(now=109.0, idle_close=10.0)
    assert not state.look_due
    state.idle_due(now=110.0, idle_close=10.0)  # quiet for REDISLOCK_IDLE_CLOSE: look (and close)
    assert state.look_due
    state.failed()
    clock.now = 130.0
    assert state.answered() and state.busy_at == 130.0  # idle from the outage's end
    assert not state.answered()  # answered once
    state.saw_work(True)
    assert state.quiet_since is None and state.work_seen


def test_a_stage_taken_checked_and_left() -> None:
    clock = FakeClock()
    state = WorkerState(["list"], clock=clock)
    state.looked({"list": 0})
    assert state.empty == {"list"}
    assert state.took("list", None) is None and state.current == "list"
    assert "list" not in state.empty and state.taken_at == 100.0
    state.checked_limit(3, "g-1")
    state.leave_when_done()
    assert state.leaving and state.limit_checked == (3, "g-1")
    assert state.left() == ("list", None)
    assert state.current is None and not state.leaving and state.look_due


def test_signal_tokens_are_used_once_or_passed_on() -> None:
    state = WorkerState(["list", "detail"])
    state.took("list", None)
    state.ran_empty("list")
    state.signal_came("list")
    assert state.take_signal("list") and "list" not in state.empty  # work again
    assert not state.take_signal("list")
    state.signal_came("list")
    assert state.give_up_signal("list") and not state.give_up_signal("list")
    state.signal_came("detail")
    state.found_full("detail")
    assert state.signalled & state.full == {"detail"}
    state.tokens_passed()
    assert not state.signalled


def test_a_drained_stage_wakes_the_loop_when_work_comes_back() -> None:
    async def main() -> None:
        state = WorkerState(["list"])
        wakeup = state.opened()
        assert wakeup.is_set()
        wakeup.clear()
        state.took("list", None)
        state.queued_again("list")  # not drained: nothing to do
        assert not wakeup.is_set()
        state.ran_empty("list")
        state.queued_again("list")
        assert wakeup.is_set() and "list" not in state.empty
        state.start_urls_came()
        assert state.take_fed() and not state.take_fed()
        state.begin_close()
        assert state.closing

    asyncio.run(main())
