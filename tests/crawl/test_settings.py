"""Bad input, fuzzed: every REDISLOCK_* setting and the lock constructor give a clear error or a
valid config."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from scrapy.settings import BaseSettings, Settings

from scrapy_redislock import ConfigError, CountingLock, InvalidArgument
from scrapy_redislock.crawl import defaults
from scrapy_redislock.crawl.settings import (
    DEFAULT_CLIENT_PARAMS,
    PARSERS,
    AdaptiveSettings,
    ConnectionSettings,
    KeySettings,
    RedisLockSettings,
    group_of,
    read_settings,
)

SETTINGS = [
    "REDISLOCK_ENABLED",
    "REDISLOCK_URL",
    "REDISLOCK_PARAMS",
    "REDISLOCK_STAGES",
    "REDISLOCK_WORKER_STAGES",
    "REDISLOCK_TTL",
    "REDISLOCK_KEY_PREFIX",
    "REDISLOCK_DEFAULT_STAGE",
    "REDISLOCK_CALLBACK_STAGES",
    "REDISLOCK_WAIT_TIMEOUT",
    "REDISLOCK_STAGE_PREFERENCE",
    "REDISLOCK_SCHEDULER_INNER",
    "REDISLOCK_WAITERS_PER_STAGE",
    "REDISLOCK_LOCAL_REUSE",
    "REDISLOCK_IDLE_CLOSE",
    "REDISLOCK_CONNECT_TIMEOUT",
    "REDISLOCK_STAGE_KEY",
    "REDISLOCK_KEY_LIMIT",
    "REDISLOCK_KEY_LIMITS",
    "REDISLOCK_DELAY",
    "REDISLOCK_DELAYS",
    "REDISLOCK_RANDOMIZE_DELAY",
    "REDISLOCK_QUORUM",
    "REDISLOCK_GROUP",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-10, 10**6),
    st.floats(allow_nan=True),
    st.text(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


@given(name=st.sampled_from(SETTINGS), value=values)
# found by a CI run: Scrapy's getbool raised OverflowError
@example(name="REDISLOCK_ENABLED", value=float("inf"))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_setting_value_is_accepted_or_named(name: str, value: Any) -> None:
    try:
        read_settings(Settings({name: value}))
    except ConfigError as exc:
        assert name in str(exc) or name.replace("REDISLOCK_", "") in str(exc), (
            name,
            value,
            str(exc),
        )


SCHEMES = [
    "redis",
    "rediss",
    "unix",
    "redis+sentinel",
    "rediss+sentinel",
    "redis+cluster",
    "rediss+cluster",
    "http",
]
url_parts = st.text(alphabet="abc:@/,?&=[]%0123456789.", max_size=24)


@given(
    url=st.one_of(
        st.text(max_size=30), st.builds("{}://{}".format, st.sampled_from(SCHEMES), url_parts)
    )
)
@settings(max_examples=400, deadline=None)
def test_any_url_is_accepted_or_named(url: str) -> None:
    """Every URL form (server, Sentinel, Cluster) is parsed by one function: accepted, or refused
    naming the setting."""
    try:
        read_settings(Settings({"REDISLOCK_URL": url}))
    except ConfigError as exc:
        assert "REDISLOCK_URL" in str(exc), (url, str(exc))


@given(stages=st.dictionaries(st.text(max_size=8), values, max_size=4))
@settings(max_examples=300, deadline=None)
def test_stage_limits_are_checked_one_by_one(stages: dict[str, Any]) -> None:
    try:
        checked = read_settings(Settings({"REDISLOCK_STAGES": stages})).stages
    except ConfigError as exc:
        assert "REDISLOCK_STAGES" in str(exc)
        return
    for stage, limit in checked.items():
        assert stage and "{" not in stage and "}" not in stage
        assert limit is None or (type(limit) is int and limit >= 0)


@pytest.mark.integration
@given(name=values, limit=values, ttl=values, prefix=values)
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_lock_constructor_names_the_bad_argument_and_writes_nothing(
    redis_client: redis.Redis, name: Any, limit: Any, ttl: Any, prefix: Any
) -> None:
    try:
        lock = CountingLock(redis_client, name, limit=limit, ttl=ttl, key_prefix=prefix)
    except InvalidArgument as exc:
        assert any(
            arg in str(exc) for arg in ("name", "limit", "ttl", "key_prefix", "reentrant")
        ), str(exc)
        assert redis_client.dbsize() == 0  # a rejected construction leaves nothing in Redis
        return
    assert lock.name == name
    redis_client.flushdb()


def test_local_reuse_is_seconds_at_least_zero() -> None:
    assert read_settings(Settings({"REDISLOCK_LOCAL_REUSE": "0.5"})).local_reuse == 0.5
    assert read_settings(Settings({"REDISLOCK_LOCAL_REUSE": 0})).local_reuse == 0.0
    for bad in (-1, "soon", True, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="REDISLOCK_LOCAL_REUSE"):
            read_settings(Settings({"REDISLOCK_LOCAL_REUSE": bad}))


@pytest.mark.parametrize("spelled", [None, "None", "none", "null", "", " None "])
def test_none_is_spelled_the_same_for_every_optional_setting(spelled: Any) -> None:
    """``-s NAME=None`` (or an empty value) means None for each setting whose default is None."""
    optional = [setting for setting in defaults.TABLE if setting.default is None]
    assert len(optional) == 9
    read = read_settings(
        Settings({"REDISLOCK_STAGES": {"detail": 3}} | {s.name: spelled for s in optional})
    )
    assert (read.redis.url_setting, read.redis.params) == ("the default URL", DEFAULT_CLIENT_PARAMS)
    for setting in optional:
        if setting.field not in ("url", "params"):
            assert field_of(read, setting.field) is None, setting.name


def field_of(read: RedisLockSettings, field: str) -> Any:
    """A field of the checked settings, in whichever group it sits."""
    for group in (read, read.redis, read.keys):
        if hasattr(group, field):
            return getattr(group, field)
    raise AttributeError(field)


def test_the_table_has_a_parser_and_a_field_for_each_setting() -> None:
    groups = (RedisLockSettings, ConnectionSettings, KeySettings, AdaptiveSettings)
    fields = {f.name for group in groups for f in dataclasses.fields(group)} - {"redis", "keys"}
    for setting in defaults.TABLE:
        assert setting.kind in PARSERS, setting.name
        assert setting.field in fields, setting.name
        assert setting.doc.endswith("."), setting.name
    # what read_settings adds from the rules across settings
    assert fields - {s.field for s in defaults.TABLE} == {
        "url_setting", "masters", "scoped", "stage_rates", "paused_stages"
    }  # fmt: skip
    assert list(defaults.SETTINGS) == [s.name for s in defaults.TABLE]
    assert read_settings(Settings()).ttl == defaults.SETTINGS["REDISLOCK_TTL"]


def test_allowed_schemes_are_a_list_of_url_schemes() -> None:
    """REDISLOCK_ALLOWED_SCHEMES (issue 41): http and https by default; a list, or commas on the
    command line; anything else named."""
    assert read_settings(Settings()).allowed_schemes == ("http", "https")
    assert read_settings(Settings({"REDISLOCK_ALLOWED_SCHEMES": "HTTPS,s3"})).allowed_schemes == (
        "https",
        "s3",
    )
    assert read_settings(
        Settings({"REDISLOCK_ALLOWED_SCHEMES": '["http", "ftp"]'})
    ).allowed_schemes == ("http", "ftp")
    for bad in ([], "", ["http://"], [1], "file:"):
        with pytest.raises(ConfigError, match="REDISLOCK_ALLOWED_SCHEMES must be a non-empty list"):
            read_settings(Settings({"REDISLOCK_ALLOWED_SCHEMES": bad}))


def test_the_cap_group_is_the_spiders_name_unless_set_and_bad_ones_are_named() -> None:
    def group(value: Any = None, spider: str | None = "shop") -> str:
        raw = {} if value is None else {"REDISLOCK_GROUP": value}
        # BaseSettings: without Scrapy's defaults, where tests/conftest.py puts the harness's ''
        return group_of(read_settings(BaseSettings(raw)), spider)

    assert group() == "shop"  # the default: caps belong to their spider
    assert group("shops") == "shops"  # several spiders share by naming one group
    assert group("") == ""  # the 0.x key names, shared by every spider that sets ''
    assert group("%(spider)s-v2") == "shop-v2"
    assert group("100%%") == "100%"
    for bad, words in [
        ("{shops}", "REDISLOCK_GROUP must be a name without braces, got '{shops}'"),
        ("%(name)s", "REDISLOCK_GROUP may contain %(spider)s and no other % placeholder"),
        (3, "REDISLOCK_GROUP must be a string (a group name, or '' for none), got 3"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            group(bad)
    with pytest.raises(ConfigError, match=re.escape("the spider's name 'a{b}' has braces")):
        group(spider="a{b}")
    assert group(spider=None) == ""  # a spider with no name: no group
