"""Keys and delays, pure parts: REDISLOCK_STAGE_KEY and its kinds, the key settings and their
errors, the gap."""

from __future__ import annotations

from typing import Any

import pytest
from scrapy import Request
from scrapy.settings import Settings

from scrapy_redislock import ConfigError, KeyFunctionError
from scrapy_redislock.crawl.keys import domain, download_slot, key_function, request_key
from scrapy_redislock.crawl.settings import read_settings
from scrapy_redislock.lock.delay import delay_keys, gap_of


def read(**given: Any) -> Any:
    return read_settings(Settings(given))


def test_kinds() -> None:
    request = Request("https://Shop.Example.com:8443/a?b=1")
    assert key_function("domain") is domain and key_function("download_slot") is download_slot
    assert domain(request) == "shop.example.com"
    assert download_slot(request) == "shop.example.com"
    assert download_slot(Request("https://a.com/", meta={"download_slot": "pool-1"})) == "pool-1"
    assert domain(Request("data:,hello")) is None
    assert key_function(None) is None and key_function("") is None
    assert (
        key_function("testing.spiders.crawlspider.path_key")(Request("http://h/x/7"), None)
        == "page-7"
    )
    assert key_function(len) is len  # an object works as well as its path


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("domian", "REDISLOCK_STAGE_KEY must be 'domain', 'download_slot' or the dotted path"),
        ("nowhere.at_all", "REDISLOCK_STAGE_KEY cannot be loaded: 'nowhere.at_all'"),
        ("scrapy_redislock.crawl.keys.KEY_MAX", "REDISLOCK_STAGE_KEY must be a function"),
        (42, "REDISLOCK_STAGE_KEY must be a function (request, spider) -> key or None, got 42"),
    ],
)
def test_bad_stage_key(value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read(REDISLOCK_STAGE_KEY=value)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"REDISLOCK_KEY_LIMIT": -1}, "REDISLOCK_KEY_LIMIT must be an integer"),
        ({"REDISLOCK_KEY_LIMIT": 0}, "REDISLOCK_KEY_LIMIT must be an integer >= 1 or None"),
        ({"REDISLOCK_KEY_LIMIT": "two"}, "REDISLOCK_KEY_LIMIT must be an integer"),
        ({"REDISLOCK_KEY_LIMITS": {"a.com": -2}}, "REDISLOCK_KEY_LIMITS['a.com']"),
        (
            {"REDISLOCK_KEY_LIMITS": {"a.com": 0}},
            "REDISLOCK_KEY_LIMITS['a.com'] must be an integer >= 1",
        ),
        ({"REDISLOCK_KEY_LIMITS": "{nope"}, "REDISLOCK_KEY_LIMITS must be a dict"),
        ({"REDISLOCK_DELAY": -1}, "REDISLOCK_DELAY must be a number of seconds >= 0, got -1"),
        ({"REDISLOCK_DELAY": float("inf")}, "REDISLOCK_DELAY must be a number of seconds >= 0"),
        ({"REDISLOCK_DELAY": True}, "REDISLOCK_DELAY must be a number of seconds >= 0, got True"),
        (
            {"REDISLOCK_DELAY": 1e15},  # Redis would refuse the delay's script, for ever
            "REDISLOCK_DELAY must be a number of seconds from 0 to 86400, got 1000000000000000.0",
        ),
        (
            {"REDISLOCK_DELAYS": {"a.com": 90000}},
            "REDISLOCK_DELAYS['a.com'] must be a number of seconds from 0 to 86400, got 90000",
        ),
        (
            {"REDISLOCK_DELAYS": {"a.com": "soon"}},
            "REDISLOCK_DELAYS['a.com'] must be a number of seconds",
        ),
        (
            {"REDISLOCK_DELAYS": {"{x}": 1}},
            "REDISLOCK_DELAYS: names must be non-empty strings without braces",
        ),
        ({"REDISLOCK_RANDOMIZE_DELAY": "maybe"}, "REDISLOCK_RANDOMIZE_DELAY must be True or False"),
    ],
)
def test_bad_key_settings_name_the_setting(given: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("{", r"\{")):
        read(REDISLOCK_STAGE_KEY="domain", **given)


def test_key_settings_need_a_stage_key() -> None:
    for given in (
        {"REDISLOCK_KEY_LIMIT": 2},
        {"REDISLOCK_KEY_LIMITS": {"a.com": 1}},
        {"REDISLOCK_DELAY": 1.0},
    ):
        name = next(iter(given))
        with pytest.raises(ConfigError, match=f"{name} is set but REDISLOCK_STAGE_KEY is not"):
            read(**given)
    with pytest.raises(
        ConfigError, match=r"REDISLOCK_DELAYS names \['a.com'\], which are not stages"
    ):
        read(REDISLOCK_STAGES={"detail": 2}, REDISLOCK_DELAYS={"a.com": 1})
    # a stage delay alone
    assert read(REDISLOCK_STAGES={"detail": 2}, REDISLOCK_DELAYS={"detail": 1}).keyed


def test_limits_and_delays_per_key_and_stage() -> None:
    checked = read(
        REDISLOCK_STAGES={"detail": 3},
        REDISLOCK_STAGE_KEY="domain",
        REDISLOCK_KEY_LIMIT="2",  # as -s gives it
        REDISLOCK_KEY_LIMITS='{"big.com": 10, "free.com": null}',
        REDISLOCK_DELAY="0.5",
        REDISLOCK_DELAYS={"slow.com": 3, "detail": 0.25},
    )
    assert checked.keys.key_limit == 2
    policy_of = checked.policy_of
    assert (
        policy_of("a.com").limit,
        policy_of("big.com").limit,
        policy_of("free.com").limit,
    ) == (2, 10, None)
    assert policy_of("a.com").delay == 0.5 and policy_of("slow.com").delay == 3
    assert (
        policy_of("detail", stage=True).delay == 0.25 and policy_of("other", stage=True).delay == 0
    )
    # a key named like a stage gets the default: the stage's entry is not it
    assert policy_of("detail").delay == 0.5
    plain = read(REDISLOCK_STAGES={"detail": 3})
    assert plain.keys.stage_key is None and not plain.keyed


def test_request_key_fails_one_request_with_the_reason() -> None:
    def broken(request: Request, spider: Any) -> str:
        raise LookupError("no table")

    with pytest.raises(KeyFunctionError, match=r"raised LookupError: no table for http://a.com/x"):
        request_key(Request("http://a.com/x"), None, broken)
    for bad in ("", "a{b}", 7, "x" * 300):
        with pytest.raises(KeyFunctionError, match="a key must be None or a non-empty string"):
            request_key(Request("http://a.com/x"), None, lambda request, spider, bad=bad: bad)
    assert request_key(Request("http://a.com/x"), None, lambda request, spider: None) is None


def test_gap_and_gate() -> None:
    assert gap_of(2.0, False) == 2.0
    assert gap_of(2.0, True, rng=lambda: 0.0) == 1.0 and gap_of(
        2.0, True, rng=lambda: 0.999
    ) == pytest.approx(2.998)
    assert delay_keys("redislock", "key:a.com").gate == "redislock:{key:a.com}:gate"
