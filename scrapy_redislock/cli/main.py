"""The operator's command line: ``python -m scrapy_redislock`` and ``scrapy redislock`` (same
sub-commands).

- ``status [--json] [--watch [SECONDS] [--count N]] [--stage-key PATTERN]``: every stage lock under
  the key prefix; the locks of keys met at run time (REDISLOCK_STAGE_KEY) apart, busiest first,
  those matching PATTERN.
- ``set-limit STAGE N [--create [--ttl SECONDS]]``: change a stage's cap for the whole cluster,
  live.
- ``--group GROUP`` (set-limit, release, reset, forget): the stage's cap group (REDISLOCK_GROUP),
  needed only when several groups have a stage of that name.
- ``release STAGE HOLDER [--yes]``: free the slots of one holder (a worker known to be dead); a
  worker slot's holder also has its worker's in-flight requests put back in their queues.
- ``requeue WORKER [--yes]``: put a dead worker's in-flight requests back in their queues now, and
  unregister it.
- ``reset STAGE [--force] [--yes]``: free every slot of a stage and forget its holders; the limit
  stays; refused while a holder looks alive unless ``--force``.
- ``forget STAGE [--force] [--yes]``: delete a stage nobody uses from Redis (refused, naming who,
  while in use).
- ``load-functions``: an admin's step: the project's scripts as Redis functions, which the
  least-privilege roles run (FCALL) instead of scripts of their own.
- ``dashboard [--host H] [--port P] [--allowed-host NAME] [--allow-control]``: a live web page and ``/metrics`` (see
  :mod:`scrapy_redislock.cli.dashboard`).

Blocking code with the sync redis client: it never runs on a reactor. Reads (``python -m``) the
environment variables REDISLOCK_URL, REDIS_URL and REDISLOCK_KEY_PREFIX; as a Scrapy command, the
project's settings through
:func:`scrapy_redislock.crawl.settings.read_settings` (REDISLOCK_URL and scrapy-redis's REDIS_*
fallbacks, REDISLOCK_PARAMS, REDISLOCK_KEY_PREFIX, REDISLOCK_TTL, REDISLOCK_STAGES), with those
environment variables used only where the project sets no connection or prefix. ``--url`` and
``--prefix`` win over both. Every state change is a Lua script (set_limit, release_owner, reset,
queue_requeue, retire). Passwords are never printed. Exit status: 0 done, 1 failed or refused (Redis
unreachable, unknown stage or holder, not confirmed), 2 bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from scrapy_redislock.cli.commands import COMMANDS, DEFAULT_WATCH
from scrapy_redislock.cli.render import Streams
from scrapy_redislock.cli.target import (
    DEFAULT_URL,
    EXIT_USAGE,
    REDIS_ERRORS,
    CliError,
    Target,
    failure,
    resolve_target,
)
from scrapy_redislock.crawl import defaults

PROG = "redislock"


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (argparse would print the whole usage first)."""

    def error(self, message: str) -> Any:  # argparse's signature says NoReturn
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


# -- arguments -------------------------------------------------------------------------------------


def _seconds(option: str) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds > 0, refused with a message naming
    ``option``."""

    def check(value: str) -> float:
        try:
            seconds = float(value)
        except ValueError:
            seconds = float("nan")
        if not seconds > 0 or seconds == float("inf"):
            raise argparse.ArgumentTypeError(
                f"{option} takes a number of seconds > 0, got {value!r}"
            )
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


def add_subcommands(
    parser: argparse.ArgumentParser, *, top_level: bool = True, prog: str = PROG
) -> None:
    """The sub-commands and their options, on our own parser or on Scrapy's (``top_level=False``).

    ``--url`` and ``--prefix`` go on every sub-command (Scrapy's command line only allows options
    after the sub-command) and, with ``top_level``, also before it; sub-command defaults are
    suppressed so that they do not overwrite what was given before the sub-command.
    """
    # Of the sub-parsers' class (typeshed wants the parents so), though only its arguments are
    # copied from it.
    common = OneLineParser(add_help=False)
    connection = common.add_argument_group("connection")
    connection.add_argument(
        "--url",
        default=argparse.SUPPRESS,
        help=f"Redis URL (redis://, rediss:// for TLS, user:password@ for ACL; ?ssl_ca_certs=FILE for a private CA; redis+sentinel://h1:26379,h2:26379/SERVICE[/DB] for Sentinel, redis+cluster://h1:7000,h2:7001 for a Cluster). Default: REDISLOCK_URL, else REDIS_URL (environment, or the project's settings as a Scrapy command), else {DEFAULT_URL}",  # noqa: E501
    )
    connection.add_argument(
        "--prefix",
        default=argparse.SUPPRESS,
        help=f"key prefix of the locks (default: REDISLOCK_KEY_PREFIX, else {defaults.SETTINGS['REDISLOCK_KEY_PREFIX']!r})",  # noqa: E501
    )
    if top_level:
        parser.add_argument("--url", default=None, help=argparse.SUPPRESS)
        parser.add_argument("--prefix", default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=OneLineParser, prog=prog
    )
    sub.required = True

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=summary, description=description)

    def stage_command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        """A sub-command on one STAGE, which ``--group`` tells apart when several groups have it."""
        stage = command(name, summary, description)
        stage.add_argument("stage", metavar="STAGE")
        stage.add_argument(
            "--group",
            metavar="GROUP",
            help="the stage's cap group (REDISLOCK_GROUP; by default each spider's name), needed when several groups have a stage of that name; '' for the keys of no group (0.x)",  # noqa: E501
        )
        return stage

    status = command(
        "status",
        "show every stage: limit, holders, waiters, fence counter",
        "Show every stage lock under the key prefix: limit, holders (host, pid, spider, age, lease left), waiters (as each process last reported), fence counter, free slots and debt.",  # noqa: E501
    )
    status.add_argument(
        "--json", action="store_true", help="print JSON (one document per refresh with --watch)"
    )
    status.add_argument(
        "--watch",
        nargs="?",
        type=_seconds("--watch"),
        const=DEFAULT_WATCH,
        default=None,
        metavar="SECONDS",
        help=f"refresh every SECONDS (default {DEFAULT_WATCH:g}) until Ctrl-C",
    )
    status.add_argument(
        "--count", type=_count, metavar="N", help="with --watch: stop after N refreshes"
    )
    status.add_argument(
        "--stage-key",
        metavar="PATTERN",
        help="show only the keys (REDISLOCK_STAGE_KEY: domains, ...) matching this glob, e.g. '*.example.com'",
    )

    set_limit = stage_command(
        "set-limit",
        "change a stage's cap for the whole cluster, live",
        "Change a stage's cap for every process at once, while they run (the limit lives in Redis). Lowering revokes nothing: held slots stay until released, and no new slot is granted until fewer than N are held; on a worker stage (workers:<stage>) the newest workers over the limit leave it at their next renewal. A process that starts later writes its own REDISLOCK_STAGES limit again.",  # noqa: E501
    )
    set_limit.add_argument(
        "limit",
        metavar="N",
        nargs="?",
        help="the new limit, an integer >= 0 (0 pauses the stage); on an adaptive stage or key (REDISLOCK_ADAPTIVE) it pins the limit while the controller lives",  # noqa: E501
    )
    set_limit.add_argument(
        "--adaptive",
        action="store_true",
        help="instead of N: lift the pin of an adaptive stage or key, its controller moves the limit again",
    )
    set_limit.add_argument(
        "--create",
        action="store_true",
        help="create the stage if it does not exist (else that is an error)",
    )
    set_limit.add_argument("--ttl", type=float, help="lease seconds for --create")

    release = stage_command(
        "release",
        "free the slots of one holder (a worker known to be dead)",
        "Free every slot HOLDER holds in STAGE and forget it. HOLDER is a name from `status` (or host:pid, or any prefix of the name ending at a colon, if only one holder matches). A live holder finds its slots lost at its next renewal. For a worker slot (workers:<stage>), the worker of that process also has its in-flight requests put back in their queues (as `requeue` does).",  # noqa: E501
    )
    release.add_argument("holder", metavar="HOLDER")
    release.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")

    requeue = command(
        "requeue",
        "put a dead worker's in-flight requests back in their queues now",
        "Put every request WORKER (a StageWorkerMixin worker, as `status` lists it: its id, or host:pid) had taken and not finished back at the front of its stage's queue, and unregister the worker. The live workers do it themselves once its beat deadline has passed (seconds while it had work); this does it now. A worker that is alive after all drops what it had taken ahead at its next beat; what it has in progress is fetched twice.",  # noqa: E501
    )
    requeue.add_argument("worker", metavar="WORKER")
    requeue.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")

    reset = stage_command(
        "reset",
        "free every slot of a stage and forget its holders (the limit stays)",
        "Free every held slot of STAGE, forget every registered process, drop pending debt, and start again with LIMIT free slots. Fencing tokens keep increasing. Refused while a holder looks alive (its process runs on this machine, or, on another, a slot of it has lease left), as `release` judges it: live holders find their slots lost only at their next renewal, and until their requests end the site sees more requests in flight than the cap. --force resets anyway.",  # noqa: E501
    )
    reset.add_argument(
        "--force",
        action="store_true",
        help="reset although holders look alive (the site may then see more requests in flight than the cap until theirs end)",  # noqa: E501
    )
    reset.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")

    forget = stage_command(
        "forget",
        "delete a stage nobody uses from Redis (its limit, slots and fence counter)",
        "Delete every key of STAGE (also workers:STAGE, key:KEY) from Redis, in one script, when nobody uses it: no slot held (a dead holder's too, until it is reaped) and no process seen within 3 leases. Otherwise refused, naming who. --force frees every slot and forgets every process first (as `reset` does); a process that registers again meanwhile still makes it refuse.",  # noqa: E501
    )
    forget.add_argument(
        "--force", action="store_true", help="free and forget the stage's holders first"
    )
    forget.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")

    command(
        "load-functions",
        "load the project's scripts into Redis as functions (an admin's step, once per version)",
        "FUNCTION LOAD the project's Lua scripts as one library of Redis 7 functions, which Redis keeps in RDB and AOF and replicates. The least-privilege crawler and operator roles (python -m scrapy_redislock.cli.acl) may run only these (FCALL), no script of their own; run it with an admin's URL, on every primary of a cluster, after each upgrade.",  # noqa: E501
    )

    dashboard = command(
        "dashboard",
        "serve a live web page of every stage and worker, and Prometheus metrics at /metrics",
        "Serve one web page that shows every stage and worker live (server-sent events), and Prometheus metrics at /metrics. Read-only unless --allow-control. Needs the 'dashboard' extra (pip install 'scrapy-redislock[dashboard]').",  # noqa: E501
    )
    dashboard.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only)",
    )
    dashboard.add_argument(
        "--port", type=_port, default=8030, help="port to listen on (default 8030; 0: any free)"
    )
    dashboard.add_argument(
        "--interval",
        type=_seconds("--interval"),
        default=DEFAULT_WATCH,
        metavar="SECONDS",
        help=f"read Redis every SECONDS (default {DEFAULT_WATCH:g})",
    )
    dashboard.add_argument(
        "--history",
        type=_seconds("--history"),
        default=600.0,
        metavar="SECONDS",
        help="seconds the charts span (600)",
    )
    dashboard.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name the page may be reached by (the Host header; repeatable), e.g. behind a reverse proxy; by default only the address it listens on ('*': any, no check)",  # noqa: E501
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


# -- entry points ----------------------------------------------------------------------------------


def cmd_dashboard(opts: argparse.Namespace, target: Target, io: Streams) -> int:
    """The dashboard, which runs the other commands' controls: above them, imported only here (an
    optional extra)."""
    try:
        from scrapy_redislock.cli.dashboard import serve
    except ImportError as exc:
        raise CliError(
            f"the dashboard needs the 'dashboard' extra ({exc}): pip install 'scrapy-redislock[dashboard]'"
        ) from None
    return asyncio.run(serve(opts, target, io))


RUN = {**COMMANDS, "dashboard": cmd_dashboard}


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
    """Run parsed options; failures become one line on stderr and an exit status, never a
    traceback."""
    io = Streams(stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr)
    target: Target | None = None
    try:
        target = resolve_target(opts, os.environ if env is None else env, settings)
        return RUN[opts.command](opts, target, io)
    # the reader of our output left (`status --watch | head`); not an error of ours
    except BrokenPipeError:
        raise
    except (CliError, *REDIS_ERRORS, OSError) as exc:
        message, code = failure(exc, target)
    except KeyboardInterrupt:
        io.err.write("\n")
        return 130
    finally:
        if target is not None:
            target.close()  # the command's connections (the process may go on: tests, `scrapy redislock`)
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
    with (
        contextlib.redirect_stdout(stdout or sys.stdout),
        contextlib.redirect_stderr(stderr or sys.stderr),
    ):
        try:
            opts = parser.parse_args(argv)
        except SystemExit as exc:  # --help, or a usage error already printed as one line
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    return run(opts, env=env, stdin=stdin, stdout=stdout, stderr=stderr)


__all__ = ["add_subcommands", "build_parser", "main", "run"]
