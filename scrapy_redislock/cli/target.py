"""Where the command line and the dashboard connect, and how a failure is told: one line, no
password, an exit status.

Reads (``python -m``) the environment variables REDISLOCK_URL, REDIS_URL and REDISLOCK_KEY_PREFIX;
as a Scrapy command, the project's settings through
:func:`scrapy_redislock.crawl.settings.read_settings`; ``--url`` and ``--prefix`` win over both.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
import redis.exceptions

from scrapy_redislock._redis import RedisClient, check_name, printable
from scrapy_redislock.crawl import defaults
from scrapy_redislock.crawl.connection import RedisURL, mask_url, parse_url
from scrapy_redislock.crawl.settings import read_settings
from scrapy_redislock.errors import ConfigError, InvalidArgument
from scrapy_redislock.lock.base import CommandRunner
from scrapy_redislock.lock.protocol import Operation, drive

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
T = TypeVar("T")

DEFAULT_URL = "redis://localhost:6379/0"
# Fail fast on a dead address; an operator is waiting.
CLI_CLIENT_PARAMS: dict[str, Any] = {"socket_connect_timeout": 5, "socket_timeout": 5}
# A quorum's masters (REDISLOCK_URL as a list) are not one Redis: the commands read and change one
# lock in one place.
QUORUM_REFUSED = "REDISLOCK_URL lists {count} masters (a quorum lock): the command line works on one Redis at a time; give --url of one master to look at or change that master's copy of the locks ({urls})"  # noqa: E501
# What a client raises when Redis cannot serve it (a cluster client with no reachable node: not a
# RedisError).
REDIS_ERRORS = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException)


class CliError(Exception):
    """A failure to report as one line on stderr, with an exit status."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


# -- where to connect ------------------------------------------------------------------------------


@dataclass
class Target:
    """Where the locks are, and the configuration a Scrapy project gives them."""

    url: str
    source: str
    prefix: str
    ttl: float
    params: dict[str, Any] = field(default_factory=dict)
    stages: Mapping[str, int | None] = field(default_factory=dict)
    # clients made, closed by close()
    opened: list[Any] = field(default_factory=list, repr=False, compare=False)

    @property
    def safe_url(self) -> str:
        return mask_url(self.url)

    @property
    def connection(self) -> RedisURL:
        return parse_url(self.url, self.source)

    def client(self) -> RedisClient:
        """A blocking client: one server, the master found through Sentinel, or a cluster client
        (status then scans every master)."""
        try:
            client = self.connection.client(**self.params, decode_responses=True)
        except (ValueError, TypeError) as exc:
            raise CliError(
                f"{self.source} is not a usable redis URL ({exc}): {self.safe_url}", EXIT_USAGE
            ) from None
        self.opened.append(client)
        return client

    def close(self) -> None:
        """Close every client :meth:`client` made (their connections, and a Sentinel master's
        sentinels')."""
        while self.opened:
            client = self.opened.pop()
            # closing never hides the command's result
            with contextlib.suppress(redis.exceptions.RedisError, OSError):
                client.close()

    def scrub(self, message: str) -> str:
        """The message with the URL's passwords (should a library ever echo one) replaced by ***."""
        return self.connection.scrub(message)


def resolve_target(
    opts: argparse.Namespace, env: Mapping[str, str], settings: Any = None
) -> Target:
    """--url/--prefix, else the project's settings (Scrapy command), else environment variables,
    else defaults."""
    project = _from_project(opts, settings) if settings is not None else {}
    if getattr(opts, "url", None):
        url, source = opts.url, "--url"
    elif "url" in project:
        url, source = project["url"]
    else:
        url, source = _url_from_env(env)
    try:
        parse_url(url, source)
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    if getattr(opts, "prefix", None) is not None:
        prefix, prefix_source = opts.prefix, "--prefix"
    elif "prefix" in project:
        prefix, prefix_source = project["prefix"]
    elif env.get("REDISLOCK_KEY_PREFIX"):
        prefix, prefix_source = env["REDISLOCK_KEY_PREFIX"], "$REDISLOCK_KEY_PREFIX"
    else:
        prefix, prefix_source = defaults.SETTINGS["REDISLOCK_KEY_PREFIX"], "the default prefix"
    try:
        check_name(prefix, prefix_source)
    except InvalidArgument as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    return Target(
        url=url,
        source=source,
        prefix=prefix,
        ttl=project.get("ttl", float(defaults.SETTINGS["REDISLOCK_TTL"])),
        params=project.get("params", dict(CLI_CLIENT_PARAMS)),
        stages=project.get("stages", {}),
    )


def _from_project(opts: argparse.Namespace, settings: Any) -> dict[str, Any]:
    """What the project's settings say: ttl, params and stages always; the URL and the prefix (each
    with where it came from) when the settings set them."""
    try:
        configured = read_settings(settings)
    except ConfigError as exc:
        raise CliError(f"project settings: {exc}", EXIT_USAGE) from None
    masters = configured.redis.masters
    if masters and not getattr(opts, "url", None):
        refused = QUORUM_REFUSED.format(count=len(masters), urls=configured.redis.safe_url)
        raise CliError(refused, EXIT_USAGE)
    found: dict[str, Any] = {
        "ttl": configured.ttl,
        "stages": configured.stages,
        "params": {**CLI_CLIENT_PARAMS, **configured.redis.params},
    }
    if any(
        settings.get(name) for name in ("REDISLOCK_URL", "REDIS_URL", "REDIS_HOST", "REDIS_PORT")
    ):
        found["url"] = (configured.redis.url, "the project's settings (REDISLOCK_URL / REDIS_URL)")
    if settings.get("REDISLOCK_KEY_PREFIX") is not None:
        found["prefix"] = (configured.key_prefix, "REDISLOCK_KEY_PREFIX")
    return found


def _url_from_env(env: Mapping[str, str]) -> tuple[str, str]:
    for name in ("REDISLOCK_URL", "REDIS_URL"):
        if env.get(name):
            url = env[name]
            if url.lstrip().startswith("["):
                raise CliError(QUORUM_REFUSED.format(count="several", urls=url), EXIT_USAGE)
            return url, f"${name}"
    return DEFAULT_URL, "the default URL"


# -- running scripts -------------------------------------------------------------------------------


def run_operation(client: RedisClient, op: Operation[T], name: str) -> T:
    """Drive one core operation (sans-IO generator) with the blocking client."""
    return drive(op, CommandRunner(client), name)


def _redis_failure(exc: BaseException, target: Target) -> str:
    cause = exc.__cause__ if isinstance(exc.__cause__, redis.exceptions.RedisError) else exc
    detail = target.scrub(str(cause) or type(cause).__name__)
    where = f"{target.safe_url} ({target.source})"
    if isinstance(cause, redis.exceptions.AuthenticationError) or str(cause).startswith(
        ("WRONGPASS", "NOAUTH")
    ):
        return f"Redis at {where} refused the credentials: {detail}"
    if isinstance(
        cause,
        redis.exceptions.ConnectionError
        | redis.exceptions.TimeoutError
        | redis.exceptions.RedisClusterException,
    ):
        hint = ""
        if target.connection.tls and "certificate" in detail.lower():
            hint = " (for a private CA add ?ssl_ca_certs=FILE to the URL)"
        elif target.connection.tls and "refused" not in detail.lower():
            hint = " (rediss:// is TLS: does the server speak TLS on that port?)"
        return f"cannot reach Redis at {where}: {detail}{hint}"
    if isinstance(cause, redis.exceptions.NoPermissionError) or str(cause).startswith("NOPERM"):
        return f"Redis at {where} refused the command (ACL): {detail}"
    return f"Redis error at {where}: {detail}"


def failure(exc: BaseException, target: Target | None) -> tuple[str, int]:
    """The one line (no password in it) and the exit status that report a failed sub-command."""
    # printable: a message may name a stage, holder or worker that a crawler wrote to Redis
    if isinstance(exc, CliError):
        return printable(exc), exc.code
    if isinstance(exc, REDIS_ERRORS):
        assert target is not None
        return printable(_redis_failure(exc, target)), EXIT_ERROR
    message = target.scrub(str(exc)) if target else str(exc)  # e.g. an unreadable ssl_ca_certs file
    return printable(f"cannot use the connection: {message}"), EXIT_ERROR
