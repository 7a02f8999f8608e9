"""Read and check every REDISLOCK_* setting, in one place: one loop over
:data:`~scrapy_redislock.crawl.defaults.TABLE` (one parser per kind of value, :data:`PARSERS`), then
a few rules across settings (the connection and its scrapy-redis fallbacks, stage names, the
quorum, keys).

Settings read: REDISLOCK_ENABLED, REDISLOCK_URL, REDISLOCK_PARAMS, REDISLOCK_STAGES,
REDISLOCK_WORKER_STAGES, REDISLOCK_TTL, REDISLOCK_DURABLE, REDISLOCK_ALLOW_EVICTION,
REDISLOCK_KEY_PREFIX, REDISLOCK_GROUP, REDISLOCK_DEFAULT_STAGE, REDISLOCK_CALLBACK_STAGES,
REDISLOCK_WAIT_TIMEOUT, REDISLOCK_STAGE_PREFERENCE, REDISLOCK_ALLOWED_SCHEMES,
REDISLOCK_SCHEDULER_INNER, REDISLOCK_WAITERS_PER_STAGE, REDISLOCK_LOCAL_REUSE, REDISLOCK_IDLE_CLOSE,
REDISLOCK_CONNECT_TIMEOUT, REDISLOCK_STAGE_KEY, REDISLOCK_KEY_LIMIT, REDISLOCK_KEY_LIMITS,
REDISLOCK_DELAY, REDISLOCK_DELAYS, REDISLOCK_RANDOMIZE_DELAY, REDISLOCK_SCOPES, REDISLOCK_SCOPES_OF,
REDISLOCK_CRAWL_DELAY, REDISLOCK_QUORUM, REDISLOCK_ADAPTIVE, REDISLOCK_ADAPTIVE_MIN,
REDISLOCK_ADAPTIVE_WINDOW, REDISLOCK_RETRY_AFTER, REDISLOCK_RETRY_AFTER_DEFAULT; and scrapy-redis's
REDIS_URL, REDIS_HOST, REDIS_PORT, REDIS_DB, REDIS_PARAMS as fallbacks for the connection (URLs are
parsed by :mod:`scrapy_redislock.crawl.connection`). Defaults live in
:mod:`scrapy_redislock.crawl.defaults`. For the worker scheduler (:func:`read_worker_settings`) also
scrapy-redis's SCHEDULER_PERSIST, SCHEDULER_FLUSH_ON_START, MAX_IDLE_TIME_BEFORE_CLOSE (fallback of
REDISLOCK_IDLE_CLOSE), REDIS_START_URLS_AS_SET, REDIS_START_URLS_AS_ZSET, SCHEDULER_SERIALIZER (the
request format of the queues: :mod:`scrapy_redislock.crawl.requestformat` when unset).

Bad values raise :class:`~scrapy_redislock.errors.ConfigError` naming the setting and the value, so
a crawl with a broken configuration stops at start-up instead of running unthrottled (Scrapy would
swallow NotConfigured from a middleware and go on without it). So does a setting whose name starts
with REDISLOCK (or REDIS_LOCK) but is not one of ours: a misspelled REDISLOCK_STAGE would otherwise
leave every stage uncapped; the error names the closest known setting.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from scrapy.settings import BaseSettings

from scrapy_redislock._redis import check_limit, check_name, check_ttl
from scrapy_redislock.crawl import defaults
from scrapy_redislock.crawl.connection import mask_url
from scrapy_redislock.crawl.connection import parse_url as connection_url
from scrapy_redislock.crawl.inner import check_inner_scheduler
from scrapy_redislock.crawl.keys import KeyFunction, domain
from scrapy_redislock.crawl.keys import key_function as parse_key_function  # noqa: F401
from scrapy_redislock.crawl.requestformat import serializer_of
from scrapy_redislock.crawl.scopes import (
    MOST_SECONDS,
    ScopeFunction,
    ScopePolicy,
    ScopeTable,
    parse_policy,
)
from scrapy_redislock.crawl.scopes import parse_scopes as scope_table
from scrapy_redislock.crawl.scopes import scope_function as parse_scope_function  # noqa: F401
from scrapy_redislock.crawl.stages import unknown_stage
from scrapy_redislock.errors import ConfigError, InvalidArgument
from scrapy_redislock.lock.quorum import safe_quorum

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
# pieces. RESP2: redis-py 8 opens each connection with HELLO 3 and a maintenance-notifications
# handshake (two round trips before the first command; we use nothing of RESP3).
DEFAULT_CLIENT_PARAMS = {"socket_connect_timeout": 10, "health_check_interval": 30, "protocol": 2}


@dataclass(frozen=True, kw_only=True)
class ConnectionSettings:
    """Where the locks live: one Redis (a server, Sentinel or Cluster URL) or a quorum of
    independent masters."""

    url: str
    url_setting: str  # where the URL came from, for messages (or "the default URL")
    params: Mapping[str, Any]
    masters: tuple[str, ...]  # REDISLOCK_URL as a list: the quorum lock's masters (else empty)
    quorum: int | None  # REDISLOCK_QUORUM (None: each stage's safe quorum)
    connect_timeout: float

    @property
    def safe_url(self) -> str:
        if self.masters:
            return "[" + ", ".join(mask_url(url) for url in self.masters) + "]"
        return mask_url(self.url)


@dataclass(frozen=True, kw_only=True)
class KeySettings:
    """Caps and delays per key (REDISLOCK_STAGE_KEY and what it enables) and delays per stage."""

    stage_key: KeyFunction | None
    key_limit: int | None
    key_limits: Mapping[str, int | None]
    delay: float
    delays: Mapping[str, float]  # stages' and keys' names
    randomize_delay: bool
    scopes: ScopeTable
    scopes_of: ScopeFunction | None
    crawl_delay: bool

    @property
    def capped(self) -> bool:
        """Whether any key or scope has a cap."""
        return (
            self.stage_key is not None
            and (self.key_limit is not None or any(v is not None for v in self.key_limits.values()))
        ) or any(policy.limit is not None for policy in self.scopes.policies)

    @property
    def delayed(self) -> bool:
        """Whether any key or scope may keep a delay between its starts (its own, REDISLOCK_DELAY,
        a robots.txt Crawl-delay)."""
        return (
            self.stage_key is not None and (self.delay > 0 or bool(self.delays) or self.crawl_delay)
        ) or any(policy.delay for policy in self.scopes.policies)

    @property
    def rated(self) -> bool:
        """Whether any key or scope has a rate window (its REDISLOCK_SCOPES entry)."""
        return any(policy.rate is not None for policy in self.scopes.policies)


@dataclass(frozen=True, kw_only=True)
class AdaptiveSettings:
    """Limits that follow the site (REDISLOCK_ADAPTIVE*) and pauses on Retry-After
    (REDISLOCK_RETRY_AFTER*)."""

    adaptive: frozenset[str]  # the capped stages whose limit adapts, and "keys" for every key's
    adaptive_min: int
    adaptive_window: float
    retry_after: bool
    retry_after_default: float
    scoped: bool  # an entry of REDISLOCK_SCOPES (or of a stage) adapts or pauses on Retry-After
    paused_stages: frozenset[str]  # stages whose own policy says retry_after

    @property
    def stages(self) -> frozenset[str]:
        return self.adaptive - {"keys"}

    @property
    def keys(self) -> bool:
        return "keys" in self.adaptive

    def adapts(self, stage: str) -> bool:
        """Whether this stage's limit adapts."""
        return stage in self.stages

    def pauses(self, stage: str) -> bool:
        """Whether a Retry-After pauses this stage: REDISLOCK_RETRY_AFTER, or its own policy."""
        return self.retry_after or stage in self.paused_stages

    @property
    def needed(self) -> bool:
        """Whether anything adapts or pauses (a process then has an Adaptation)."""
        return self.watched or self.retry_after

    @property
    def watched(self) -> bool:
        """Whether answers may move a limit (the middleware then notes what each request held)."""
        return bool(self.adaptive) or self.scoped


@dataclass(frozen=True, kw_only=True)
class RedisLockSettings:
    """The checked REDISLOCK_* settings of one crawler (defaults: :mod:`.defaults`' table), with
    the connection's and the keys' settings as groups of their own."""

    enabled: bool
    redis: ConnectionSettings
    keys: KeySettings
    adaptive: AdaptiveSettings
    stages: Mapping[str, int | None]
    # a stage's rate window (its REDISLOCK_STAGES policy)
    stage_rates: Mapping[str, tuple[int, float]]
    worker_stages: Mapping[str, int | None]
    ttl: float
    durable: bool
    allow_eviction: bool
    key_prefix: str
    group: str  # a template: group_of() gives a spider's group
    default_stage: str | None
    callback_stages: Mapping[str, str]
    wait_timeout: float | None
    stage_preference: tuple[str, ...]
    allowed_schemes: tuple[str, ...]
    scheduler_inner: str | type  # a class, or its import path (crawl/inner.py)
    waiters_per_stage: int
    local_reuse: float
    idle_close: float | None

    @property
    def reuse_bound(self) -> float:
        """Seconds since Redis's grant within which a finished request's slot may pass straight to
        another request of this process: REDISLOCK_LOCAL_REUSE, at most half REDISLOCK_TTL."""
        return min(self.local_reuse, self.ttl / 2)

    def policy_of(self, name: str, *, stage: bool = False) -> ScopePolicy:
        """The policy of one name a request is throttled under, from whichever form set it.

        A stage's (``stage=True``): its cap (REDISLOCK_STAGES), delay (REDISLOCK_DELAYS, else 0),
        rate window, whether its limit adapts (REDISLOCK_ADAPTIVE) and whether a Retry-After
        pauses it (REDISLOCK_RETRY_AFTER or its own policy; a capped stage only). A key's or
        scope's: its REDISLOCK_SCOPES entry, else the short forms (REDISLOCK_KEY_LIMIT(S),
        REDISLOCK_DELAY(S), REDISLOCK_ADAPTIVE's "keys"; no rate, no pause of its own: with
        REDISLOCK_RETRY_AFTER the request's key pauses whatever its policy says)."""
        keys, adaptive = self.keys, self.adaptive
        if stage:
            limit = self.stages.get(name)
            return ScopePolicy(
                limit=limit,
                delay=keys.delays.get(name, 0.0) if name in self.stages else 0.0,
                rate=self.stage_rates.get(name),
                adaptive=adaptive.adapts(name),
                retry_after=limit is not None and adaptive.pauses(name),
            )
        entry = keys.scopes.match(name)
        if entry is not None:
            return entry
        # a key named like a stage does not take the stage's REDISLOCK_DELAYS entry
        own_delay = name in keys.delays and name not in self.stages
        if name not in keys.key_limits and not own_delay:
            return self._short_forms  # most keys of a broad crawl: no object made per call
        return dataclasses.replace(
            self._short_forms,
            limit=keys.key_limits.get(name, keys.key_limit),
            delay=keys.delays[name] if own_delay else keys.delay,
        )

    @functools.cached_property
    def _short_forms(self) -> ScopePolicy:
        """The policy of a key no setting names: REDISLOCK_KEY_LIMIT, REDISLOCK_DELAY and
        REDISLOCK_ADAPTIVE's "keys"."""
        keys = self.keys
        return ScopePolicy(limit=keys.key_limit, delay=keys.delay, adaptive=self.adaptive.keys)

    @property
    def delayed(self) -> bool:
        """Whether any stage, key or scope may keep a delay between its starts."""
        return self.keys.delayed or any(self.policy_of(s, stage=True).delay for s in self.stages)

    @property
    def rated(self) -> bool:
        """Whether any stage, key or scope has a rate window."""
        return self.keys.rated or bool(self.stage_rates)

    @property
    def paced(self) -> bool:
        """Whether any stage, key or scope may hold its starts apart: a delay or a rate window
        (StageScheduler then keeps the requests of a name with a start under way queued)."""
        return self.delayed or self.rated

    @property
    def keyed(self) -> bool:
        """Whether anything per key or per-stage delay is configured (the middleware then has work
        per request)."""
        return (
            self.keys.stage_key is not None
            or bool(self.keys.scopes)
            or self.keys.scopes_of is not None
            or self.adaptive.retry_after
            or self.adaptive.scoped
            or any(self.policy_of(s, stage=True).delay for s in self.stages)
            or bool(self.stage_rates)
        )


# -- parse_<kind>, one per kind of value: (raw value, setting name, whether None allowed) -> value


def _is_none(raw: Any) -> bool:
    """Whether an optional setting's value means None: None itself, or how ``-s NAME=...`` spells it
    ("None", "none", "null" or nothing), the same for every optional setting."""
    return raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none", "null"))


def _none_or(optional: bool) -> str:
    return "None or " if optional else ""


def _json(raw: Any, name: str, what: str) -> Any:
    """A dict or list given as JSON (``-s NAME='{...}'``) decoded; anything else as it is."""
    if isinstance(raw, BaseSettings):
        return raw.copy_to_dict()
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        raise ConfigError(f"{name} must be {what} (or JSON of one), got {raw!r}") from None


def _number(raw: Any) -> Any:
    """A number given as a string (``-s REDISLOCK_TTL=3``) as a float; anything else as it is, for
    the check."""
    if isinstance(raw, str):
        try:
            return float(raw)
        except ValueError:
            return raw
    return raw


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


def parse_bool(raw: Any, name: str, optional: bool = False) -> bool:
    """True or False, as Scrapy's ``getbool`` reads them (1/0, "True"/"true", "False"/"false")."""
    try:
        return BaseSettings({name: raw}).getbool(name)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(float("inf"))
        raise ConfigError(f"{name} must be True or False, got {raw!r}") from None


def parse_seconds(raw: Any, name: str, optional: bool = False) -> float:
    """A finite number of seconds >= 0 (a string too, as -s gives it)."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(raw, bool) or not value >= 0 or math.isinf(value):
        raise ConfigError(
            f"{name} must be {_none_or(optional)}a number of seconds >= 0, got {raw!r}"
        )
    return value


def parse_positive_seconds(raw: Any, name: str, optional: bool = False) -> float:
    """A number of seconds > 0 (infinity allowed: wait as long as it takes)."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(raw, bool) or not value > 0:
        raise ConfigError(
            f"{name} must be {_none_or(optional)}a number of seconds > 0, got {raw!r}"
        )
    return value


def _integer(raw: Any) -> int | None:
    """An integer given as one, as an integral float, or as a string of either; else None."""
    value = _number(raw)
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) else None


def parse_positive_int(raw: Any, name: str, optional: bool = False) -> int:
    """An integer >= 1."""
    value = _integer(raw)
    if value is None or value < 1:
        raise ConfigError(f"{name} must be {_none_or(optional)}an integer >= 1, got {raw!r}")
    return value


def parse_positive_limit(raw: Any, name: str, optional: bool = False) -> int:
    """A limit >= 1: an integer from 1 to MAX_LIMIT."""
    value = parse_positive_int(raw, name, optional)
    return int(_checked(check_limit, value, name))


def parse_quorum(raw: Any, name: str, optional: bool = False) -> Any:
    """An integer as an int; anything else as it is: the range depends on the masters (a rule
    across settings checks it)."""
    value = _integer(raw)
    return raw if value is None else value


def parse_key_limit(raw: Any, name: str, optional: bool = False) -> int:
    """A cap per key: an integer >= 1 (0 would pause every key for good)."""
    value = _integer(raw)
    if value is None:
        _checked(check_limit, _number(raw), name, or_none=True)
        raise ConfigError(f"{name} must be an integer >= 1 or None (no cap per key), got {raw!r}")
    if value == 0:
        raise ConfigError(f"{name} must be an integer >= 1 or None (no cap per key), got 0")
    return int(_checked(check_limit, value, name, or_none=True))


def parse_ttl(raw: Any, name: str, optional: bool = False) -> float:
    return float(_checked(check_ttl, _number(raw), name))


def parse_name(raw: Any, name: str, optional: bool = False) -> str:
    return str(_checked(check_name, raw, name))


def parse_group(raw: Any, name: str, optional: bool = False) -> str:
    """A cap group: a name without braces, in which ``%(spider)s`` stands for the spider's name;
    '' for none (the key names of 0.x)."""
    if not isinstance(raw, str):
        raise ConfigError(f"{name} must be a string (a group name, or '' for none), got {raw!r}")
    try:
        expanded = raw % {"spider": "spider"}
    except (KeyError, ValueError, TypeError):
        raise ConfigError(
            f"{name} may contain %(spider)s and no other % placeholder (%% for a '%'), got {raw!r}"
        ) from None
    if "{" in expanded or "}" in expanded:
        raise ConfigError(f"{name} must be a name without braces, got {raw!r}")
    return raw


def group_of(settings: RedisLockSettings, spider: str | None) -> str:
    """The cap group of a crawl of ``spider`` (REDISLOCK_GROUP with %(spider)s replaced); '' means
    no group, as for a spider with no name (``scrapy crawl`` always has one; Scrapy's own component
    tests make spiders without). ConfigError naming the setting when the spider's name cannot be
    part of a key."""
    group = settings.group
    if "%(spider)" not in group:
        return group % {}
    if not spider:
        return ""
    if "{" in spider or "}" in spider:
        raise ConfigError(
            f"REDISLOCK_GROUP is {group!r} but the spider's name {spider!r} has braces, which a Redis key's group cannot: set REDISLOCK_GROUP to a name"  # noqa: E501
        )
    return group % {"spider": spider}


def parse_stage_name(raw: Any, name: str, optional: bool = False) -> str:
    """A stage name (whether it is configured is a rule across settings)."""
    if not isinstance(raw, str):
        raise ConfigError(
            f"{name} must be a stage name{' or None' if optional else ''}, got {raw!r}"
        )
    return raw


def parse_stage_limits(raw: Any, name: str, optional: bool = False) -> dict[str, int | None]:
    """{stage: limit or None}; ConfigError naming the setting, the stage and the bad value."""
    value = _json(raw, name, "a dict")
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be a dict of stage -> limit, got {value!r}")
    checked: dict[str, int | None] = {}
    for stage, limit in value.items():
        _checked(check_name, stage, f"{name}: a stage name")
        if limit is not None:
            _checked(check_limit, limit, f"{name}[{stage!r}]", or_none=True)
        checked[stage] = limit
    return checked


def parse_stage_policies(raw: Any, name: str, optional: bool = False) -> dict[str, ScopePolicy]:
    """REDISLOCK_STAGES: {stage: limit or None, or the stage's policy as a dict like an entry of
    REDISLOCK_SCOPES (its limit may be 0, as a plain one may)}; read_settings unfolds it."""
    value = _json(raw, name, "a dict")
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be a dict of stage -> limit or policy dict, got {value!r}")
    policies: dict[str, ScopePolicy] = {}
    for stage, entry in value.items():
        _checked(check_name, stage, f"{name}: a stage name")
        if isinstance(entry, Mapping):
            policies[stage] = parse_policy(entry, f"{name}[{stage!r}]", lowest=0)
            continue
        if entry is not None:
            _checked(check_limit, entry, f"{name}[{stage!r}]", or_none=True)
        policies[stage] = ScopePolicy(limit=entry)
    return policies


def parse_key_limits(raw: Any, name: str, optional: bool = False) -> dict[str, int | None]:
    """{key: limit >= 1 or None}."""
    checked = parse_stage_limits(raw, name)
    for key, limit in checked.items():
        if limit == 0:
            raise ConfigError(f"{name}[{key!r}] must be an integer >= 1 or None (no cap), got 0")
    return checked


def parse_callback_stages(raw: Any, name: str, optional: bool = False) -> dict[str, str]:
    value = _json(raw, name, "a dict")
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ConfigError(f"{name} must be a dict of callback name -> stage, got {value!r}")
    return dict(value)


def parse_stage_names(raw: Any, name: str, optional: bool = False) -> tuple[str, ...]:
    value = _json(raw, name, "a list")
    if not isinstance(value, list | tuple) or not all(isinstance(s, str) for s in value):
        raise ConfigError(f"{name} must be a list of stage names, got {value!r}")
    return tuple(value)


def parse_schemes(raw: Any, name: str, optional: bool = False) -> tuple[str, ...]:
    """URL schemes, lower case (``["http", "https"]``, or ``"http,https"`` on the command line)."""
    value = _json(raw, name, "a list") if not (isinstance(raw, str) and "[" not in raw) else raw
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if (
        not isinstance(value, list | tuple)
        or not value
        or not all(
            isinstance(s, str) and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", s) for s in value
        )
    ):
        raise ConfigError(f"{name} must be a non-empty list of URL schemes, got {value!r}")
    return tuple(s.lower() for s in value)


def parse_delays(raw: Any, name: str, optional: bool = False) -> dict[str, float]:
    value = _json(raw, name, "a dict")
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be a dict of stage or key -> seconds, got {value!r}")
    checked: dict[str, float] = {}
    for key, seconds in value.items():
        if not isinstance(key, str) or not key or "{" in key or "}" in key:
            raise ConfigError(
                f"{name}: names must be non-empty strings without braces, got {key!r}"
            )
        checked[key] = parse_delay(seconds, f"{name}[{key!r}]")
    return checked


def parse_delay(raw: Any, name: str, optional: bool = False) -> float:
    """Seconds between two starts: from 0 to MOST_SECONDS (a day; beyond about 1e14 s Redis
    refuses the delay's script)."""
    value = parse_seconds(raw, name, optional)
    if value > MOST_SECONDS:
        raise ConfigError(
            f"{name} must be a number of seconds from 0 to {MOST_SECONDS}, got {raw!r}"
        )
    return value


def parse_adaptive(raw: Any, name: str, optional: bool = False) -> tuple[str, ...] | bool:
    """True (every capped stage and the keys), False, or names: stages, and ``"keys"`` (a list, or
    a comma-separated string as ``-s`` gives it); each name is checked against the stages
    later."""
    if isinstance(raw, bool) or raw in ("True", "true", "False", "false", "1", "0"):
        return parse_bool(raw, name)
    if isinstance(raw, str) and raw.lstrip().startswith("["):
        raw = _json(raw, name, "a list")
    names = [part.strip() for part in raw.split(",")] if isinstance(raw, str) else raw
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(
            f"{name} must be True, False, or a list of capped stages and/or 'keys', got {raw!r}"
        )
    return tuple(dict.fromkeys(names))


def parse_client_params(raw: Any, name: str, optional: bool = False) -> dict[str, Any]:
    value = _json(raw, name, "a dict")
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be a dict of redis client arguments, got {value!r}")
    return dict(value)


def parse_url(raw: Any, name: str, optional: bool = False) -> str | tuple[str, ...]:
    """One URL (checked by :func:`~scrapy_redislock.crawl.connection.parse_url`), or a list of
    independent masters (also as JSON: ``-s REDISLOCK_URL='["redis://a", "redis://b"]'``)."""
    if isinstance(raw, str) and raw.lstrip().startswith("["):
        raw = _json(raw, name, "a redis URL or a list of them")
    if isinstance(raw, list | tuple):
        return check_masters(raw, name)
    return connection_url(raw, name).url


def parse_scheduler(raw: Any, name: str, optional: bool = False) -> str | type:
    return check_inner_scheduler(raw or defaults.SETTINGS[name])


def parse_scopes(raw: Any, name: str, optional: bool = False) -> ScopeTable:
    return scope_table(_json(raw, name, "a dict"), name)


#: kind -> its parser: ``parse_<kind>`` of this module (parse_key_function and parse_scope_function
#: imported as such), for each kind the table names.
PARSERS: dict[str, Callable[[Any, str, bool], Any]] = {
    setting.kind: globals()[f"parse_{setting.kind}"] for setting in defaults.TABLE
}


def check_masters(raw: Any, setting: str) -> tuple[str, ...]:
    """The independent masters of a quorum lock: a list of server or Sentinel URLs, each once;
    ConfigError naming the setting otherwise (a Cluster is one deployment, not an independent
    master)."""
    if not raw:
        raise ConfigError(f"{setting} must be a redis URL or a non-empty list of them, got {raw!r}")
    masters = []
    for url in raw:
        checked = connection_url(url, setting)
        if checked.kind == "cluster":
            raise ConfigError(
                f"{setting} lists a Redis Cluster ({mask_url(checked.url)!r}): a quorum lock needs independent masters (plain redis:// servers or Sentinel services), not a cluster"  # noqa: E501
            )
        if checked.url in masters:
            raise ConfigError(
                f"{setting} lists {mask_url(checked.url)!r} twice: each master must be independent"
            )
        masters.append(checked.url)
    return tuple(masters)


def check_names(settings: BaseSettings) -> None:
    """ConfigError for a setting that looks like ours (REDISLOCK..., REDIS_LOCK...) but is not,
    naming the closest."""
    for name in settings:
        if not isinstance(name, str):
            continue
        folded = name.upper().replace("REDIS_LOCK", "REDISLOCK", 1)
        if not folded.startswith("REDISLOCK") or name in defaults.SETTINGS:
            continue
        closest = difflib.get_close_matches(folded, defaults.SETTINGS, n=1, cutoff=0.0)
        raise ConfigError(
            f"{name} is not a scrapy_redislock setting (did you mean {closest[0]}?); known: {', '.join(sorted(defaults.SETTINGS))}"  # noqa: E501
        )


# -- the loop and the rules across settings --------------------------------------------------------


def read_table(settings: BaseSettings) -> dict[str, Any]:
    """Every setting of :data:`.defaults.TABLE` through its kind's parser, by field name."""
    values: dict[str, Any] = {}
    for setting in defaults.TABLE:
        raw = settings.get(setting.name, setting.default)
        optional = setting.default is None
        if optional and _is_none(raw):
            values[setting.field] = None
        else:
            values[setting.field] = PARSERS[setting.kind](raw, setting.name, optional)
    return values


def read_settings(settings: BaseSettings) -> RedisLockSettings:
    """All REDISLOCK_* settings, checked; ConfigError with a message naming the bad one."""
    check_names(settings)
    values = read_table(settings)
    values.update(_connection(settings, values.pop("url"), values.pop("params")))
    values["paused_stages"] = _unfold_stages(values)
    _check_stage_names(values)
    _check_quorum(values)
    _check_keys(values)
    _check_adaptive(values)
    return RedisLockSettings(
        redis=_group(ConnectionSettings, values),
        keys=_group(KeySettings, values),
        adaptive=_group(AdaptiveSettings, values),
        **values,
    )


Group = TypeVar("Group", ConnectionSettings, KeySettings, AdaptiveSettings)


def _group(cls: type[Group], values: dict[str, Any]) -> Group:
    """A group of settings (its fields taken out of ``values``)."""
    return cls(**{field.name: values.pop(field.name) for field in fields(cls)})


def _unfold_stages(values: dict[str, Any]) -> frozenset[str]:
    """REDISLOCK_STAGES' policies into the short forms: ``stages`` {stage: limit},
    ``stage_rates``, a delay into REDISLOCK_DELAYS, ``adaptive`` into REDISLOCK_ADAPTIVE's names;
    returns the stages whose policy says ``retry_after``. A delay given twice is an error."""
    policies: dict[str, ScopePolicy] = values["stages"]
    values["stages"] = {stage: policy.limit for stage, policy in policies.items()}
    values["stage_rates"] = {
        stage: policy.rate for stage, policy in policies.items() if policy.rate is not None
    }
    delays = dict(values["delays"])
    for stage, policy in policies.items():
        if not policy.delay:
            continue
        if stage in delays:
            raise ConfigError(
                f"REDISLOCK_STAGES[{stage!r}] gives a delay ({policy.delay}) and REDISLOCK_DELAYS[{stage!r}] gives one too ({delays[stage]}): give it in one place"  # noqa: E501
            )
        delays[stage] = policy.delay
    values["delays"] = delays
    for stage, policy in policies.items():
        if policy.retry_after and policy.limit is None:
            raise ConfigError(
                f"REDISLOCK_STAGES[{stage!r}] pauses on Retry-After but has no 'limit': a stage's pause is its lock's, give it a cap"  # noqa: E501
            )
    adapting = [stage for stage, policy in policies.items() if policy.adaptive]
    if adapting and values["adaptive"] is not True:
        named = () if values["adaptive"] is False else tuple(values["adaptive"])
        values["adaptive"] = (*named, *(stage for stage in adapting if stage not in named))
    return frozenset(stage for stage, policy in policies.items() if policy.retry_after)


def _check_adaptive(values: dict[str, Any]) -> None:
    """REDISLOCK_ADAPTIVE's names are capped stages or "keys" (with capped keys), and the minimum
    is no higher than any cap it applies to; a quorum of masters has no adaptive limit."""
    named = _adaptive_names(values)
    minimum = values["adaptive_min"]
    for what, ceiling in sorted(_adaptive_ceilings(values, named).items()):
        if ceiling < minimum:
            raise ConfigError(
                f"REDISLOCK_ADAPTIVE_MIN = {minimum} is above the cap of {what} ({ceiling}), the ceiling of its adaptive limit"  # noqa: E501
            )
    scoped = [
        (name, policy)
        for name, policy in values["scopes"].entries
        if policy.adaptive or policy.retry_after
    ]
    for name, policy in scoped:
        if policy.adaptive and policy.limit is not None and policy.limit < minimum:
            raise ConfigError(
                f"REDISLOCK_ADAPTIVE_MIN = {minimum} is above the limit of REDISLOCK_SCOPES[{name!r}] ({policy.limit}), the ceiling of its adaptive limit"  # noqa: E501
            )
    if (named or any(policy.adaptive for _, policy in scoped)) and values["masters"]:
        raise ConfigError(
            "REDISLOCK_ADAPTIVE is not available with a quorum of masters (REDISLOCK_URL a list): its limit would have to move on every master at once"  # noqa: E501
        )
    values["adaptive"] = frozenset(named)
    values["scoped"] = bool(scoped) or bool(values["paused_stages"])


def _adaptive_names(values: dict[str, Any]) -> tuple[str, ...]:
    """REDISLOCK_ADAPTIVE's names. True: every capped stage and the keys if any is capped; each
    name given must be capped."""
    named = values["adaptive"]
    capped = {stage for stage, limit in values["stages"].items() if limit is not None}
    key_capped = values["stage_key"] is not None and (
        values["key_limit"] is not None or any(v is not None for v in values["key_limits"].values())
    )
    if named is True:
        return (*sorted(capped), *(("keys",) if key_capped else ()))
    if named is False:
        return ()
    for name in named:
        if name == "keys" and not key_capped:
            raise ConfigError(
                "REDISLOCK_ADAPTIVE names 'keys' but no key is capped: set REDISLOCK_STAGE_KEY and REDISLOCK_KEY_LIMIT (the ceiling of every key's adaptive limit)"  # noqa: E501
            )
        if name != "keys" and name not in capped:
            raise ConfigError(
                f"REDISLOCK_ADAPTIVE names {name!r}, which is not a capped stage of REDISLOCK_STAGES (capped: {sorted(capped)}; 'keys' for the keys): its cap is the ceiling of its adaptive limit"  # noqa: E501
            )
    return tuple(named)


def _adaptive_ceilings(values: dict[str, Any], named: tuple[str, ...]) -> dict[str, int]:
    """The caps an adaptive limit may not exceed, by what the error message calls them."""
    ceilings = {f"stage {n!r}": values["stages"][n] for n in named if n != "keys"}
    if "keys" in named:
        ceilings.update({f"key {k!r}": v for k, v in values["key_limits"].items() if v})
        if values["key_limit"] is not None:
            ceilings["REDISLOCK_KEY_LIMIT"] = values["key_limit"]
    return {what: ceiling for what, ceiling in ceilings.items() if ceiling is not None}


def _connection(settings: BaseSettings, url: Any, params: Any) -> dict[str, Any]:
    """url, url_setting, params and masters (REDISLOCK_URL as a list, else empty): REDISLOCK_URL and
    REDISLOCK_PARAMS first, then scrapy-redis's REDIS_* settings."""
    masters: tuple[str, ...] = ()
    if url is None:
        url, source = _scrapy_redis_url(settings)
    else:
        source = "REDISLOCK_URL"
        # one master: the plain lock (a quorum of one is that, at a higher cost)
        if isinstance(url, tuple):
            masters, url = (url if len(url) > 1 else ()), url[0]
    if params is None:
        params = parse_client_params(settings.getdict("REDIS_PARAMS"), "REDIS_PARAMS")
    merged = {} if masters else dict(DEFAULT_CLIENT_PARAMS)  # a quorum's masters: see async_clients
    merged.update({k: v for k, v in params.items() if k in CLIENT_PARAMS})
    return {"url": url, "url_setting": source, "params": merged, "masters": masters}


def _scrapy_redis_url(settings: BaseSettings) -> tuple[str, str]:
    """The URL of scrapy-redis's settings (REDIS_URL, else REDIS_HOST / REDIS_PORT / REDIS_DB), or
    the default; and where it came from."""
    if settings.get("REDIS_URL"):
        url = parse_url(settings.get("REDIS_URL"), "REDIS_URL")
        if isinstance(url, tuple):
            raise ConfigError(
                f"REDIS_URL must be one redis URL (scrapy-redis connects to one Redis), got a list {list(url)!r}; a list of independent masters for the quorum lock goes in REDISLOCK_URL"  # noqa: E501
            )
        return url, "REDIS_URL"
    if settings.get("REDIS_HOST") or settings.get("REDIS_PORT"):
        source = "REDIS_HOST/REDIS_PORT"
        host = settings.get("REDIS_HOST") or "localhost"
        port = settings.get("REDIS_PORT") or 6379
        db = settings.get("REDIS_DB") or 0
        return connection_url(f"redis://{host}:{port}/{db}", source).url, source
    return "redis://localhost:6379/0", "the default URL"


def _check_stage_names(values: Mapping[str, Any]) -> None:
    """The default stage, the callbacks' stages and the preference name configured stages."""
    known = set(values["stages"]) | set(values["worker_stages"])
    both = "REDISLOCK_STAGES or REDISLOCK_WORKER_STAGES"
    default_stage = values["default_stage"]
    if default_stage is not None and default_stage not in known:
        raise unknown_stage("REDISLOCK_DEFAULT_STAGE", default_stage, known, both)
    for callback, stage in sorted(values["callback_stages"].items()):
        if stage not in known:
            raise unknown_stage(f"REDISLOCK_CALLBACK_STAGES[{callback!r}]", stage, known, both)
    stray = sorted(set(values["stage_preference"]) - known)
    if stray:
        raise ConfigError(
            f"REDISLOCK_STAGE_PREFERENCE names unknown stages {stray}; known: {sorted(known)}"
        )


def _check_quorum(values: Mapping[str, Any]) -> None:
    """REDISLOCK_QUORUM: None, or from every capped stage's safe quorum to the number of masters;
    caps per key and delays need one Redis."""
    quorum, masters = values["quorum"], values["masters"]
    if masters and (values["stage_key"] is not None or values["delays"]):
        given = "REDISLOCK_STAGE_KEY" if values["stage_key"] is not None else "REDISLOCK_DELAYS"
        raise ConfigError(
            f"REDISLOCK_URL lists {len(masters)} masters (a quorum lock) but {given} is set: caps per key and delays need one Redis (give REDISLOCK_URL one URL)"  # noqa: E501
        )
    if quorum is None:
        return
    if not masters:
        raise ConfigError(
            f"REDISLOCK_QUORUM is set ({quorum!r}) but REDISLOCK_URL names one Redis: give REDISLOCK_URL as a list of independent masters for a quorum lock, or unset REDISLOCK_QUORUM"  # noqa: E501
        )
    count = len(masters)
    if isinstance(quorum, bool) or not isinstance(quorum, int) or not 1 <= quorum <= count:
        raise ConfigError(
            f"REDISLOCK_QUORUM must be an integer from 1 to {count} (the masters), got {quorum!r}"
        )
    for stage, limit in values["stages"].items():
        if limit is not None and quorum < safe_quorum(count, limit):
            raise ConfigError(
                f"REDISLOCK_QUORUM = {quorum!r} is below the safe quorum {safe_quorum(count, limit)} of stage {stage!r} (limit {limit}, {count} masters): up to {count * limit // quorum} requests could hold it at once; use None (each stage's safe quorum) or a value from the safe quorum to the number of masters"  # noqa: E501
            )


def _check_keys(values: dict[str, Any]) -> None:
    """Caps per key and a delay per key need REDISLOCK_STAGE_KEY; without it REDISLOCK_DELAYS names
    stages only. REDISLOCK_CRAWL_DELAY without a key makes the domain the key (a site's
    Crawl-delay is the site's)."""
    if values["stage_key"] is not None:
        return
    if values["crawl_delay"]:
        values["stage_key"] = domain
        return
    for setting, given in (
        ("REDISLOCK_KEY_LIMIT", values["key_limit"] is not None),
        ("REDISLOCK_KEY_LIMITS", bool(values["key_limits"])),
        ("REDISLOCK_DELAY", values["delay"] > 0),
    ):
        if given:
            raise ConfigError(
                f"{setting} is set but REDISLOCK_STAGE_KEY is not: set it to 'domain', 'download_slot' or a function, or give stage delays in REDISLOCK_DELAYS"  # noqa: E501
            )
    strays = sorted(set(values["delays"]) - set(values["stages"]))
    if strays:
        raise ConfigError(
            f"REDISLOCK_DELAYS names {strays}, which are not stages of REDISLOCK_STAGES, and REDISLOCK_STAGE_KEY is not set (no keys)"  # noqa: E501
        )


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
    as_set = parse_bool(settings.get("REDIS_START_URLS_AS_SET", False), "REDIS_START_URLS_AS_SET")
    as_zset = parse_bool(
        settings.get("REDIS_START_URLS_AS_ZSET", False), "REDIS_START_URLS_AS_ZSET"
    )
    return WorkerSettings(
        idle_close=idle_close,
        persist=parse_bool(settings.get("SCHEDULER_PERSIST", False), "SCHEDULER_PERSIST"),
        flush_on_start=parse_bool(
            settings.get("SCHEDULER_FLUSH_ON_START", False), "SCHEDULER_FLUSH_ON_START"
        ),
        start_urls_as="set" if as_set else "zset" if as_zset else "list",
        serializer=serializer_of(settings.get("SCHEDULER_SERIALIZER")),
    )
