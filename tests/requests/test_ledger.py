"""The permit ledger: the hand-off's bookkeeping, pure (no Redis, no crawler)."""

from __future__ import annotations

from dataclasses import dataclass

from scrapy_redislock.requests.ledger import PermitLedger


@dataclass
class FakePermit:
    """Stands in for a Permit (the ledger reads nothing of it)."""

    acquired_at: float


def test_a_handed_slot_is_held_until_finished_and_an_error_is_no_slot() -> None:
    ledger: PermitLedger[str, FakePermit] = PermitLedger()
    permit, error = FakePermit(0.0), ValueError("no slot")
    ledger.hand("a", permit)
    ledger.hand("b", error)
    assert ledger.permit_of("a") is permit and ledger.permit_of("c") is None
    assert ledger.peek("b") is error and ledger.permit_of("b") is None
    assert ledger.holding() == ["a"]
    assert ledger.finish("b") is None  # an error is no slot to free
    assert ledger.finish("a") is permit
    assert ledger.finish("a") is None  # freed once
    assert ledger.holding() == [] and ledger.peek("b") is None  # nothing left


def test_hold_and_forget() -> None:
    ledger: PermitLedger[str, FakePermit] = PermitLedger()
    permit = FakePermit(0.0)
    ledger.hold("a", permit)
    assert ledger.permit_of("a") is permit
    ledger.forget("a")
    assert ledger.finish("a") is None


def test_sweep_finishes_a_request_missing_from_the_downloader_twice_in_a_row() -> None:
    ledger: PermitLedger[str, FakePermit] = PermitLedger()
    gone, back, stays = FakePermit(1.0), FakePermit(2.0), FakePermit(3.0)
    ledger.hold("gone", gone)
    ledger.hold("back", back)
    ledger.hold("stays", stays)
    assert ledger.sweep(None) == []  # no downloader yet: nothing is judged
    assert ledger.sweep({"stays"}) == []  # missing once: a suspect
    assert ledger.sweep({"stays", "back"}) == [gone]  # missing twice
    assert ledger.holding() == ["back", "stays"]
    assert ledger.sweep({"stays"}) == []  # "back" is missing once more: a suspect again, not gone
    assert ledger.sweep({"stays"}) == [back]
    assert ledger.holding() == ["stays"]


def test_clear_forgets_slots_and_suspects() -> None:
    ledger: PermitLedger[str, FakePermit] = PermitLedger()
    ledger.hold("a", FakePermit(0.0))
    ledger.sweep(set())
    ledger.clear()
    ledger.hold("a", FakePermit(0.0))
    assert ledger.sweep(set()) == []  # the old suspicion went with clear()
