"""The worker's stage choice and waits, as pure decisions (no Redis, no Scrapy)."""

from __future__ import annotations

import math

import pytest

from scrapy_redislock.workers.policy import StagePolicy, next_wake

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


def test_from_an_uncapped_stage_a_worker_moves_up_only_to_preferred_capped_stages_with_work() -> None:
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
