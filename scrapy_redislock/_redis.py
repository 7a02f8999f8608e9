"""What every layer needs of Redis and nothing else: decoding replies, checking arguments, loading
Lua, backing off.

Imports neither Scrapy nor Twisted and reads no settings. Lua scripts live as package data, one file
per script, in a ``scripts`` folder beside the code that runs them (:func:`load_scripts`), so each
part loads only its own.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis
import redis.asyncio
import redis.exceptions
from redis.backoff import EqualJitterBackoff

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


def check_name(name: object, what: str = "name") -> str:
    if not isinstance(name, str) or not name or "{" in name or "}" in name:
        raise InvalidArgument(f"{what} must be a non-empty string without braces, got {name!r}")
    return name


def check_limit(limit: object, what: str = "limit") -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise InvalidArgument(f"{what} must be an integer >= 0, got {limit!r}")
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
    """Seconds to wait before the next retry after an error: about ``first``, doubled each failure
    up to ``most``, with redis-py's equal jitter (each delay between half and all of that), so that
    the workers an outage stopped together do not all retry in the same instant.

    One object per thing that retries; :meth:`reset` after a success.
    """

    first: float = 0.1
    most: float = 5.0
    failures: int = 0

    def next(self) -> float:
        """The delay to wait now; the following one is about twice as long (at most ``most``)."""
        delay = EqualJitterBackoff(self.most, self.first).compute(self.failures)
        self.failures = min(self.failures + 1, 64)  # 2 ** 64 * first is past any ``most``
        return float(delay)

    def reset(self) -> None:
        self.failures = 0
