"""REDISLOCK_SCOPES, REDISLOCK_SCOPES_OF and a request's scopes: pure code, no Redis."""

from __future__ import annotations

import pytest
from scrapy import Request
from scrapy.settings import Settings

from scrapy_redislock.crawl.scopes import ScopePolicy, parse_rate, proxy, request_scopes
from scrapy_redislock.crawl.settings import read_settings
from scrapy_redislock.errors import ConfigError, KeyFunctionError


@pytest.mark.parametrize(
    ("raw", "rate"),
    [("10/s", (10, 1.0)), ("100/60s", (100, 60.0)), ("600/m", (600, 60.0)), ("5/0.5", (5, 0.5)),
     ([3, 2], (3, 2.0)), ("1/h", (1, 3600.0))],
)  # fmt: skip
def test_rates(raw: object, rate: tuple[int, float]) -> None:
    assert parse_rate(raw, "R") == rate


@pytest.mark.parametrize(
    ("scopes", "message"),
    [
        ({"a": {"rate": "ten/s"}}, "REDISLOCK_SCOPES['a']['rate'] must be a rate 'N/T'"),
        ({"a": {"rate": "0/s"}}, "must be an integer from 1 to 1000, got 0"),
        (
            {"a": {"rate": [1, 0]}},
            "the window must be a number of seconds from 0.001 to 86400, got 0",
        ),
        (
            {"a": {"limit": 0}},
            "REDISLOCK_SCOPES['a']['limit'] must be an integer from 1 to 1000 or None",
        ),
        ({"a": {"delay": "1"}}, "REDISLOCK_SCOPES['a']['delay'] must be a number of seconds"),
        ({"a": {"limt": 1}}, "REDISLOCK_SCOPES['a'] has unknown field(s) ['limt']"),
        (
            {"a": 3},
            "REDISLOCK_SCOPES['a'] must be a dict of limit, delay, rate, adaptive, retry_after, got 3",
        ),
        (
            {"a": {"adaptive": 1, "limit": 2}},
            "REDISLOCK_SCOPES['a']['adaptive'] must be True or False",
        ),
        (
            {"a": {"retry_after": "yes"}},
            "REDISLOCK_SCOPES['a']['retry_after'] must be True or False",
        ),
        (
            {"a": {"adaptive": True}},
            "REDISLOCK_SCOPES['a'] is adaptive but has no 'limit': the cap is the ceiling",
        ),
        ({"a{b}": {}}, "a scope name must be a non-empty string"),
        (["a"], "REDISLOCK_SCOPES must be a dict"),
    ],
)
def test_bad_scopes_are_refused_by_name(scopes: object, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        read_settings(Settings({"REDISLOCK_SCOPES": scopes}))
    assert message in str(raised.value)


def test_policies_exact_then_patterns_then_short_forms() -> None:
    settings = read_settings(
        Settings(
            {
                "REDISLOCK_STAGE_KEY": "domain",
                "REDISLOCK_KEY_LIMIT": 4,
                "REDISLOCK_DELAY": 0.5,
                "REDISLOCK_KEY_LIMITS": {"b.com": 1},
                "REDISLOCK_SCOPES": {
                    "proxy:*": {"rate": "10/s"},
                    "proxy:slow": {"limit": 1, "delay": 2},
                    "*.shop.com": {"limit": 2},
                },
            }
        )
    )
    keys = settings.keys
    assert keys.scopes.match("proxy:slow") == ScopePolicy(limit=1, delay=2.0)
    policy_of = settings.policy_of
    # a policy's missing field is none, not a short form
    assert policy_of("proxy:p1") == ScopePolicy(rate=(10, 1.0))
    assert policy_of("x.shop.com") == ScopePolicy(limit=2)
    # no entry: the short forms
    assert policy_of("b.com") == ScopePolicy(limit=1, delay=0.5)
    assert policy_of("c.com") == ScopePolicy(limit=4, delay=0.5)
    assert keys.capped and settings.keyed


def test_crawl_delay_makes_the_domain_the_key() -> None:
    settings = read_settings(Settings({"REDISLOCK_CRAWL_DELAY": True}))
    assert settings.keys.stage_key is not None
    assert settings.keys.stage_key(Request("https://a.example.com/x"), None) == "a.example.com"
    assert settings.policy_of("a.example.com").limit is None  # no cap: a delay only


def test_a_requests_scopes() -> None:
    request = Request(
        "https://a.com/x",
        meta={"redislock_scopes": ["render", "api:k1", "render"], "proxy": "http://u:p@p1:8080"},
    )
    assert request_scopes(request, None, proxy) == ("api:k1", "proxy:p1:8080", "render")
    assert request_scopes(Request("https://a.com/"), None, proxy) == ()
    assert request_scopes(Request("https://a.com/", meta={"dont_redislock": True,
                                                          "redislock_scopes": ["x"]}), None, None) == ()  # fmt: skip
    with pytest.raises(KeyFunctionError, match=r"meta\['redislock_scopes'\] must be a list"):
        request_scopes(Request("https://a.com/", meta={"redislock_scopes": "render"}), None, None)
    with pytest.raises(KeyFunctionError, match="returned the string 'x'"):
        request_scopes(Request("https://a.com/"), None, lambda request, spider: "x")
    with pytest.raises(KeyFunctionError, match="raised ZeroDivisionError"):
        request_scopes(Request("https://a.com/"), None, lambda request, spider: 1 / 0)
    with pytest.raises(KeyFunctionError, match="is not a scope name"):
        request_scopes(Request("https://a.com/", meta={"redislock_scopes": ["a{b}"]}), None, None)


def test_scopes_of_refuses_what_is_not_a_function() -> None:
    with pytest.raises(ConfigError, match="REDISLOCK_SCOPES_OF must be 'proxy' or the dotted path"):
        read_settings(Settings({"REDISLOCK_SCOPES_OF": "proxies"}))
    with pytest.raises(ConfigError, match="REDISLOCK_SCOPES_OF cannot be loaded"):
        read_settings(Settings({"REDISLOCK_SCOPES_OF": "no.such.function"}))


def test_what_adapts_and_pauses_per_scope() -> None:
    """A scope adapts and pauses when its entry says so; a key without an entry follows
    REDISLOCK_ADAPTIVE "keys"; a scope's adaptive ceiling must not be under REDISLOCK_ADAPTIVE_MIN."""
    settings = read_settings(
        Settings(
            {
                "REDISLOCK_STAGE_KEY": "domain",
                "REDISLOCK_KEY_LIMIT": 4,
                "REDISLOCK_ADAPTIVE": ["keys"],
                "REDISLOCK_SCOPES": {
                    "render": {"limit": 8, "adaptive": True, "retry_after": True},
                    "proxy:*": {"limit": 8},
                },
            }
        )
    )
    render, proxy, site = (settings.policy_of(n) for n in ("render", "proxy:a", "example.com"))
    # an entry's own word, else REDISLOCK_ADAPTIVE's "keys" for the short forms
    assert render.adaptive and not proxy.adaptive and site.adaptive
    assert render.retry_after and not proxy.retry_after and not site.retry_after
    assert settings.adaptive.needed and settings.adaptive.scoped and settings.adaptive.watched
    with pytest.raises(ConfigError) as raised:
        read_settings(
            Settings(
                {
                    "REDISLOCK_ADAPTIVE_MIN": 4,
                    "REDISLOCK_SCOPES": {"render": {"limit": 2, "adaptive": True}},
                }
            )
        )
    assert "REDISLOCK_ADAPTIVE_MIN = 4 is above the limit of REDISLOCK_SCOPES['render'] (2)" in str(
        raised.value
    )


def test_a_stages_policy_unfolds_into_the_short_forms() -> None:
    """REDISLOCK_STAGES takes a stage's whole policy, like an entry of REDISLOCK_SCOPES: its cap
    (0 allowed: paused), delay, rate window, adaptive limit and Retry-After pause."""
    settings = read_settings(
        Settings(
            {
                "REDISLOCK_STAGES": {
                    "list": 1,
                    "detail": {"limit": 3, "rate": "10/s", "delay": 0.2, "adaptive": True},
                    "comments": {"limit": 0, "retry_after": True},
                    "images": None,
                },
                "REDISLOCK_DELAYS": {"list": 1.0},
            }
        )
    )
    assert settings.stages == {"list": 1, "detail": 3, "comments": 0, "images": None}
    assert settings.stage_rates == {"detail": (10, 1.0)}
    assert settings.policy_of("detail", stage=True) == ScopePolicy(
        limit=3, delay=0.2, rate=(10, 1.0), adaptive=True
    )
    assert settings.policy_of("list", stage=True) == ScopePolicy(limit=1, delay=1.0)
    # paused by a Retry-After: only a capped stage (0 is a cap)
    assert settings.policy_of("comments", stage=True) == ScopePolicy(limit=0, retry_after=True)
    assert settings.policy_of("images", stage=True) == ScopePolicy()
    assert settings.adaptive.stages == {"detail"}
    assert settings.adaptive.pauses("comments") and not settings.adaptive.pauses("detail")
    assert settings.adaptive.needed and settings.keyed
    plain = read_settings(Settings({"REDISLOCK_STAGES": {"detail": 3}}))
    assert plain.stage_rates == {} and not plain.keyed and not plain.adaptive.needed


@pytest.mark.parametrize(
    ("stages", "extra", "message"),
    [
        ({"detail": {"limit": 3, "rate": "ten"}}, {},
         "REDISLOCK_STAGES['detail']['rate'] must be a rate 'N/T'"),
        ({"detail": {"limit": -1}}, {},
         "REDISLOCK_STAGES['detail']['limit'] must be an integer from 0 to 1000 or None (no cap), got -1"),
        ({"detail": {"limt": 3}}, {}, "REDISLOCK_STAGES['detail'] has unknown field(s) ['limt']"),
        ({"detail": {"delay": 0.5}}, {"REDISLOCK_DELAYS": {"detail": 1}},
         "REDISLOCK_STAGES['detail'] gives a delay (0.5) and REDISLOCK_DELAYS['detail'] gives one too (1"),
        ({"detail": {"retry_after": True}}, {},
         "REDISLOCK_STAGES['detail'] pauses on Retry-After but has no 'limit'"),
        ({"detail": {"adaptive": True}}, {},
         "REDISLOCK_STAGES['detail'] is adaptive but has no 'limit'"),
        ({"detail": {"limit": 2, "adaptive": True}}, {"REDISLOCK_ADAPTIVE_MIN": 3},
         "REDISLOCK_ADAPTIVE_MIN = 3 is above the cap of stage 'detail' (2)"),
    ],
)  # fmt: skip
def test_a_bad_stage_policy_is_refused_by_name(
    stages: object, extra: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        read_settings(Settings({"REDISLOCK_STAGES": stages, **extra}))
    assert message in str(raised.value)
