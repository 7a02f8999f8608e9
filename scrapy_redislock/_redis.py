"""What every layer needs of Redis and nothing else: decoding replies, checking arguments, loading
Lua, backing off.

Imports neither Scrapy nor Twisted and reads no settings. Lua scripts live as package data, one file
per script, in a ``scripts`` folder beside the code that runs them (:func:`load_scripts`), so each
part loads only its own.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis
import redis.asyncio
import redis.exceptions

from scrapy_redislock.errors import InvalidArgument

# A client of one Redis (standalone, Sentinel) or of a Redis Cluster: what the project connects
# with.
RedisClient = redis.Redis | redis.RedisCluster
AsyncRedisClient = redis.asyncio.Redis | redis.asyncio.RedisCluster


def text(value: Any) -> Any:
    """Decode bytes replies, so clients with or without decode_responses look alike."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list | tuple):
        return [text(v) for v in value]
    return value


# C0 and C1 controls, DEL, and the Unicode marks that reorder or hide text (bidi overrides, line
# separators): what a name read from Redis must not carry to a terminal or a log.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")


def printable(value: object, keep: str = "") -> str:
    """``str(value)`` with every control character escaped (ESC as ``\\x1b``), but those in
    ``keep`` (e.g. "\\n" for whole lines of output): anything a crawler wrote to Redis (a stage,
    holder, host, spider, worker or queue name, a dead letter) may carry terminal escape sequences;
    everything printed to a terminal or a log goes through here."""
    return _CONTROLS.sub(
        lambda m: m.group() if m.group() in keep else m.group().encode("unicode_escape").decode(),
        str(value),
    )


def check_name(name: object, what: str = "name") -> str:
    if not isinstance(name, str) or not name or "{" in name or "}" in name:
        raise InvalidArgument(f"{what} must be a non-empty string without braces, got {name!r}")
    return name


# The most slots a lock (stage, key, worker stage) may have. A lock is one Redis stream entry per slot
# and a resize adds or deletes one entry per slot, inside one script that blocks the whole server: at
# 1000, a resize from 3 to the maximum and back holds a concurrent PING up about 10 ms at worst (measured
# on a loaded 2-core machine, docs/security.md); 10,000 held it over 100 ms. A stage that needs more
# concurrency than this is not capped (limit None). The Lua scripts refuse more too (MAX_LIMIT in
# lock/scripts/_lib.lua, kept equal by a test).
MAX_LIMIT = 1000


def check_limit(limit: object, what: str = "limit") -> int:
    """A limit: an integer from 0 to MAX_LIMIT; InvalidArgument naming ``what`` and the value."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= MAX_LIMIT:
        shown = (
            repr(limit) if not isinstance(limit, int) or abs(limit) < 10**40 else "a huge integer"
        )
        raise InvalidArgument(f"{what} must be an integer from 0 to {MAX_LIMIT}, got {shown}")
    return limit


def check_ttl(ttl: object, what: str = "ttl") -> float:
    if (
        isinstance(ttl, bool)
        or not isinstance(ttl, int | float)
        or not math.isfinite(ttl)
        or ttl < 0.001
    ):
        raise InvalidArgument(f"{what} must be a number of seconds >= 0.001, got {ttl!r}")
    return float(ttl)


def check_flag(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{what} must be True or False, got {value!r}")
    return value


def check_timeout(timeout: object, what: str = "timeout") -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
        raise InvalidArgument(f"{what} must be None or a number >= 0, got {timeout!r}")
    return float(timeout)


@functools.cache
def load_scripts(package: str, names: tuple[str, ...], lib: str | None = None) -> dict[str, str]:
    """Lua sources by name from ``<package>/scripts/``, each with ``<lib>.lua`` in front of it when
    given."""
    folder = resources.files(package) / "scripts"
    prelude = (folder / f"{lib}.lua").read_text(encoding="utf-8") + "\n" if lib else ""
    return {name: prelude + (folder / f"{name}.lua").read_text(encoding="utf-8") for name in names}


# Where redis-py's and asyncio's connection internals live: an AttributeError or TypeError raised
# there is a connection closed under a command by another task (redis-py races during a failover,
# e.g. "'NoneType' object has no attribute 'writelines'"; redis-py issue 3546), not a bug of ours.
_CONNECTION_CODE = (
    "/redis/connection.py",
    "/redis/asyncio/connection.py",
    "/redis/asyncio/cluster.py",
    "/redis/cluster.py",
    "/asyncio/streams.py",
    "/asyncio/selector_events.py",
)


def as_connection_error(exc: BaseException) -> redis.exceptions.ConnectionError | None:
    """A ConnectionError standing for ``exc`` when it is an AttributeError or TypeError raised
    inside a connection's code (a connection closed under the command); None for any other
    error."""
    if not isinstance(exc, AttributeError | TypeError):
        return None
    tb, innermost = exc.__traceback__, None
    while tb is not None:
        innermost, tb = tb, tb.tb_next
    path = "" if innermost is None else innermost.tb_frame.f_code.co_filename.replace("\\", "/")
    if not path.endswith(_CONNECTION_CODE):
        return None
    error = redis.exceptions.ConnectionError(f"the connection closed under the command ({exc!r})")
    error.__cause__ = exc
    return error


@dataclass
class Backoff:
    """Seconds to wait before the next retry after an error: ``first``, doubled each failure up to
    ``most``.

    One object per thing that retries; :meth:`reset` after a success.
    """

    first: float = 0.1
    most: float = 5.0
    current: float = 0.0

    def __post_init__(self) -> None:
        self.current = self.first

    def next(self) -> float:
        """The delay to wait now; the following one is twice as long (at most ``most``)."""
        delay = self.current
        self.current = min(self.current * 2, self.most)
        return delay

    def reset(self) -> None:
        self.current = self.first
