"""Why a request waits, as a structured value: pure, no Redis (the values Redis gives are built by
hand)."""

from __future__ import annotations

from scrapy_redislock.lock.permit import LIMBO
from scrapy_redislock.lock.status import Grant, Process, StageStatus, _light, wait_reason

OWNER_A = "redislock:host-a:1:abc"
OWNER_B = "redislock:host-b:2:def"


def status(limit: int = 2, grants: list[Grant] | None = None, **fields: object) -> StageStatus:
    grants = grants or []
    base: dict[str, object] = {
        "stage": "detail",
        "exists": True,
        "limit": limit,
        "ttl": 30.0,
        "held": len(grants),
        "free": max(0, limit - len(grants)),
        "debt": 0,
        "waiters": 1,
        "fence": 7,
        "grants": grants,
        "processes": [
            Process(OWNER_A, 1, 0, {"host": "host-a", "pid": 1}),
            Process(OWNER_B, 1, 1, {"host": "host-b", "pid": 2, "limit": 0}),
        ],
    }
    base.update(fields)
    return StageStatus(**base)  # type: ignore[arg-type]


def grant(owner: str, n: int, age: float) -> Grant:
    return Grant(f"{owner}#{n}", f"{n}-0", n, age, 30.0 - age)


def test_a_free_slot_is_no_reason() -> None:
    reason = wait_reason(status(grants=[grant(OWNER_A, 1, 0.5)]))
    assert not reason and reason.kind == "free" and str(reason) == "" and not reason.calm


def test_every_slot_held_by_live_holders_is_calm() -> None:
    reason = wait_reason(status(grants=[grant(OWNER_A, 1, 0.5), grant(OWNER_B, 2, 1.0)]))
    assert reason and reason.kind == "held" and reason.calm and reason.stale == 0
    assert reason.text.startswith("all 2 slots held: ")
    assert "dead?" not in reason.text


def test_a_holder_that_stopped_renewing_is_counted_and_not_calm() -> None:
    reason = wait_reason(status(grants=[grant(OWNER_A, 1, 0.5), grant(OWNER_B, 2, 12.0)]))
    assert reason.kind == "held" and reason.stale == 1 and not reason.calm
    assert "not renewed for 12" in reason.text and "dead?" in reason.text


def test_paused_recovery_and_missing_are_warnings_with_their_kind() -> None:
    paused = wait_reason(status(limit=0))
    assert paused.kind == "paused" and not paused.calm
    assert "paused: limit 0 in Redis, set by host-b" in paused.text
    limbo = wait_reason(status(grants=[Grant(LIMBO, "1-0", 1, 1.0, 29.0)]), now=0.0)
    assert limbo.kind == "recovery" and "1 of 2 slots reserved" in limbo.text
    missing = wait_reason(status(exists=False))
    assert missing.kind == "missing" and "data loss?" in missing.text


def test_why_waiting_in_json_is_the_reasons_text() -> None:
    held = status(grants=[grant(OWNER_A, 1, 0.5), grant(OWNER_B, 2, 1.0)], debt=1)
    assert held.to_json()["why_waiting"] == wait_reason(held).text
    assert ", 1 more to give back after the limit was lowered" in wait_reason(held).text


def test_an_operators_pin_on_a_keys_light_path_is_no_grant() -> None:
    """``set-limit key:X 0`` pins the light path's limit (``#pinned`` beside ``#limit``): status
    shows a limit of 0 and nobody holding, not an expired grant of an owner ''."""
    status = _light("key:example.com", [(b"#limit", 0.0), (b"#pinned", 1.0)])
    assert status is not None
    assert status.grants == [] and status.held == 0 and status.limit == 0
