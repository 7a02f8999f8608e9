"""Throttling scopes: names a request is throttled under beside its stage, each with a policy.

A request's scopes are its key (REDISLOCK_STAGE_KEY: the domain, ...) and any others it names in
``meta["redislock_scopes"]`` or that REDISLOCK_SCOPES_OF gives it (a proxy, an API token, a
rendering service). A scope is a key like the domain: its lock is ``key:<scope>`` in Redis, made on
first use and gone once idle. Its policy (:class:`ScopePolicy`) comes from REDISLOCK_SCOPES, a table
of names or glob patterns; the request's key falls back to the short forms (REDISLOCK_KEY_LIMIT(S),
REDISLOCK_DELAY(S)); any other scope must match an entry (a name matching none fails its request,
naming it: a typo must not leave a proxy unthrottled).

Reads no settings itself: :func:`parse_scopes` and :func:`scope_function` check REDISLOCK_SCOPES and
REDISLOCK_SCOPES_OF once, at start-up (:mod:`scrapy_redislock.crawl.settings`).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scrapy.utils.httpobj import urlparse_cached

from scrapy_redislock._redis import MAX_LIMIT
from scrapy_redislock.crawl.keys import KEY_MAX, function_name, is_key_name, load_function
from scrapy_redislock.crawl.stages import DONT_META
from scrapy_redislock.errors import ConfigError, KeyFunctionError

if TYPE_CHECKING:
    from scrapy import Request

SCOPES_META = "redislock_scopes"  # a request's own scopes: a list of names
ScopeFunction = Callable[["Request", Any], Iterable[str] | None]
POLICY_FIELDS = ("limit", "delay", "rate", "adaptive", "retry_after")
MOST_SECONDS = 86400  # the longest delay or rate window (a site's robots.txt Crawl-delay too)
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\d*\.?\d*)\s*([smh]?)\s*$")


@dataclass(frozen=True)
class ScopePolicy:
    """What a name a request is throttled under allows (a scope, a key or a stage): ``limit``
    requests in flight (None: no cap), ``delay`` seconds between two starts, at most ``rate[0]``
    starts in any ``rate[1]`` seconds (None: no window); each held for the whole cluster on Redis's
    clock. ``adaptive``: the cap is the ceiling of a limit that follows the answers
    (REDISLOCK_ADAPTIVE_MIN, _WINDOW); ``retry_after``: a 429 or 503 with Retry-After pauses the
    name's starts in every process (REDISLOCK_RETRY_AFTER_DEFAULT for a 429 without one)."""

    limit: int | None = None
    delay: float = 0.0
    rate: tuple[int, float] | None = None
    adaptive: bool = False
    retry_after: bool = False


NO_POLICY = ScopePolicy()  # nothing asked: no cap, delay, window or pause


@dataclass(frozen=True)
class ScopeTable:
    """REDISLOCK_SCOPES, checked: exact names first, then the glob patterns in their given order."""

    exact: Mapping[str, ScopePolicy]
    patterns: tuple[tuple[str, re.Pattern[str], ScopePolicy], ...]

    def __bool__(self) -> bool:
        return bool(self.exact or self.patterns)

    def match(self, name: str) -> ScopePolicy | None:
        """The policy of ``name``: its own entry, else the first pattern matching it, else None."""
        policy = self.exact.get(name)
        if policy is not None:
            return policy
        for _, pattern, policy in self.patterns:
            if pattern.match(name):
                return policy
        return None

    @property
    def entries(self) -> list[tuple[str, ScopePolicy]]:
        """(name or pattern, policy) of every entry, as written."""
        return [*self.exact.items(), *((name, policy) for name, _, policy in self.patterns)]

    @property
    def policies(self) -> list[ScopePolicy]:
        return [policy for _, policy in self.entries]


def parse_rate(raw: Any, setting: str) -> tuple[int, float]:
    """A rate window: ``"10/s"``, ``"10/1.5s"``, ``"600/m"``, ``"100/60"`` (seconds) or ``[10,
    1.0]``; ConfigError naming the setting otherwise."""
    count: Any
    window: Any
    found = _RATE.match(raw) if isinstance(raw, str) else None
    if found is not None:
        count, seconds, unit = found.groups()
        window = (float(seconds) if seconds not in ("", ".") else 1.0) * _UNITS[unit]
        count = int(count)
    elif isinstance(raw, list | tuple) and len(raw) == 2:
        count, window = raw
    else:
        raise ConfigError(
            f"{setting} must be a rate 'N/T' (N starts per T seconds: '10/s', '100/60s', '600/m') or [N, T], got {raw!r}"  # noqa: E501
        )
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_LIMIT:
        raise ConfigError(
            f"{setting}: the number of starts per window must be an integer from 1 to {MAX_LIMIT}, got {count!r}"
        )
    if (
        isinstance(window, bool)
        or not isinstance(window, int | float)
        or not 0.001 <= window <= MOST_SECONDS
    ):
        raise ConfigError(
            f"{setting}: the window must be a number of seconds from 0.001 to {MOST_SECONDS}, got {window!r}"
        )
    return count, float(window)


def parse_policy(raw: Any, setting: str, lowest: int = 1) -> ScopePolicy:
    """One entry of REDISLOCK_SCOPES (or a stage's of REDISLOCK_STAGES, whose cap may be 0: paused):
    a dict of ``limit``, ``delay``, ``rate``, ``adaptive`` and ``retry_after``, each optional."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{setting} must be a dict of {', '.join(POLICY_FIELDS)}, got {raw!r}")
    unknown = sorted(set(raw) - set(POLICY_FIELDS))
    if unknown:
        raise ConfigError(
            f"{setting} has unknown field(s) {unknown}; a scope's policy has {', '.join(POLICY_FIELDS)}"
        )
    limit = raw.get("limit")
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, int) or not lowest <= limit <= MAX_LIMIT
    ):
        raise ConfigError(
            f"{setting}['limit'] must be an integer from {lowest} to {MAX_LIMIT} or None (no cap), got {limit!r}"
        )
    delay = raw.get("delay", 0.0)
    if (
        isinstance(delay, bool)
        or not isinstance(delay, int | float)
        or not 0 <= delay <= MOST_SECONDS
    ):
        raise ConfigError(
            f"{setting}['delay'] must be a number of seconds from 0 to {MOST_SECONDS}, got {delay!r}"
        )
    rate = raw.get("rate")
    flags = {}
    for flag in ("adaptive", "retry_after"):
        value = raw.get(flag, False)
        if not isinstance(value, bool):
            raise ConfigError(f"{setting}['{flag}'] must be True or False, got {value!r}")
        flags[flag] = value
    if flags["adaptive"] and limit is None:
        raise ConfigError(
            f"{setting} is adaptive but has no 'limit': the cap is the ceiling of its adaptive limit"
        )
    return ScopePolicy(
        limit=limit,
        delay=float(delay),
        rate=None if rate is None else parse_rate(rate, f"{setting}['rate']"),
        **flags,
    )


def parse_scopes(raw: Any, setting: str) -> ScopeTable:
    """REDISLOCK_SCOPES: {scope name or glob pattern: policy}; a name with ``*``, ``?`` or ``[`` is a
    pattern."""
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{setting} must be a dict of scope name or glob pattern -> policy dict, got {raw!r}"
        )
    exact: dict[str, ScopePolicy] = {}
    patterns: list[tuple[str, re.Pattern[str], ScopePolicy]] = []
    for name, entry in raw.items():
        if not is_key_name(name):
            raise ConfigError(
                f"{setting}: a scope name must be a non-empty string of at most {KEY_MAX} characters without braces, got {name!r}"  # noqa: E501
            )
        policy = parse_policy(entry, f"{setting}[{name!r}]")
        if any(char in name for char in "*?["):
            patterns.append((name, re.compile(fnmatch.translate(name)), policy))
        else:
            exact[name] = policy
    return ScopeTable(exact, tuple(patterns))


def proxy(request: Request, spider: Any = None) -> list[str]:
    """``proxy:<host>:<port>`` of ``meta["proxy"]`` (Scrapy's HttpProxyMiddleware reads it), none
    without one."""
    url = request.meta.get("proxy")
    if not url:
        return []
    host = urlparse_cached(type(request)(str(url))).netloc.rpartition("@")[2]
    return [f"proxy:{host}"] if host else []


KINDS: dict[str, ScopeFunction] = {"proxy": proxy}


def scope_function(
    value: Any, setting: str = "REDISLOCK_SCOPES_OF", optional: bool = False
) -> ScopeFunction | None:
    """The function behind a REDISLOCK_SCOPES_OF value: None, "proxy", or a function (or its dotted
    path) ``(request, spider) -> scope names``; ConfigError naming the setting otherwise. Its
    parser in :mod:`~scrapy_redislock.crawl.settings`."""
    return load_function(value, setting, KINDS, "scope names", "scope names")


def request_scopes(
    request: Request, spider: Any, function: ScopeFunction | None
) -> tuple[str, ...]:
    """The request's scopes beside its stage and key: ``meta["redislock_scopes"]`` and what
    REDISLOCK_SCOPES_OF gives, each once, sorted (the order slots are taken in); KeyFunctionError
    for this request only when one is not a valid name."""
    if request.meta.get(DONT_META):
        return ()
    names: list[Any] = []
    own = request.meta.get(SCOPES_META)
    if own:
        if isinstance(own, str) or not isinstance(own, Iterable):
            raise KeyFunctionError(
                f"meta['{SCOPES_META}'] must be a list of scope names, got {own!r} for {request.url}"
            )
        names.extend(own)
    if function is not None:
        try:
            given = function(request, spider)
        except Exception as exc:
            raise KeyFunctionError(
                f"REDISLOCK_SCOPES_OF function {function_name(function)} raised {type(exc).__name__}: {exc} for {request.url}"  # noqa: E501
            ) from exc
        if given:
            if isinstance(given, str):
                raise KeyFunctionError(
                    f"REDISLOCK_SCOPES_OF function {function_name(function)} returned the string {given!r} for {request.url}: it must return a list of scope names"  # noqa: E501
                )
            names.extend(given)
    for name in names:
        if not is_key_name(name):
            raise KeyFunctionError(
                f"scope {name!r} of {request.url} is not a scope name: a non-empty string of at most {KEY_MAX} characters without braces"  # noqa: E501
            )
    return tuple(sorted(set(names)))
