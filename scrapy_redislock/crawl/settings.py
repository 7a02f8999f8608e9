"""Read and check every REDISLOCK_* setting, in one place.

Settings read: REDISLOCK_ENABLED, REDISLOCK_URL, REDISLOCK_PARAMS, REDISLOCK_STAGES,
REDISLOCK_WORKER_STAGES, REDISLOCK_TTL, REDISLOCK_DURABLE, REDISLOCK_KEY_PREFIX,
REDISLOCK_DEFAULT_STAGE, REDISLOCK_CALLBACK_STAGES, REDISLOCK_WAIT_TIMEOUT,
REDISLOCK_STAGE_PREFERENCE, REDISLOCK_SCHEDULER_INNER, REDISLOCK_WAITERS_PER_STAGE,
REDISLOCK_LOCAL_REUSE, REDISLOCK_IDLE_CLOSE, REDISLOCK_CONNECT_TIMEOUT, REDISLOCK_STAGE_KEY,
REDISLOCK_KEY_LIMIT, REDISLOCK_KEY_LIMITS, REDISLOCK_DELAY, REDISLOCK_DELAYS,
REDISLOCK_RANDOMIZE_DELAY, REDISLOCK_QUORUM; and scrapy-redis's REDIS_URL, REDIS_HOST, REDIS_PORT,
REDIS_DB, REDIS_PARAMS as fallbacks for the connection (URLs are parsed by
:mod:`scrapy_redislock.crawl.connection`). Defaults live in :mod:`scrapy_redislock.crawl.defaults`.
For the worker scheduler (:func:`read_worker_settings`) also scrapy-redis's SCHEDULER_PERSIST,
SCHEDULER_FLUSH_ON_START, MAX_IDLE_TIME_BEFORE_CLOSE (fallback of REDISLOCK_IDLE_CLOSE),
REDIS_START_URLS_AS_SET, REDIS_START_URLS_AS_ZSET, SCHEDULER_SERIALIZER (the request format of the
queues: :mod:`scrapy_redislock.crawl.requestformat` when unset).

Bad values raise :class:`~scrapy_redislock.errors.ConfigError` naming the setting and the value, so
a crawl with a broken configuration stops at start-up instead of running unthrottled (Scrapy would
swallow NotConfigured from a middleware and go on without it). So does a setting whose name starts
with REDISLOCK (or REDIS_LOCK) but is not one of ours: a misspelled REDISLOCK_STAGE would otherwise
leave every stage uncapped; the error names the closest known setting.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio
from scrapy.settings import BaseSettings

from scrapy_redislock._redis import check_limit, check_name, check_ttl
from scrapy_redislock.crawl import defaults
from scrapy_redislock.crawl.connection import RedisURL, mask_url, parse_url
from scrapy_redislock.crawl.inner import check_inner_scheduler
from scrapy_redislock.crawl.keys import KeyFunction, key_function
from scrapy_redislock.crawl.requestformat import serializer_of
from scrapy_redislock.crawl.stages import unknown_stage
from scrapy_redislock.errors import ConfigError, InvalidArgument
from scrapy_redislock.lock.quorum import master_options, safe_quorum

# Client keyword arguments that make sense for our connections (scrapy-redis's REDIS_PARAMS may hold
# more).
CLIENT_PARAMS = {
    "socket_timeout",
    "socket_connect_timeout",
    "socket_keepalive",
    "retry_on_timeout",
    "health_check_interval",
    "password",
    "username",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "client_name",
    "max_connections",
    "protocol",
}
# Blocking waits must outlast the socket timeout; scrapy-redis's 30 s default would cut them into
# pieces.
DEFAULT_CLIENT_PARAMS = {"socket_connect_timeout": 10, "health_check_interval": 30}


@dataclass(frozen=True)
class RedisLockSettings:
    """The checked REDISLOCK_* settings of one crawler."""

    enabled: bool = True
    url: str = "redis://localhost:6379/0"
    url_setting: str = "REDISLOCK_URL"  # where the URL came from, for messages (or "the default")
    params: Mapping[str, Any] = field(default_factory=dict)
    stages: Mapping[str, int | None] = field(default_factory=dict)
    worker_stages: Mapping[str, int | None] = field(default_factory=dict)
    ttl: float = 30.0
    durable: bool = False
    key_prefix: str = "redislock"
    default_stage: str | None = None
    callback_stages: Mapping[str, str] = field(default_factory=dict)
    wait_timeout: float | None = None
    stage_preference: tuple[str, ...] = ()
    # a class, or its import path (crawl/inner.py)
    scheduler_inner: str | type = "scrapy.core.scheduler.Scheduler"
    waiters_per_stage: int = 2
    local_reuse: float = 0.25
    idle_close: float | None = None
    connect_timeout: float = 30.0
    stage_key: KeyFunction | None = None
    key_limit: int | None = None
    key_limits: Mapping[str, int | None] = field(default_factory=dict)
    delay: float = 0.0
    delays: Mapping[str, float] = field(default_factory=dict)
    randomize_delay: bool = False
    # REDISLOCK_URL as a list: the quorum lock's independent masters (else empty)
    masters: tuple[str, ...] = ()
    quorum: int | None = None  # REDISLOCK_QUORUM (None: each stage's safe quorum)

    def limit_of_key(self, key: str) -> int | None:
        """The cap of one key: its REDISLOCK_KEY_LIMITS entry, else REDISLOCK_KEY_LIMIT (None:
        uncapped)."""
        return (
            self.key_limits.get(key, self.key_limit) if key in self.key_limits else self.key_limit
        )

    def delay_of(self, name: str, stage: bool = False) -> float:
        """Seconds between two starts of a stage (``stage=True``; 0 unless REDISLOCK_DELAYS names
        it) or a key."""
        if stage:
            return self.delays.get(name, 0.0) if name in self.stages else 0.0
        return self.delays.get(name, self.delay) if name not in self.stages else self.delay

    @property
    def keyed(self) -> bool:
        """Whether anything per key or per-stage delay is configured (the middleware then has work
        per request)."""
        return self.stage_key is not None or any(self.delay_of(s, stage=True) for s in self.stages)

    @property
    def connection(self) -> RedisURL:
        """The parsed URL: a server, Sentinel or Cluster (checked by read_settings)."""
        return parse_url(self.url, self.url_setting)

    def async_client(self) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
        """A redis.asyncio client for the reactor thread (asyncio reactor): the master found through
        Sentinel, or a cluster client, when the URL says so. ConfigError for a list of masters (see
        :meth:`async_clients`)."""
        if self.masters:
            raise ConfigError(
                f"{self.url_setting} lists {len(self.masters)} masters: this needs one Redis (a "
                "list of masters is "
                "for the request front's quorum lock)"
            )
        return self.connection.async_client(**self.params)

    def async_clients(self) -> list[redis.asyncio.Redis | redis.asyncio.RedisCluster]:
        """One client per master of a quorum (no retries, 1 s socket timeouts unless
        REDISLOCK_PARAMS says otherwise: a dead master must not eat the validity time), else the one
        client."""
        if not self.masters:
            return [self.async_client()]
        params = {**master_options(asyncio=True), **self.params}
        return [parse_url(url, self.url_setting).async_client(**params) for url in self.masters]

    @property
    def safe_url(self) -> str:
        if self.masters:
            return "[" + ", ".join(mask_url(url) for url in self.masters) + "]"
        return mask_url(self.url)


def _loaded(settings: BaseSettings, name: str) -> Any:
    """A setting's value; dict/list settings given as JSON strings (e.g. with -s) are decoded."""
    value = settings.get(name, getattr(defaults, name))
    if isinstance(value, str) and name in {
        "REDISLOCK_STAGES",
        "REDISLOCK_WORKER_STAGES",
        "REDISLOCK_CALLBACK_STAGES",
        "REDISLOCK_PARAMS",
        "REDISLOCK_STAGE_PREFERENCE",
        "REDISLOCK_KEY_LIMITS",
        "REDISLOCK_DELAYS",
    }:
        try:
            value = json.loads(value)
        except ValueError:
            raise ConfigError(f"{name} must be a dict (or JSON of one), got {value!r}") from None
    if isinstance(value, BaseSettings):
        value = value.copy_to_dict()
    return value


def check_stage_limits(value: Any, setting: str) -> dict[str, int | None]:
    """{stage: limit or None}; ConfigError naming the setting, the stage and the bad value."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{setting} must be a dict of stage -> limit, got {value!r}")
    checked: dict[str, int | None] = {}
    for stage, limit in value.items():
        _checked(check_name, stage, f"{setting}: a stage name")
        if limit is not None:
            _checked(check_limit, limit, f"{setting}[{stage!r}]", or_none=True)
        checked[stage] = limit
    return checked


def _checked(
    check: Callable[[Any, str], Any], value: Any, what: str, *, or_none: bool = False
) -> Any:
    """``check(value, what)`` (the lock's own argument checks), its InvalidArgument as a
    ConfigError."""
    try:
        return check(value, what)
    except InvalidArgument as exc:
        message = str(exc).replace(", got", " or None (unlimited), got", 1) if or_none else str(exc)
        raise ConfigError(message) from None


def check_url(url: Any, setting: str) -> str:
    """The URL, checked (:func:`~scrapy_redislock.crawl.connection.parse_url`): ConfigError naming
    the setting."""
    return parse_url(url, setting).url


def _url_list(raw: Any, setting: str) -> Any:
    """A list given as JSON (``-s REDISLOCK_URL='["redis://a", "redis://b"]'``) as a list; anything
    else as is."""
    if isinstance(raw, str) and raw.lstrip().startswith("["):
        try:
            return json.loads(raw)
        except ValueError:
            raise ConfigError(
                f"{setting} must be a redis URL or a list of them, got {raw!r}"
            ) from None
    return raw


def check_masters(raw: Any, setting: str) -> tuple[str, ...]:
    """The independent masters of a quorum lock: a list of server or Sentinel URLs, each once;
    ConfigError naming the setting otherwise (a Cluster is one deployment, not an independent
    master)."""
    if not raw:
        raise ConfigError(f"{setting} must be a redis URL or a non-empty list of them, got {raw!r}")
    masters = []
    for url in raw:
        checked = parse_url(url, setting)
        if checked.kind == "cluster":
            raise ConfigError(
                f"{setting} lists a Redis Cluster ({mask_url(checked.url)!r}): a quorum lock needs "
                "independent "
                "masters (plain redis:// servers or Sentinel services), not a cluster"
            )
        if checked.url in masters:
            raise ConfigError(
                f"{setting} lists {mask_url(checked.url)!r} twice: each master must be independent"
            )
        masters.append(checked.url)
    return tuple(masters)


def _connection(settings: BaseSettings) -> tuple[str, str, dict[str, Any], tuple[str, ...]]:
    """URL, the setting it came from, client params, and the quorum's masters (REDISLOCK_URL as a
    list, else empty): REDISLOCK_* first, then scrapy-redis's REDIS_* settings."""
    masters: tuple[str, ...] = ()
    if settings.get("REDISLOCK_URL"):
        source = "REDISLOCK_URL"
        raw = _url_list(settings.get("REDISLOCK_URL"), source)
        if isinstance(raw, list | tuple):
            masters = check_masters(raw, source)
            url = masters[0]
            if len(masters) == 1:
                masters = ()  # one master: the plain lock (a quorum of one is that, at a higher cost)
        else:
            url = check_url(raw, source)
    elif settings.get("REDIS_URL"):
        source = "REDIS_URL"
        raw = _url_list(settings.get("REDIS_URL"), source)
        if isinstance(raw, list | tuple):
            raise ConfigError(
                "REDIS_URL must be one redis URL (scrapy-redis connects to one Redis), got a list "
                f"{raw!r}; a list of "
                "independent masters for the quorum lock goes in REDISLOCK_URL"
            )
        url = check_url(raw, source)
    elif settings.get("REDIS_HOST") or settings.get("REDIS_PORT"):
        source = "REDIS_HOST/REDIS_PORT"
        host = settings.get("REDIS_HOST") or "localhost"
        port = settings.get("REDIS_PORT") or 6379
        db = settings.get("REDIS_DB") or 0
        url = check_url(f"redis://{host}:{port}/{db}", source)
    else:
        source = "the default URL"
        url = "redis://localhost:6379/0"
    own = _loaded(settings, "REDISLOCK_PARAMS")
    params = own if own is not None else settings.getdict("REDIS_PARAMS")
    if not isinstance(params, Mapping):
        raise ConfigError(
            f"REDISLOCK_PARAMS must be a dict of redis client arguments, got {params!r}"
        )
    merged = {} if masters else dict(DEFAULT_CLIENT_PARAMS)  # a quorum's masters: see async_clients
    merged.update({k: v for k, v in params.items() if k in CLIENT_PARAMS})
    return url, source, merged, masters


def check_quorum(
    settings: BaseSettings, masters: tuple[str, ...], stages: Mapping[str, int | None]
) -> int | None:
    """REDISLOCK_QUORUM: None, or an integer from every capped stage's safe quorum to the number of
    masters."""
    raw = settings.get("REDISLOCK_QUORUM", defaults.REDISLOCK_QUORUM)
    if _is_none(raw):
        return None
    if not masters:
        raise ConfigError(
            f"REDISLOCK_QUORUM is set ({raw!r}) but REDISLOCK_URL names one Redis: give "
            "REDISLOCK_URL as a list of "
            "independent masters for a quorum lock, or unset REDISLOCK_QUORUM"
        )
    value = _number(raw)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    count = len(masters)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= count:
        raise ConfigError(
            f"REDISLOCK_QUORUM must be an integer from 1 to {count} (the masters), got {raw!r}"
        )
    for stage, limit in stages.items():
        if limit is not None and value < safe_quorum(count, limit):
            raise ConfigError(
                f"REDISLOCK_QUORUM = {raw!r} is below the safe quorum {safe_quorum(count, limit)} "
                f"of stage {stage!r} "
                f"(limit {limit}, {count} masters): up to {count * limit // value} requests could "
                "hold it at once; "
                "use None (each stage's safe quorum) or a value from the safe quorum to the number "
                "of masters"
            )
    return value


def check_names(settings: BaseSettings) -> None:
    """ConfigError for a setting that looks like ours (REDISLOCK..., REDIS_LOCK...) but is not,
    naming the closest."""
    for name in settings:
        if not isinstance(name, str):
            continue
        if name in defaults.REMOVED:
            raise ConfigError(
                f"{name} was removed: {defaults.REMOVED[name]}; delete it from the settings"
            )
        folded = name.upper().replace("REDIS_LOCK", "REDISLOCK", 1)
        if not folded.startswith("REDISLOCK") or name in defaults.SETTINGS:
            continue
        closest = difflib.get_close_matches(folded, defaults.SETTINGS, n=1, cutoff=0.0)
        raise ConfigError(
            f"{name} is not a scrapy_redislock setting (did you mean {closest[0]}?); "
            f"known: {', '.join(sorted(defaults.SETTINGS))}"
        )


def read_settings(settings: BaseSettings) -> RedisLockSettings:
    """All REDISLOCK_* settings, checked; ConfigError with a message naming the bad one."""
    check_names(settings)
    enabled = _bool(settings, "REDISLOCK_ENABLED")
    url, url_setting, params, masters = _connection(settings)
    stages = check_stage_limits(_loaded(settings, "REDISLOCK_STAGES"), "REDISLOCK_STAGES")
    quorum = check_quorum(settings, masters, stages)
    worker_stages = check_stage_limits(
        _loaded(settings, "REDISLOCK_WORKER_STAGES"), "REDISLOCK_WORKER_STAGES"
    )

    raw_ttl = settings.get("REDISLOCK_TTL", defaults.REDISLOCK_TTL)
    ttl = _checked(check_ttl, _number(raw_ttl), "REDISLOCK_TTL")

    raw_prefix = settings.get("REDISLOCK_KEY_PREFIX", defaults.REDISLOCK_KEY_PREFIX)
    prefix = _checked(check_name, raw_prefix, "REDISLOCK_KEY_PREFIX")

    known = set(stages) | set(worker_stages)
    both = "REDISLOCK_STAGES or REDISLOCK_WORKER_STAGES"
    default_stage = settings.get("REDISLOCK_DEFAULT_STAGE", defaults.REDISLOCK_DEFAULT_STAGE)
    if default_stage is not None and not isinstance(default_stage, str):
        raise ConfigError(
            f"REDISLOCK_DEFAULT_STAGE must be a stage name or None, got {default_stage!r}"
        )
    if default_stage is not None and default_stage not in known:
        raise unknown_stage("REDISLOCK_DEFAULT_STAGE", default_stage, known, both)

    callback_stages = _loaded(settings, "REDISLOCK_CALLBACK_STAGES")
    if not isinstance(callback_stages, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in callback_stages.items()
    ):
        raise ConfigError(
            "REDISLOCK_CALLBACK_STAGES must be a dict of callback name -> stage, got "
            f"{callback_stages!r}"
        )
    for callback, stage in sorted(callback_stages.items()):
        if stage not in known:
            raise unknown_stage(f"REDISLOCK_CALLBACK_STAGES[{callback!r}]", stage, known, both)

    raw_timeout = settings.get("REDISLOCK_WAIT_TIMEOUT", defaults.REDISLOCK_WAIT_TIMEOUT)
    wait_timeout: float | None = None
    if not _is_none(raw_timeout):
        try:
            wait_timeout = float(raw_timeout)
        except (TypeError, ValueError):
            wait_timeout = math.nan
        if isinstance(raw_timeout, bool) or not wait_timeout > 0:
            raise ConfigError(
                "REDISLOCK_WAIT_TIMEOUT must be None or a number of seconds > 0, got "
                f"{raw_timeout!r}"
            )

    preference = _loaded(settings, "REDISLOCK_STAGE_PREFERENCE")
    if not isinstance(preference, list | tuple) or not all(isinstance(s, str) for s in preference):
        raise ConfigError(
            f"REDISLOCK_STAGE_PREFERENCE must be a list of stage names, got {preference!r}"
        )
    stray = sorted(set(preference) - known)
    if stray:
        raise ConfigError(
            f"REDISLOCK_STAGE_PREFERENCE names unknown stages {stray}; known: {sorted(known)}"
        )

    inner = check_inner_scheduler(
        settings.get("REDISLOCK_SCHEDULER_INNER") or defaults.REDISLOCK_SCHEDULER_INNER
    )
    waiters = _positive_int(settings, "REDISLOCK_WAITERS_PER_STAGE")
    local_reuse = _seconds_of(settings, "REDISLOCK_LOCAL_REUSE")
    raw_idle = settings.get("REDISLOCK_IDLE_CLOSE", defaults.REDISLOCK_IDLE_CLOSE)
    idle_close = (
        None if _is_none(raw_idle) else _seconds(raw_idle, "REDISLOCK_IDLE_CLOSE", or_none=True)
    )
    connect_timeout = _seconds_of(settings, "REDISLOCK_CONNECT_TIMEOUT")

    keys = _read_keys(settings, stages)
    if masters and (keys["stage_key"] is not None or keys["delays"]):
        raise ConfigError(
            f"REDISLOCK_URL lists {len(masters)} masters (a quorum lock) but "
            f"{'REDISLOCK_STAGE_KEY' if keys['stage_key'] is not None else 'REDISLOCK_DELAYS'} is "
            "set: caps per key "
            "and delays need one Redis (give REDISLOCK_URL one URL)"
        )
    return RedisLockSettings(
        **keys,
        enabled=enabled,
        url=url,
        url_setting=url_setting,
        params=params,
        stages=stages,
        worker_stages=worker_stages,
        ttl=ttl,
        durable=_bool(settings, "REDISLOCK_DURABLE"),
        key_prefix=prefix,
        default_stage=default_stage,
        callback_stages=dict(callback_stages),
        wait_timeout=wait_timeout,
        stage_preference=tuple(preference),
        scheduler_inner=inner,
        waiters_per_stage=waiters,
        local_reuse=local_reuse,
        idle_close=idle_close,
        connect_timeout=connect_timeout,
        masters=masters,
        quorum=quorum,
    )


def _number(raw: Any) -> Any:
    """A number given as a string (``-s REDISLOCK_TTL=3``) as a float; anything else as it is, for
    the check."""
    if isinstance(raw, str):
        try:
            return float(raw)
        except ValueError:
            return raw
    return raw


def _is_none(raw: Any) -> bool:
    """Whether an optional setting's value means None: None itself, or how ``-s NAME=...`` spells it
    ("None", "none", "null" or nothing), the same for every optional setting."""
    return raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none", "null"))


def _seconds_of(settings: BaseSettings, name: str) -> float:
    """A setting that is a number of seconds >= 0 (see :func:`_seconds`)."""
    return _seconds(settings.get(name, getattr(defaults, name)), name)


def _bool(settings: BaseSettings, name: str, default: bool | None = None) -> bool:
    """A boolean setting (ours: its default from the defaults module); ConfigError naming it
    otherwise."""
    try:
        return settings.getbool(name, getattr(defaults, name) if default is None else default)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(float("inf"))
        raise ConfigError(f"{name} must be True or False, got {settings.get(name)!r}") from None


def _seconds(raw: Any, setting: str, *, or_none: bool = False) -> float:
    """A finite number of seconds >= 0 (a string too, as -s gives it); ConfigError naming the
    setting otherwise."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(raw, bool) or not value >= 0 or math.isinf(value):
        none = "None or " if or_none else ""
        raise ConfigError(f"{setting} must be {none}a number of seconds >= 0, got {raw!r}")
    return value


def _read_keys(settings: BaseSettings, stages: Mapping[str, int | None]) -> dict[str, Any]:
    """REDISLOCK_STAGE_KEY, the key caps, the delays; ConfigError naming the setting and the bad
    value."""
    stage_key = key_function(settings.get("REDISLOCK_STAGE_KEY", defaults.REDISLOCK_STAGE_KEY))
    raw_limit = settings.get("REDISLOCK_KEY_LIMIT", defaults.REDISLOCK_KEY_LIMIT)
    if isinstance(raw_limit, str):  # given with -s
        raw_limit = None if _is_none(raw_limit) else _number(raw_limit)
        if isinstance(raw_limit, float) and raw_limit.is_integer():
            raw_limit = int(raw_limit)
    if raw_limit is not None:
        _checked(check_limit, raw_limit, "REDISLOCK_KEY_LIMIT", or_none=True)
        if raw_limit == 0:
            raise ConfigError(
                "REDISLOCK_KEY_LIMIT must be an integer >= 1 or None (no cap per key), got 0"
            )
        raw_limit = int(raw_limit)
    key_limits = check_stage_limits(
        _loaded(settings, "REDISLOCK_KEY_LIMITS"), "REDISLOCK_KEY_LIMITS"
    )
    for key, limit in key_limits.items():
        if limit == 0:
            raise ConfigError(
                f"REDISLOCK_KEY_LIMITS[{key!r}] must be an integer >= 1 or None (no cap), got 0"
            )
    delay = _seconds(settings.get("REDISLOCK_DELAY", defaults.REDISLOCK_DELAY), "REDISLOCK_DELAY")
    delays = _loaded(settings, "REDISLOCK_DELAYS")
    if not isinstance(delays, Mapping):
        raise ConfigError(
            f"REDISLOCK_DELAYS must be a dict of stage or key -> seconds, got {delays!r}"
        )
    checked_delays: dict[str, float] = {}
    for name, value in delays.items():
        if not isinstance(name, str) or not name or "{" in name or "}" in name:
            raise ConfigError(
                f"REDISLOCK_DELAYS: names must be non-empty strings without braces, got {name!r}"
            )
        checked_delays[name] = _seconds(value, f"REDISLOCK_DELAYS[{name!r}]")
    if stage_key is None:
        for setting, given in (
            ("REDISLOCK_KEY_LIMIT", raw_limit is not None),
            ("REDISLOCK_KEY_LIMITS", bool(key_limits)),
            ("REDISLOCK_DELAY", delay > 0),
        ):
            if given:
                raise ConfigError(
                    f"{setting} is set but REDISLOCK_STAGE_KEY is not: set it to 'domain', "
                    "'download_slot' or a function, or give stage delays in REDISLOCK_DELAYS"
                )
        strays = sorted(set(checked_delays) - set(stages))
        if strays:
            raise ConfigError(
                f"REDISLOCK_DELAYS names {strays}, which are not stages of REDISLOCK_STAGES, and "
                "REDISLOCK_STAGE_KEY is not set (no keys)"
            )
    randomize = _bool(settings, "REDISLOCK_RANDOMIZE_DELAY")
    return {
        "stage_key": stage_key,
        "key_limit": raw_limit,
        "key_limits": key_limits,
        "delay": delay,
        "delays": checked_delays,
        "randomize_delay": randomize,
    }


def _positive_int(settings: BaseSettings, name: str) -> int:
    raw = settings.get(name, getattr(defaults, name))
    try:
        value = int(raw)
    except (TypeError, ValueError, OverflowError):
        value = 0
    if isinstance(raw, bool) or (isinstance(raw, float) and raw != value) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {raw!r}")
    return value


@dataclass(frozen=True)
class WorkerSettings:
    """scrapy-redis settings the worker scheduler honours, with scrapy-redis's defaults."""

    idle_close: float | None = None
    persist: bool = False
    flush_on_start: bool = False
    start_urls_as: str = "list"  # "list", "set" or "zset", as RedisSpider reads its start URLs
    # a module with loads and dumps (SCHEDULER_SERIALIZER); None: the safe JSON format
    serializer: Any = None


def read_worker_settings(settings: BaseSettings, checked: RedisLockSettings) -> WorkerSettings:
    """REDISLOCK_IDLE_CLOSE (else scrapy-redis's MAX_IDLE_TIME_BEFORE_CLOSE, 0 = never) and the
    scrapy-redis settings that decide what a worker does with the shared queues and the start
    URLs."""
    idle_close = checked.idle_close
    if _is_none(settings.get("REDISLOCK_IDLE_CLOSE")):
        raw = settings.get("MAX_IDLE_TIME_BEFORE_CLOSE", 0)
        try:
            seconds = float(raw or 0)
        except (TypeError, ValueError):
            raise ConfigError(
                f"MAX_IDLE_TIME_BEFORE_CLOSE must be a number of seconds, got {raw!r}"
            ) from None
        idle_close = seconds if seconds > 0 else None
    as_set = _bool(settings, "REDIS_START_URLS_AS_SET", False)
    as_zset = _bool(settings, "REDIS_START_URLS_AS_ZSET", False)
    return WorkerSettings(
        idle_close=idle_close,
        persist=_bool(settings, "SCHEDULER_PERSIST", False),
        flush_on_start=_bool(settings, "SCHEDULER_FLUSH_ON_START", False),
        start_urls_as="set" if as_set else "zset" if as_zset else "list",
        serializer=serializer_of(settings.get("SCHEDULER_SERIALIZER")),
    )
