"""Least-privilege Redis ACL users for a crawl: ``crawler``, ``operator``, ``watcher``.

::

    python -m scrapy_redislock.cli.acl crawler --prefix redislock --key 'shop:start_urls'
    # -> ACL SETUSER crawler reset on >PASSWORD resetchannels ~redislock:* ~shop:start_urls -@all +fcall ...

- ``crawler``: what crawl processes send, both fronts (middleware/scheduler and worker mixin), and
  nothing else: its keys are the prefix's (locks, queues) and the RedisSpider feed keys given with
  ``--key``. Redis checks the commands a script runs against the caller's ACL too, so the list holds
  every command of ``scripts/*.lua``. It runs the project's scripts as the functions an admin loaded
  (``load-functions``; FCALL), or scripts an admin loaded (EVALSHA), and may load none: no Lua of
  its own (no ``SCRIPT LOAD``, no ``EVAL``, no ``FUNCTION LOAD``).
- ``operator``: the command line, ``status`` and the ones that steer (``set-limit``, ``release``,
  ``reset``), plus reading and deleting dead letters; the prefix's keys only.
- ``watcher``: ``status`` only, read-only access (``%R~``) to the prefix's keys.

The client commands were found with MONITOR during crawls of both fronts and runs of every
sub-command; ``tests/cli/test_acl.py`` finds them again (MONITOR, the scripts, and the ACL log of a
crawl run as ``crawler``) and fails, naming the command, when the code sends one that is not listed
here. Connection commands AUTH and HELLO need no rule.

Server versions: the rules are for Redis 7.0 or later (read-only key patterns, ``%R~``) and Valkey.
redis-py sends CLIENT SETINFO on every connect to a server that has it (Redis 7.2 and later, every
Valkey: they report ``redis_version`` 7.2.4) and ignores a refusal, which the ACL log would record
for every connection: every role allows ``client|setinfo`` there. Redis 7.0 and 7.1 have no such
command and refuse a rule naming it (and no rule both accept allows it without allowing more), so
the rules depend on the server's version: ``--redis-version 7.0`` (``acl_rules(...,
server_version="7.0.15")``, with :func:`redis_version` of a client) leaves it out. Redis Cluster
needs the cluster's topology commands as well (``+cluster|slots +cluster|shards +readonly``);
single-node rules are what is tested. Reads no settings; imports neither Scrapy nor Twisted.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Sequence
from importlib import resources
from typing import Any

ROLES = ("crawler", "operator", "watcher")
# What redis-py sends on connect, beside AUTH and HELLO, to a server that knows it: CLIENT SETINFO
# (lib-name, lib-ver) since Redis 7.2. Every role's clients connect with redis-py.
CONNECT_COMMANDS = ("client|setinfo",)
# Redis 7.2 added CLIENT SETINFO (Valkey forked 7.2.4 and reports that redis_version)
SETINFO_SINCE = (7, 2)
OLDEST = (7, 0)  # read-only key patterns (%R~) and the ACL selectors of Redis 7

# status: one MULTI/EXEC per stage (meta, stream, group, pending list, consumers, owners, a key's light
# path) and per worker spider (TIME, its workers' beats and deadlines, in-flight counts, queue lengths),
# SCAN for stages and dead-letter lists, which it reads with LLEN, MEMORY USAGE (a bound) and LRANGE.
WATCHER_COMMANDS = (
    "ping", "scan", "multi", "exec", "hgetall", "xinfo|stream", "xinfo|groups",
    "xinfo|consumers", "xpending", "llen", "lrange", "zrange", "lindex", "time", "hlen", "zcard",
    "memory|usage",
)  # fmt: skip
# Sent by crawl processes themselves (not by scripts): running the project's functions (FCALL: an
# admin loads them, `load-functions`; a client's first EVALSHA answers NOSCRIPT, then FCALL), the
# lock's blocking wait,
# the worker queues' reads (lengths, the in-flight counter, registered workers before a flush, a
# worker's own in-flight ids after a lost reply, the dupefilter's size at start: SCARD), an idle
# worker's blocking wait for work (BLPOP) and the token it hands on (LPUSH), its wait for start URLs
# (BLMOVE of a list feed onto itself; it takes them with a script); HSET + WAIT for replicas=N; the
# status reads (MULTI/EXEC) with which a crawl logs why a stage waits.
CRAWLER_CLIENT_COMMANDS = (
    "evalsha", "fcall", "ping",
    "xreadgroup", "hget", "hset", "wait", "llen", "get", "zrange", "hkeys", "blpop", "lpush",
    "scard", "blmove",
    "multi", "exec", "hgetall", "xinfo|stream", "xinfo|groups", "xinfo|consumers", "xpending",
    "zrange", "lindex",
)  # fmt: skip
# set-limit, release, reset, requeue are the project's functions (FCALL); DEL drops a dead-letter list once looked at;
# requeue reads the worker's in-flight record (HVALS: the stages of its requests) and the workers
# (TIME, ZRANGE, HGETALL, HLEN: the watcher's too).
OPERATOR_COMMANDS = (*WATCHER_COMMANDS, "evalsha", "fcall", "del", "hvals")

# Scripts every role that runs scripts may run (the operator's set_limit/release_owner/reset/retire
# (forget)/ queue_requeue; the crawler's all).
OPERATOR_SCRIPTS = (
    "lock/_lib", "setup", "set_limit", "release_owner", "reset", "retire", "queue_requeue",
    "adapt_unpin",
)  # fmt: skip

# the packages with a scripts/ folder
SCRIPT_PARTS = ("scrapy_redislock.lock", "scrapy_redislock.crawl", "scrapy_redislock.workers")
SUBCOMMAND_OF = {"XGROUP", "XINFO", "CLIENT", "SCRIPT", "CONFIG", "OBJECT"}
CALL = re.compile(r"redis\.p?call\(\s*'([A-Za-z]+)'(?:\s*,\s*'([A-Za-z]+)')?")


def script_commands(names: Iterable[str] | None = None) -> set[str]:
    """Every command the given scripts (every ``scripts/*.lua`` of the package by default) may run,
    in ACL spelling: a script by its name, or by its part and name (``lock/_lib``: each part's
    scripts share a ``_lib.lua`` of their own)."""
    wanted = None if names is None else set(names)
    found: set[str] = set()
    paths = [
        (part.rsplit(".", 1)[1], p)
        for part in SCRIPT_PARTS
        for p in (resources.files(part) / "scripts").iterdir()
    ]
    for part, path in paths:
        name = path.name[:-4]
        if not path.name.endswith(".lua") or (
            wanted is not None and name not in wanted and f"{part}/{name}" not in wanted
        ):
            continue
        found.update(
            _acl_name(command, sub) for command, sub in CALL.findall(path.read_text("utf-8"))
        )
    return found


def _acl_name(command: str, sub: str) -> str:
    """``('XINFO', 'GROUPS')`` -> ``xinfo|groups`` for a command ACLs split by subcommand, else the
    command alone."""
    command = command.upper()
    return f"{command}|{sub}".lower() if command in SUBCOMMAND_OF and sub else command.lower()


def version_tuple(version: str | Sequence[int] | None) -> tuple[int, int]:
    """``"7.0.15"`` -> (7, 0); None (not told) -> the newest rules (Redis 7.2 or later, Valkey);
    ValueError for something that is no version, or a server too old for the roles."""
    if version is None:
        return SETINFO_SINCE
    if isinstance(version, str):
        parts = version.strip().split(".")
        if len(parts) < 2 or not all(part.isdigit() for part in parts[:2]):
            raise ValueError(f"a Redis version is like 7.0 or 7.2.4, got {version!r}")
        found = (int(parts[0]), int(parts[1]))
    else:
        found = (int(version[0]), int(version[1]) if len(version) > 1 else 0)
    if found < OLDEST:
        raise ValueError(
            f"the ACL roles need Redis {OLDEST[0]}.{OLDEST[1]} or later (read-only key patterns), got {version!r}"
        )
    return found


def redis_version(client: Any) -> str:
    """The ``redis_version`` a (blocking) redis-py client's server reports: what :func:`acl_rules`
    takes."""
    return str(client.info("server")["redis_version"])


def commands_of(role: str, server_version: str | Sequence[int] | None = None) -> list[str]:
    """The commands a role may run, sorted (scripts' commands, and what redis-py sends on connect to
    a server of that version, included; None: Redis 7.2 or later, Valkey)."""
    connect = set(CONNECT_COMMANDS) if version_tuple(server_version) >= SETINFO_SINCE else set()
    if role == "crawler":
        return sorted(set(CRAWLER_CLIENT_COMMANDS) | script_commands() | connect)
    if role == "operator":
        return sorted(set(OPERATOR_COMMANDS) | script_commands(OPERATOR_SCRIPTS) | connect)
    if role == "watcher":
        return sorted(set(WATCHER_COMMANDS) | connect)
    raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")


def acl_rules(
    role: str,
    prefix: str = "redislock",
    keys: Sequence[str] = (),
    server_version: str | Sequence[int] | None = None,
) -> list[str]:
    """Rules for ``ACL SETUSER <name> <rules> >password``: keys of the prefix (read-only for the
    watcher) and ``keys`` (e.g. a RedisSpider's ``redis_key``, for the crawler), no channels, only
    the role's commands.

    ``server_version``: the server's ``redis_version`` (:func:`redis_version` of a client); None for
    Redis 7.2 or later and Valkey, whose rules allow ``client|setinfo``, a rule Redis 7.0 and 7.1
    refuse."""
    commands = commands_of(role, server_version)
    access = "%R~" if role == "watcher" else "~"
    patterns = [f"{access}{prefix}:*", *(f"~{key}" for key in keys)]
    return ["reset", "on", "resetchannels", *patterns, "-@all", *(f"+{c}" for c in commands)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scrapy_redislock.cli.acl",
        description="Print the ACL SETUSER command of a least-privilege role.",
    )
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--user", help="user name (default: the role)")
    parser.add_argument(
        "--prefix", default="redislock", help="REDISLOCK_KEY_PREFIX (default: redislock)"
    )
    parser.add_argument(
        "--key", action="append", default=[], help="another key pattern, e.g. shop:start_urls"
    )
    parser.add_argument(
        "--redis-version",
        help="the server's redis_version (INFO server), e.g. 7.0.15; default: Redis 7.2 or later, or Valkey (Redis 7.0 and 7.1 lack CLIENT SETINFO and refuse a rule naming it)",  # noqa: E501
    )
    opts = parser.parse_args(argv)
    try:
        rules = acl_rules(opts.role, opts.prefix, opts.key, opts.redis_version)
    except ValueError as exc:
        parser.error(str(exc))
    sys.stdout.write(f"ACL SETUSER {opts.user or opts.role} {' '.join(rules)} >PASSWORD\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
