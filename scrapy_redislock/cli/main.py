"""The operator's command line: ``python -m scrapy_redislock`` and ``scrapy redislock`` (same sub-commands).

- ``status [--json] [--watch [SECONDS] [--count N]] [--stage-key PATTERN]``: every stage lock under the key
  prefix; the locks of keys met at run time (REDISLOCK_STAGE_KEY) apart, busiest first, those matching PATTERN.
- ``set-limit STAGE N [--create [--ttl SECONDS]]``: change a stage's cap for the whole cluster, live.
- ``release STAGE HOLDER [--yes]``: free the slots of one holder (a worker known to be dead).
- ``reset STAGE [--yes]``: free every slot of a stage and forget its holders; the limit stays.
- ``dashboard [--host H] [--port P] [--allow-control]``: a live web page and ``/metrics`` (see
  :mod:`scrapy_redislock.cli.dashboard`).

Blocking code with the sync redis client: it never runs on a reactor. Reads (``python -m``) the environment
variables REDISLOCK_URL, REDIS_URL and REDISLOCK_KEY_PREFIX; as a Scrapy command, the project's settings through
:func:`scrapy_redislock.crawl.settings.read_settings` (REDISLOCK_URL and scrapy-redis's REDIS_* fallbacks,
REDISLOCK_PARAMS, REDISLOCK_KEY_PREFIX, REDISLOCK_TTL, REDISLOCK_STAGES), with those environment variables used
only where the project sets no connection or prefix. ``--url`` and ``--prefix`` win over both.
Every state change is a Lua script (set_limit, release_owner, reset). Passwords are never printed.
Exit status: 0 done, 1 failed or refused (Redis unreachable, unknown stage or holder, not confirmed), 2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any
from urllib.parse import unquote, urlsplit

import redis
import redis.exceptions

from scrapy_redislock._redis import check_limit, check_name, check_ttl
from scrapy_redislock.cli.status import read_all, snapshot, split_keys
from scrapy_redislock.crawl import defaults
from scrapy_redislock.crawl.settings import check_url, mask_url, read_settings
from scrapy_redislock.errors import ConfigError, InvalidArgument
from scrapy_redislock.lock.core import LIMBO, LockCore, LockKeys, release_consumer, reset_lock
from scrapy_redislock.lock.front import CommandRunner
from scrapy_redislock.lock.protocol import Operation, drive
from scrapy_redislock.lock.status import KEY_LOCK_PREFIX, StageStatus, find_stages, stage_status, why_waiting
from scrapy_redislock.workers.status import DeadLetters, SpiderStatus, dead_letters

PROG = "redislock"
EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
DEFAULT_URL = "redis://localhost:6379/0"
# Fail fast on a dead address; an operator is waiting.
CLI_CLIENT_PARAMS: dict[str, Any] = {"socket_connect_timeout": 5, "socket_timeout": 5}
DEFAULT_WATCH = 2.0
CLEAR_SCREEN = "\x1b[H\x1b[2J"


class CliError(Exception):
    """A failure to report as one line on stderr, with an exit status."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (argparse would print the whole usage first)."""

    def error(self, message: str) -> Any:  # argparse's signature says NoReturn
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


# -- arguments ---------------------------------------------------------------------------------------------------


def _seconds(option: str) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds > 0, refused with a message naming ``option``."""

    def check(value: str) -> float:
        try:
            seconds = float(value)
        except ValueError:
            seconds = float("nan")
        if not seconds > 0 or seconds == float("inf"):
            raise argparse.ArgumentTypeError(f"{option} takes a number of seconds > 0, got {value!r}")
        return seconds

    return check


def _port(value: str) -> int:
    if not value.isdigit() or int(value) > 65535:
        raise argparse.ArgumentTypeError(f"--port takes an integer from 0 to 65535, got {value!r}")
    return int(value)


def _count(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"--count takes an integer >= 1, got {value!r}")
    return int(value)


def add_subcommands(parser: argparse.ArgumentParser, *, top_level: bool = True, prog: str = PROG) -> None:
    """The sub-commands and their options, on our own parser or on Scrapy's (``top_level=False``).

    ``--url`` and ``--prefix`` go on every sub-command (Scrapy's command line only allows options after the
    sub-command) and, with ``top_level``, also before it; sub-command defaults are suppressed so that they do
    not overwrite what was given before the sub-command.
    """
    common = argparse.ArgumentParser(add_help=False)
    connection = common.add_argument_group("connection")
    connection.add_argument(
        "--url",
        default=argparse.SUPPRESS,
        help="Redis URL (redis://, rediss:// for TLS, user:password@ for ACL; ?ssl_ca_certs=FILE for a private "
        "CA). Default: REDISLOCK_URL, else REDIS_URL (environment, or the project's settings as a Scrapy "
        f"command), else {DEFAULT_URL}",
    )
    connection.add_argument(
        "--prefix",
        default=argparse.SUPPRESS,
        help=f"key prefix of the locks (default: REDISLOCK_KEY_PREFIX, else {defaults.REDISLOCK_KEY_PREFIX!r})",
    )
    if top_level:
        parser.add_argument("--url", default=None, help=argparse.SUPPRESS)
        parser.add_argument("--prefix", default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser, prog=prog)
    sub.required = True

    status = sub.add_parser(
        "status",
        parents=[common],
        help="show every stage: limit, holders, waiters, fence counter",
        description="Show every stage lock under the key prefix: limit, holders (host, pid, spider, age, lease "
        "left), waiters (as each process last reported), fence counter, free slots and debt.",
    )
    status.add_argument("--json", action="store_true", help="print JSON (one document per refresh with --watch)")
    status.add_argument(
        "--watch",
        nargs="?",
        type=_seconds("--watch"),
        const=DEFAULT_WATCH,
        default=None,
        metavar="SECONDS",
        help=f"refresh every SECONDS (default {DEFAULT_WATCH:g}) until Ctrl-C",
    )
    status.add_argument("--count", type=_count, default=None, metavar="N", help="with --watch: stop after N refreshes")
    status.add_argument(
        "--stage-key",
        default=None,
        metavar="PATTERN",
        help="show only the keys (REDISLOCK_STAGE_KEY: domains, ...) matching this glob, e.g. '*.example.com'",
    )

    set_limit = sub.add_parser(
        "set-limit",
        parents=[common],
        help="change a stage's cap for the whole cluster, live",
        description="Change a stage's cap for every process at once, while they run (the limit lives in Redis). "
        "Lowering revokes nothing: held slots stay until released, and no new slot is granted until fewer "
        "than N are held. A process that starts later writes its own REDISLOCK_STAGES limit again.",
    )
    set_limit.add_argument("stage", metavar="STAGE")
    set_limit.add_argument("limit", metavar="N", help="the new limit, an integer >= 0 (0 pauses the stage)")
    set_limit.add_argument(
        "--create", action="store_true", help="create the stage if it does not exist (else that is an error)"
    )
    set_limit.add_argument("--ttl", type=float, default=None, help="lease seconds for --create")

    release = sub.add_parser(
        "release",
        parents=[common],
        help="free the slots of one holder (a worker known to be dead)",
        description="Free every slot HOLDER holds in STAGE and forget it. HOLDER is a name from `status` (or "
        "host:pid, or any prefix of the name ending at a colon, if only one holder matches). A live holder "
        "finds its slots lost at its next renewal.",
    )
    release.add_argument("stage", metavar="STAGE")
    release.add_argument("holder", metavar="HOLDER")
    release.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")

    reset = sub.add_parser(
        "reset",
        parents=[common],
        help="free every slot of a stage and forget its holders (the limit stays)",
        description="Free every held slot of STAGE, forget every registered process, drop pending debt, and "
        "start again with LIMIT free slots. Fencing tokens keep increasing. Live holders find their slots "
        "lost at their next renewal; until their requests end, the stage may briefly run over its cap.",
    )
    reset.add_argument("stage", metavar="STAGE")
    reset.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")

    dashboard = sub.add_parser(
        "dashboard",
        parents=[common],
        help="serve a live web page of every stage and worker, and Prometheus metrics at /metrics",
        description="Serve one web page that shows every stage and worker live (server-sent events), and "
        "Prometheus metrics at /metrics. Read-only unless --allow-control. Needs the 'dashboard' extra "
        "(pip install 'scrapy-redislock[dashboard]').",
    )
    dashboard.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"
    )
    dashboard.add_argument("--port", type=_port, default=8030, help="port to listen on (default 8030; 0: any free)")
    dashboard.add_argument(
        "--interval",
        type=_seconds("--interval"),
        default=DEFAULT_WATCH,
        metavar="SECONDS",
        help=f"read Redis every SECONDS (default {DEFAULT_WATCH:g})",
    )
    dashboard.add_argument(
        "--history", type=_seconds("--history"), default=600.0, metavar="SECONDS", help="seconds the charts span (600)"
    )
    dashboard.add_argument(
        "--allow-control",
        action="store_true",
        help="let the page set limits, release holders and reset stages, with a token printed at start",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Show and steer the stage locks of a running crawl (python -m scrapy_redislock ...).",
        epilog="Options go after the sub-command, e.g. `python -m scrapy_redislock status --url rediss://...`.",
    )
    add_subcommands(parser, top_level=True)
    return parser


# -- where to connect ----------------------------------------------------------------------------------------------


@dataclass
class Target:
    """Where the locks are, and the configuration a Scrapy project gives them."""

    url: str
    source: str
    prefix: str
    ttl: float
    params: dict[str, Any] = field(default_factory=dict)
    stages: Mapping[str, int | None] = field(default_factory=dict)

    @property
    def safe_url(self) -> str:
        return mask_url(self.url)

    def client(self) -> redis.Redis:
        try:
            return redis.Redis.from_url(self.url, **self.params, decode_responses=True)
        except (ValueError, TypeError) as exc:
            raise CliError(f"{self.source} is not a usable redis URL ({exc}): {self.safe_url}", EXIT_USAGE) from None

    def scrub(self, message: str) -> str:
        """The message with the URL's password (should a library ever echo it) replaced by ***."""
        password = urlsplit(self.url).password
        for secret in {password, unquote(password or "")} - {None, ""}:
            message = message.replace(str(secret), "***")
        return message


def resolve_target(opts: argparse.Namespace, env: Mapping[str, str], settings: Any = None) -> Target:
    """--url/--prefix, else the project's settings (Scrapy command), else environment variables, else defaults."""
    url: str | None = None
    source = ""
    prefix: str | None = None
    prefix_source = ""
    ttl = float(defaults.REDISLOCK_TTL)
    params = dict(CLI_CLIENT_PARAMS)
    stages: Mapping[str, int | None] = {}
    if settings is not None:
        try:
            configured = read_settings(settings)
        except ConfigError as exc:
            raise CliError(f"project settings: {exc}", EXIT_USAGE) from None
        ttl, stages = configured.ttl, configured.stages
        params = {**CLI_CLIENT_PARAMS, **configured.params}
        if any(settings.get(name) for name in ("REDISLOCK_URL", "REDIS_URL", "REDIS_HOST", "REDIS_PORT")):
            url, source = configured.url, "the project's settings (REDISLOCK_URL / REDIS_URL)"
        if settings.get("REDISLOCK_KEY_PREFIX") is not None:
            prefix, prefix_source = configured.key_prefix, "REDISLOCK_KEY_PREFIX"
    if getattr(opts, "url", None):
        url, source = opts.url, "--url"
    elif url is None:
        for name in ("REDISLOCK_URL", "REDIS_URL"):
            if env.get(name):
                url, source = env[name], f"${name}"
                break
        else:
            url, source = DEFAULT_URL, "the default URL"
    try:
        check_url(url, source)
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    if getattr(opts, "prefix", None) is not None:
        prefix, prefix_source = opts.prefix, "--prefix"
    elif prefix is None:
        if env.get("REDISLOCK_KEY_PREFIX"):
            prefix, prefix_source = env["REDISLOCK_KEY_PREFIX"], "$REDISLOCK_KEY_PREFIX"
        else:
            prefix, prefix_source = defaults.REDISLOCK_KEY_PREFIX, "the default prefix"
    try:
        check_name(prefix, prefix_source)
    except InvalidArgument as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    return Target(url=url, source=source, prefix=prefix, ttl=ttl, params=params, stages=stages)


# -- running scripts -------------------------------------------------------------------------------------------------


def run_operation(client: redis.Redis, op: Operation, name: str) -> Any:
    """Drive one core operation (sans-IO generator) with the blocking client."""
    return drive(op, CommandRunner(client), name)


# -- rendering ---------------------------------------------------------------------------------------------------------


def seconds(value: float | None) -> str:
    """A short human duration: 0.25s, 12s, 5m03s, 2h05m."""
    if value is None:
        return "-"
    if value < 10:
        return f"{value:.2f}s" if value < 1 else f"{value:.1f}s"
    if value < 60:
        return f"{value:.0f}s"
    if value < 3600:
        return f"{int(value // 60)}m{int(value % 60):02d}s"
    return f"{int(value // 3600)}h{int(value % 3600 // 60):02d}m"


def clock_time(moment: float | None, now: float) -> str:
    """A start time: HH:MM:SS today, else the date too."""
    if moment is None:
        return "-"
    local = time.localtime(moment)
    return time.strftime("%H:%M:%S" if now - moment < 20 * 3600 else "%Y-%m-%d %H:%M", local)


def table(header: Sequence[str], rows: Sequence[Sequence[object]], numeric: set[int], indent: str = "") -> list[str]:
    cells = [list(header)] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        parts = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append((indent + "  ".join(parts)).rstrip())
    return lines


def render_status(
    stages: Sequence[StageStatus],
    target: Target,
    now: float | None = None,
    spiders: Sequence[SpiderStatus] = (),
    keys: bool = False,
) -> str:
    now = time.time() if now is None else now
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    lines = [f"{target.safe_url}  prefix {target.prefix!r}  {stamp}", ""]
    for spider in spiders:
        queued = ", ".join(f"{stage} {n}" for stage, n in spider.queues.items()) or "none"
        lines.append(
            f"spider {spider.spider}: {spider.alive} worker(s) alive, {spider.dead} silent for the ttl "
            f"({seconds(spider.ttl)}); queued: {queued}"
        )
    if spiders:
        lines.append("")
    if not stages:
        if not keys:
            lines.append(f"no stage locks under prefix {target.prefix!r}")
        return "\n".join(lines) + "\n"
    rows = [
        [s.stage, s.limit, s.held, s.free, s.debt, s.waiters, s.fence, seconds(s.ttl), len(s.processes)]
        if s.exists
        else [s.stage, s.limit, None, None, None, None, None, seconds(s.ttl), None]
        for s in stages
    ]
    header = ["STAGE", "LIMIT", "HELD", "FREE", "DEBT", "WAITERS", "FENCE", "TTL", "PROCESSES"]
    lines += table(header, rows, numeric={1, 2, 3, 4, 5, 6, 7, 8})
    limbo = False
    for s in stages:
        lines.append("")
        if not s.exists:
            lines.append(f"{s.stage}: its stream is missing in Redis (data loss?); the next process to start or")
            lines.append("  renew recreates it")
            continue
        waiting = [p for p in s.processes if p.held == 0 and p.waiting > 0]
        idle = [p for p in s.processes if p.held == 0 and p.waiting == 0]
        lines.append(f"{s.stage}: {s.held} held of {s.limit}, {s.waiters} waiting")
        why = why_waiting(s, now)
        if why:
            lines.append(f"  a request waits because: {why}")
        if not s.grants and not waiting:
            lines.append("  no holders")
        else:
            holder_rows = []
            for g in s.grants:
                p = s.process(g.holder)
                limbo = limbo or g.holder == LIMBO
                left = "expired" if g.lease_left < 0 else seconds(g.lease_left)
                who = [p.host, p.pid, p.spider, clock_time(p.started, now)] if p else [None, None, None, None]
                holder_rows.append([g.holder, *who, g.fence, seconds(g.age), left, p and p.waiting])
            for p in waiting:
                who = [p.host, p.pid, p.spider, clock_time(p.started, now)]
                holder_rows.append([p.holder, *who, None, None, None, p.waiting])
            header = ["HOLDER", "HOST", "PID", "SPIDER", "STARTED", "GRANT", "AGE", "LEASE LEFT", "WAITING"]
            lines += table(header, holder_rows, numeric={2, 5, 6, 7, 8}, indent="  ")
        if idle:
            lines.append(f"  + {len(idle)} registered process(es) holding nothing and not waiting")
    lines.append("")
    lines.append("GRANT: fencing token; AGE: since the grant or its last renewal (Redis's clock);")
    lines.append("WAITING: as each process last reported it (at its renewals, every ttl/3)")
    if limbo:
        lines.append(f"{LIMBO}: slots reserved after a Redis data loss for surviving holders; free after one ttl")
    return "\n".join(lines) + "\n"


# -- sub-commands ------------------------------------------------------------------------------------------------------


@dataclass
class Streams:
    stdin: IO[str]
    out: IO[str]
    err: IO[str]

    def say(self, message: str) -> None:
        self.out.write(message + "\n")
        self.out.flush()


def _stage_arg(value: str) -> str:
    try:
        return check_name(value, "STAGE")
    except InvalidArgument as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def _limit_arg(value: str) -> int:
    try:
        return check_limit(int(value, 10), "N")
    except (ValueError, InvalidArgument):
        raise CliError(f"N must be an integer >= 0, got {value!r}", EXIT_USAGE) from None


def _require_stage(client: redis.Redis, target: Target, stage: str) -> StageStatus:
    found = stage_status(client, target.prefix, stage)
    if found is None:
        known = find_stages(client, target.prefix)
        raise CliError(
            f"unknown stage {stage!r} under prefix {target.prefix!r} at {target.safe_url}; "
            f"stages there: {', '.join(known) if known else 'none'}"
        )
    return found


def _confirm(question: str, opts: argparse.Namespace, io: Streams) -> None:
    if opts.yes:
        return
    if not io.stdin.isatty():
        raise CliError(f"{opts.command}: not confirmed: standard input is not a terminal; pass --yes to confirm")
    io.err.write(f"{question} [y/N] ")
    io.err.flush()
    answer = io.stdin.readline().strip().lower()
    if answer not in {"y", "yes"}:
        raise CliError("aborted; nothing was changed")


def cmd_status(opts: argparse.Namespace, target: Target, io: Streams) -> int:
    if opts.count is not None and opts.watch is None:
        raise CliError("--count needs --watch", EXIT_USAGE)
    client = target.client()
    if opts.watch is None:
        io.out.write(_status_frame(client, opts, target))
        return EXIT_OK
    clear = not opts.json and io.out.isatty()
    frames = 0
    try:
        while True:
            try:
                frame = _status_frame(client, opts, target)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                if frames == 0:
                    raise
                frame = f"{target.safe_url}: cannot reach Redis ({target.scrub(str(exc))}); retrying\n"
                if opts.json:
                    frame = json.dumps({"url": target.safe_url, "error": target.scrub(str(exc))}) + "\n"
            io.out.write((CLEAR_SCREEN if clear else "") + frame + ("" if clear or opts.json else "\n"))
            io.out.flush()
            frames += 1
            if opts.count is not None and frames >= opts.count:
                return EXIT_OK
            time.sleep(opts.watch)
    except KeyboardInterrupt:
        io.out.write("\n")
        io.out.flush()
        return EXIT_OK


def render_dead_letters(found: Sequence[DeadLetters], now: float | None = None) -> str:
    """The worker queues' dead letters, if any: entries no worker could load (e.g. pushed by hand)."""
    if not found:
        return ""
    now = time.time() if now is None else now
    lines = ["", "DEAD LETTERS: worker queue entries no worker could load, kept for you (LRANGE to read, DEL to drop)"]
    for spider in found:
        lines.append(f"{spider.spider}: {spider.count} in {spider.key}, newest first:")
        rows = [[d.stage, clock_time(d.time, now), d.worker, d.size, d.error[:60], d.excerpt] for d in spider.newest]
        lines += table(["STAGE", "WHEN", "WORKER", "BYTES", "ERROR", "START"], rows, numeric={3}, indent="  ")
    return "\n".join(lines) + "\n"


def _status_frame(client: redis.Redis, opts: argparse.Namespace, target: Target) -> str:
    found, spiders = read_all(client, target.prefix, target.ttl)
    stages, keys = split_keys(found, getattr(opts, "stage_key", None))
    dead = dead_letters(client, target.prefix)
    if opts.json:
        data = snapshot(stages, target.prefix, target.safe_url, spiders, dead, keys=keys)
        return json.dumps(data, indent=None if opts.watch is not None else 2) + "\n"
    text = render_status(stages, target, spiders=spiders, keys=bool(keys))
    return text + render_keys(keys, getattr(opts, "stage_key", None)) + render_dead_letters(dead)


KEY_ROWS = 50  # keys listed at most (busiest first); --stage-key narrows the list


def render_keys(keys: Sequence[StageStatus], pattern: str | None = None) -> str:
    """The locks of keys met at run time, one line each, busiest first (only keys in use have a lock)."""
    if not keys and pattern is None:
        return ""
    matching = f" matching {pattern!r}" if pattern is not None else ""
    lines = ["", f"KEYS (REDISLOCK_STAGE_KEY): {len(keys)} in use{matching}, busiest first"]
    rows = [
        [k.stage[len(KEY_LOCK_PREFIX) :], k.limit, k.held, k.waiters, len(k.processes), k.expired]
        for k in keys[:KEY_ROWS]
    ]
    if rows:
        lines += table(["KEY", "LIMIT", "HELD", "WAITING", "PROCESSES", "EXPIRED"], rows, {1, 2, 3, 4, 5}, "  ")
    if len(keys) > KEY_ROWS:
        lines.append(f"  ... and {len(keys) - KEY_ROWS} more (narrow with --stage-key PATTERN)")
    return "\n".join(lines) + "\n"


def cmd_set_limit(opts: argparse.Namespace, target: Target, io: Streams) -> int:
    stage, limit = _stage_arg(opts.stage), _limit_arg(opts.limit)
    ttl = target.ttl
    if opts.ttl is not None:
        try:
            ttl = check_ttl(opts.ttl, "--ttl")
        except InvalidArgument as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
    client = target.client()
    if stage_status(client, target.prefix, stage) is None and not opts.create:
        known = find_stages(client, target.prefix)
        raise CliError(
            f"unknown stage {stage!r} under prefix {target.prefix!r} at {target.safe_url} (stages there: "
            f"{', '.join(known) if known else 'none'}); pass --create to create it with limit {limit}"
        )
    core = LockCore.create(stage, None, ttl, key_prefix=target.prefix)
    previous = run_operation(client, core.set_limit(limit), stage)
    if previous is None:
        io.say(f"{stage}: created with limit {limit} (ttl {ttl:g}s)")
    else:
        io.say(f"{stage}: limit {previous} -> {limit}, live for every process")
    after = stage_status(client, target.prefix, stage)
    if after is not None and after.held > limit:
        io.say(
            f"{stage}: {after.held} slots are held now; lowering revokes none: new grants wait until fewer "
            f"than {limit} are held"
        )
    if stage in target.stages and target.stages[stage] != limit:
        io.say(
            f"note: this project's REDISLOCK_STAGES says {stage!r}: {target.stages[stage]}; a crawl process "
            "started from now on writes that limit back"
        )
    return EXIT_OK


def _holder_of(status: StageStatus, given: str) -> str:
    """The consumer name HOLDER means: the exact name, else the only one starting with HOLDER + ':'."""
    names = sorted({g.holder for g in status.grants} | {p.holder for p in status.processes})
    if given in names:
        return given
    matches = [
        name
        for name in names
        if name.startswith(given.rstrip(":") + ":")
        or (status.process(name) is not None and f"{status.process(name).host}:{status.process(name).pid}" == given)
    ]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        listed = ", ".join(names) if names else "none"
        raise CliError(f"no holder {given!r} in stage {status.stage!r}; holders there: {listed}")
    raise CliError(f"holder {given!r} is ambiguous in stage {status.stage!r}: {', '.join(matches)}; give the full name")


def _describe(status: StageStatus, holder: str) -> str:
    process = status.process(holder)
    if process is None:
        return holder
    facts = [f"host {process.host}", f"pid {process.pid}"]
    if process.spider:
        facts.append(f"spider {process.spider}")
    return f"{holder} ({', '.join(facts)})"


def _alive_here(status: StageStatus, holder: str) -> bool:
    """True when the holder's process runs on this machine and is alive (so probably not dead at all)."""
    process = status.process(holder)
    if process is None or process.pid is None or process.host != socket.gethostname():
        return False
    try:
        os.kill(process.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cmd_release(opts: argparse.Namespace, target: Target, io: Streams) -> int:
    stage = _stage_arg(opts.stage)
    client = target.client()
    status = _require_stage(client, target, stage)
    holder = _holder_of(status, opts.holder)
    held = sum(1 for g in status.grants if g.holder == holder)
    described = _describe(status, holder)
    if _alive_here(status, holder):
        io.err.write(f"warning: process {status.process(holder).pid} of {holder} is running on this machine\n")  # type: ignore[union-attr]
    _confirm(f"Release {held} slot(s) of stage {stage!r} held by {described}?", opts, io)
    freed = run_operation(client, release_consumer(LockKeys.of(target.prefix, stage), holder), stage)
    io.say(f"{stage}: released {freed} slot(s) of {described}")
    return EXIT_OK


def cmd_reset(opts: argparse.Namespace, target: Target, io: Streams) -> int:
    stage = _stage_arg(opts.stage)
    client = target.client()
    status = _require_stage(client, target, stage)
    holders = len({g.holder for g in status.grants})
    _confirm(
        f"Reset stage {stage!r}: free {status.held} held slot(s) of {holders} holder(s), forget "
        f"{len(status.processes)} registered process(es), keep limit {status.limit}? Live holders lose their slots.",
        opts,
        io,
    )
    try:
        freed, limit = run_operation(client, reset_lock(LockKeys.of(target.prefix, stage)), stage)
    except redis.exceptions.ResponseError as exc:
        if "NOLOCK" in str(exc):
            raise CliError(f"stage {stage!r} vanished from Redis before the reset; nothing was changed") from None
        raise
    io.say(f"{stage}: reset: freed {freed} held slot(s); limit {limit} kept, {limit} fresh slot(s) for the waiters")
    return EXIT_OK


def cmd_dashboard(opts: argparse.Namespace, target: Target, io: Streams) -> int:
    try:
        from scrapy_redislock.cli.dashboard import serve
    except ImportError as exc:
        raise CliError(
            f"the dashboard needs the 'dashboard' extra ({exc}): pip install 'scrapy-redislock[dashboard]'"
        ) from None
    return serve(opts, target, io)


COMMANDS: dict[str, Callable[[argparse.Namespace, Target, Streams], int]] = {
    "status": cmd_status,
    "set-limit": cmd_set_limit,
    "release": cmd_release,
    "reset": cmd_reset,
    "dashboard": cmd_dashboard,
}


# -- entry points --------------------------------------------------------------------------------------------------


def _redis_failure(exc: BaseException, target: Target) -> str:
    cause = exc.__cause__ if isinstance(exc.__cause__, redis.exceptions.RedisError) else exc
    detail = target.scrub(str(cause) or type(cause).__name__)
    where = f"{target.safe_url} ({target.source})"
    if isinstance(cause, redis.exceptions.AuthenticationError) or str(cause).startswith(("WRONGPASS", "NOAUTH")):
        return f"Redis at {where} refused the credentials: {detail}"
    if isinstance(cause, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        hint = ""
        if target.url.startswith("rediss://") and "certificate" in detail.lower():
            hint = " (for a private CA add ?ssl_ca_certs=FILE to the URL)"
        elif target.url.startswith("rediss://") and "refused" not in detail.lower():
            hint = " (rediss:// is TLS: does the server speak TLS on that port?)"
        return f"cannot reach Redis at {where}: {detail}{hint}"
    if isinstance(cause, redis.exceptions.NoPermissionError) or str(cause).startswith("NOPERM"):
        return f"Redis at {where} refused the command (ACL): {detail}"
    return f"Redis error at {where}: {detail}"


def failure(exc: CliError | redis.exceptions.RedisError | OSError, target: Target | None) -> tuple[str, int]:
    """The one line (no password in it) and the exit status that report a failed sub-command."""
    if isinstance(exc, CliError):
        return str(exc), exc.code
    if isinstance(exc, redis.exceptions.RedisError):
        assert target is not None
        return _redis_failure(exc, target), EXIT_ERROR
    message = target.scrub(str(exc)) if target else str(exc)  # e.g. an unreadable ssl_ca_certs file
    return f"cannot use the connection: {message}", EXIT_ERROR


def run(
    opts: argparse.Namespace,
    *,
    settings: Any = None,
    env: Mapping[str, str] | None = None,
    stdin: IO[str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    prog: str = PROG,
) -> int:
    """Run parsed options; failures become one line on stderr and an exit status, never a traceback."""
    io = Streams(stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr)
    target: Target | None = None
    try:
        target = resolve_target(opts, os.environ if env is None else env, settings)
        return COMMANDS[opts.command](opts, target, io)
    except BrokenPipeError:  # the reader of our output left (`status --watch | head`); not an error of ours
        raise
    except (CliError, redis.exceptions.RedisError, OSError) as exc:
        message, code = failure(exc, target)
    except KeyboardInterrupt:
        io.err.write("\n")
        return 130
    io.err.write(f"{prog}: error: {message}\n")
    io.err.flush()
    return code


def main(
    argv: Sequence[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    stdin: IO[str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """``python -m scrapy_redislock``: parse ``argv`` and run; returns the exit status."""
    parser = build_parser()
    with contextlib.redirect_stdout(stdout or sys.stdout), contextlib.redirect_stderr(stderr or sys.stderr):
        try:
            opts = parser.parse_args(argv)
        except SystemExit as exc:  # --help, or a usage error already printed as one line
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    return run(opts, env=env, stdin=stdin, stdout=stdout, stderr=stderr)


__all__ = ["CliError", "add_subcommands", "build_parser", "main", "render_status", "run"]
