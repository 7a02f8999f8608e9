"""Pure tests of one owner's wait consumers and its registration (no Redis)."""

from __future__ import annotations

from scrapy_redislock.lock.consumers import ABANDONED_PASSES, Consumers, Registration
from scrapy_redislock.lock.wait import block_ms, grant_from


def test_a_freed_consumer_is_reused_before_a_new_one_is_made() -> None:
    consumers = Consumers("host:1:ab")
    first, second = consumers.take(), consumers.take()
    assert (first, second) == ("host:1:ab#1", "host:1:ab#2")
    consumers.free(first)
    consumers.free(first)  # twice: listed once
    assert consumers.idle == [first]
    assert consumers.take() == first and consumers.take() == "host:1:ab#3"


def test_only_this_owners_wait_consumers_are_pooled() -> None:
    consumers = Consumers("host:1:ab")
    consumers.free("host:1:ab")  # the owner's own consumer holds renewed grants: never a wait's
    consumers.free("other:2:cd#1")
    assert consumers.idle == []


def test_an_abandoned_consumer_is_cleaned_by_two_renewals_and_never_reused() -> None:
    consumers = Consumers("o")
    name = consumers.take()
    consumers.abandon(name)
    assert consumers.abandoned == {name: ABANDONED_PASSES} == {name: 2}
    consumers.cleaned([name])
    assert consumers.abandoned == {name: 1}
    consumers.cleaned([name])
    assert consumers.abandoned == {} and consumers.take() == "o#2"


def test_a_registration_is_due_until_done_and_again_after_a_quiet_spell() -> None:
    registration = Registration()
    assert registration.due(now=0.0, ttl=10.0) and not registration.ever
    registration.done(now=5.0)
    assert not registration.due(now=15.0, ttl=10.0) and registration.due(now=15.1, ttl=10.0)
    registration.current = False  # Redis lost the lock
    assert registration.due(now=6.0, ttl=10.0) and registration.ever


def test_block_ms_caps_the_wait_and_says_when_the_deadline_passed() -> None:
    assert block_ms(None, now=0.0, max_block=None) == 0  # forever
    assert block_ms(None, now=0.0, max_block=2.5) == 2500
    assert block_ms(1.0, now=0.9995, max_block=None) == 1  # at least 1 ms
    assert block_ms(10.0, now=0.0, max_block=2.0) == 2000
    assert block_ms(1.0, now=1.0, max_block=None) is None


def test_grant_from_reads_resp2_and_resp3_replies() -> None:
    assert grant_from(None) is None and grant_from([]) is None
    assert grant_from([[b"k", [[b"0-7", [b"g", b"1"]]]]]) == "0-7"
    assert grant_from({b"k": [[b"0-8", [b"g", b"1"]]]}) == "0-8"
    assert grant_from({b"k": [[[b"0-9", [b"g", b"1"]]]]}) == "0-9"
