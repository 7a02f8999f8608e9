"""The sub-commands ``status``, ``set-limit``, ``release``, ``reset``, ``requeue``, ``forget`` and
``load-functions`` (``dashboard``, which runs them from its page, is :mod:`.main`'s): each takes parsed
options, a target and streams, and returns an exit status. Every state change is a Lua script
(set_limit, release_owner, reset, queue_requeue, retire)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import redis
import redis.exceptions

from scrapy_redislock._redis import (
    FUNCTION_PREFIX,
    MAX_LIMIT,
    RedisClient,
    check_limit,
    check_name,
    check_ttl,
    function_library,
    printable,
    text,
)
from scrapy_redislock.cli.render import Streams, render_dead_letters, render_keys, render_status
from scrapy_redislock.cli.status import read_all, snapshot, split_keys
from scrapy_redislock.cli.target import EXIT_OK, EXIT_USAGE, CliError, Target, run_operation
from scrapy_redislock.crawl.epoch import crawl_scripts
from scrapy_redislock.errors import InvalidArgument
from scrapy_redislock.lock.adaptive import unpin
from scrapy_redislock.lock.core import (
    NO_VALID_LIMIT,
    LockCore,
    forget_lock,
    lock_scripts,
    release_consumer,
    reset_lock,
)
from scrapy_redislock.lock.permit import LockKeys, group_prefix, owner_of
from scrapy_redislock.lock.status import (
    KEY_LOCK_PREFIX,
    Process,
    StageStatus,
    find_stages,
    stage_status,
)
from scrapy_redislock.workers.queue import QueueKeys, requeue_now, worker_scripts
from scrapy_redislock.workers.status import (
    WORKER_LOCK_PREFIX,
    SpiderStatus,
    WorkerStatus,
    dead_letters,
)

DEFAULT_WATCH = 2.0
CLEAR_SCREEN = "\x1b[H\x1b[2J"


def _stage_arg(value: str) -> str:
    try:
        return check_name(value, "STAGE")
    except InvalidArgument as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def _limit_arg(value: str) -> int:
    try:
        if len(value) > 20:  # int() of a huge string takes a while
            raise ValueError(value)
        return check_limit(int(value, 10), "N")
    except (ValueError, InvalidArgument):
        shown = value[:40] + ("..." if len(value) > 40 else "")
        raise CliError(
            f"N must be an integer from 0 to {MAX_LIMIT}, got {shown!r}", EXIT_USAGE
        ) from None


def _is_key(stage: str) -> bool:
    """A lock of a key met at run time (``key:<key>``): it may be on its light path
    (:mod:`scrapy_redislock.lock.light`), which the operator's scripts then cover too."""
    return stage.startswith(KEY_LOCK_PREFIX)


def _named(places: list[tuple[str, str]]) -> str:
    """``detail (group shop), list``: locks as an operator reads them."""
    return ", ".join(f"{name} (group {group})" if group else name for group, name in places)


def _group_arg(opts: argparse.Namespace) -> str | None:
    group = getattr(opts, "group", None)
    if group and ("{" in group or "}" in group):
        raise CliError(f"--group must be a name without braces, got {group!r}", EXIT_USAGE)
    return group


def _group_of(client: RedisClient, target: Target, stage: str, group: str | None) -> str | None:
    """The cap group STAGE is in: ``--group`` when given, else the only group under the prefix that
    has a lock of that name (None: none has); CliError naming the groups when several have."""
    if group is not None:
        return group
    found = find_stages(client, target.prefix)
    groups = [g for g, name in found if name == stage]
    if len(groups) > 1:
        listed = ", ".join(repr(g) for g in groups)
        raise CliError(
            f"stage {stage!r} is in {len(groups)} groups under prefix {target.prefix!r}: {listed}; name one with --group GROUP ('' for the keys of no group)"  # noqa: E501
        )
    return groups[0] if groups else None


def _unknown(client: RedisClient, target: Target, stage: str, group: str | None) -> str:
    known = find_stages(client, target.prefix)
    where = "" if group is None else f" in group {group!r}"
    return f"unknown stage {stage!r}{where} under prefix {target.prefix!r} at {target.safe_url}; stages there: {_named(known) if known else 'none'}"  # noqa: E501


def _require_stage(
    client: RedisClient, target: Target, stage: str, group: str | None
) -> StageStatus:
    """The stage's status, in ``group`` or the only group that has it; CliError otherwise."""
    group = _group_of(client, target, stage, group)
    found = None if group is None else stage_status(client, target.prefix, stage, group)
    if found is None:
        raise CliError(_unknown(client, target, stage, group))
    return found


def _keys(target: Target, status: StageStatus) -> LockKeys:
    """The Redis keys of a stage found under the target's prefix, in its group."""
    return LockKeys.of(group_prefix(target.prefix, status.group), status.stage)


def _held_elsewhere(client: RedisClient, target: Target, status: StageStatus) -> str:
    """When a command freed nothing: the other locks of the same stage name that hold slots (the
    worker slots ``workers:<stage>`` beside a request stage, the same stage of another cap group),
    which ``status`` showed held and the operator may have meant; "" when there are none."""
    base = status.stage.removeprefix(WORKER_LOCK_PREFIX)
    others = []
    for group, name in find_stages(client, target.prefix):
        same_name = name.removeprefix(WORKER_LOCK_PREFIX) == base
        if not same_name or (group, name) == (status.group, status.stage):
            continue
        other = stage_status(client, target.prefix, name, group)
        if other is not None and other.held:
            others.append(f"{other.label!r} has {other.held} held")
    if not others:
        return ""
    return f"; note: {', '.join(others)} (a lock of its own: name it to act on it)"


def _confirm(question: str, opts: argparse.Namespace, io: Streams) -> None:
    if opts.yes:
        return
    if not io.stdin.isatty():
        raise CliError(
            f"{opts.command}: not confirmed: standard input is not a terminal; pass --yes to confirm"
        )
    io.err.write(printable(f"{question} [y/N] "))
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
    with _until_interrupted() as interrupted:
        while not interrupted.is_set():
            try:
                frame = _status_frame(client, opts, target)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                if frames == 0:
                    raise
                error = target.scrub(str(exc))
                frame = f"{target.safe_url}: cannot reach Redis ({error}); retrying\n"
                if opts.json:
                    frame = json.dumps({"url": target.safe_url, "error": error}) + "\n"
            io.out.write(
                (CLEAR_SCREEN if clear else "") + frame + ("" if clear or opts.json else "\n")
            )
            io.out.flush()
            frames += 1
            if opts.count is not None and frames >= opts.count:
                return EXIT_OK
            interrupted.wait(opts.watch)
    io.out.write("\n")
    io.out.flush()
    return EXIT_OK


@contextlib.contextmanager
def _until_interrupted() -> Iterator[threading.Event]:
    """An event that Ctrl-C (SIGINT) sets, instead of raising KeyboardInterrupt: an exception raised
    wherever the signal lands can be swallowed (in a ``__del__`` of a redis-py connection, say) and
    the watch would go on."""
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield interrupted  # signals reach the main thread only; Ctrl-C there raises KeyboardInterrupt as usual
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.set())
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def _status_frame(client: RedisClient, opts: argparse.Namespace, target: Target) -> str:
    found, spiders = read_all(client, target.prefix, target.ttl)
    stages, keys = split_keys(found, getattr(opts, "stage_key", None))
    dead = dead_letters(client, target.prefix)
    if opts.json:
        data = snapshot(stages, target.prefix, target.safe_url, spiders, dead, keys=keys)
        return json.dumps(data, indent=None if opts.watch is not None else 2) + "\n"
    text = render_status(stages, target, spiders=spiders, keys=bool(keys))
    return text + render_keys(keys, getattr(opts, "stage_key", None)) + render_dead_letters(dead)


def cmd_set_limit(opts: argparse.Namespace, target: Target, io: Streams) -> int:
    stage = _stage_arg(opts.stage)
    if opts.adaptive:
        if opts.limit is not None:
            raise CliError("set-limit: give N or --adaptive, not both", EXIT_USAGE)
        return _lift_pin(stage, _group_arg(opts), target, io)
    if opts.limit is None:
        raise CliError("set-limit: N is missing (or --adaptive to lift a pin)", EXIT_USAGE)
    limit = _limit_arg(opts.limit)
    ttl = target.ttl
    if opts.ttl is not None:
        try:
            ttl = check_ttl(opts.ttl, "--ttl")
        except InvalidArgument as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
    client = target.client()
    group = _group_of(client, target, stage, _group_arg(opts))
    before = None if group is None else stage_status(client, target.prefix, stage, group)
    if before is None and not opts.create:
        raise CliError(
            f"{_unknown(client, target, stage, group)}; pass --create to create it with limit {limit} (--group GROUP: in that group)"  # noqa: E501
        )
    group = group or ""
    where = f" (group {group})" if group else ""
    prefix = group_prefix(target.prefix, group)
    core = LockCore.create(stage, None, ttl, key_prefix=prefix, light=_is_key(stage))
    previous = run_operation(client, core.set_limit(limit, pin=True), stage)
    if previous is None and before is not None and before.error:
        io.say(
            f"{stage}{where}: limit (not a valid one in Redis) -> {limit}, live for every process"
        )
    elif previous is None:
        io.say(f"{stage}{where}: created with limit {limit} (ttl {ttl:g}s)")
    else:
        io.say(f"{stage}{where}: limit {previous} -> {limit}, live for every process")
    _set_limit_notes(stage, group, limit, client, target, io)
    return EXIT_OK


def _lift_pin(stage: str, group: str | None, target: Target, io: Streams) -> int:
    """set-limit --adaptive: the stage's adaptive controller moves its limit again."""
    status = _require_stage(target.client(), target, stage, group)
    lifted = run_operation(target.client(), unpin(_keys(target, status)), stage)
    io.say(
        f"{status.label}: its adaptive controller moves the limit again (from the pinned one)"
        if lifted
        else f"{status.label}: no pin to lift (no adaptive controller, or not pinned)"
    )
    return EXIT_OK


def _set_limit_notes(
    stage: str, group: str, limit: int, client: Any, target: Target, io: Streams
) -> None:
    """What a new limit means now: a pinned controller, holders above it, a project setting that
    a new process writes back."""
    if client.exists(LockKeys.of(group_prefix(target.prefix, group), stage).adapt):
        io.say(
            f"{stage}: its adaptive controller is pinned to {limit} (`set-limit {stage} --adaptive` lets it move the limit again)"  # noqa: E501
        )
    after = stage_status(client, target.prefix, stage, group)
    if after is not None and after.held > limit and stage.startswith(WORKER_LOCK_PREFIX):
        io.say(
            f"{stage}: {after.held} slots are held now; the {after.held - limit} newest holder(s) leave the stage at their next renewal (within ttl/3, at most a second): they give back what they took ahead, finish what is in progress and free their slot"  # noqa: E501
        )
    elif after is not None and after.held > limit:
        io.say(
            f"{stage}: {after.held} slots are held now; lowering revokes none: new grants wait until fewer than {limit} are held"  # noqa: E501
        )
    if stage in target.stages and target.stages[stage] != limit:
        io.say(
            f"note: this project's REDISLOCK_STAGES says {stage!r}: {target.stages[stage]}; a crawl process started from now on writes that limit back"  # noqa: E501
        )


def _holder_of(status: StageStatus, given: str) -> str:
    """The owner (a process's lock object) HOLDER means: its exact name, or one of its consumers'
    (``<owner>#<n>``, as status lists a grant made to a wait: a renewal moves the grant to the owner
    since, so releasing that consumer alone freed 0), else the only owner starting with HOLDER +
    ':', or of that host:pid."""
    names = sorted({g.owner for g in status.grants} | {p.holder for p in status.processes})
    if owner_of(given) in names:
        return owner_of(given)
    matches = [
        name
        for name in names
        if name.startswith(given.rstrip(":") + ":") or _host_pid(status, name) == given
    ]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        listed = ", ".join(names) if names else "none"
        raise CliError(f"no holder {given!r} in stage {status.stage!r}; holders there: {listed}")
    raise CliError(
        f"holder {given!r} is ambiguous in stage {status.stage!r}: {', '.join(matches)}; give the full name"
    )


def _host_pid(status: StageStatus, holder: str) -> str | None:
    """``host:pid`` of the holder's process, None when it registered none."""
    process = status.process(holder)
    return None if process is None else f"{process.host}:{process.pid}"


def _describe(status: StageStatus, holder: str) -> str:
    process = status.process(holder)
    if process is None:
        return holder
    facts = [f"host {process.host}", f"pid {process.pid}"]
    if process.spider:
        facts.append(f"spider {process.spider}")
    return f"{holder} ({', '.join(facts)})"


def _alive_here(process: Process) -> bool | None:
    """Whether the process runs on this machine and is alive; None when it is not of this machine
    (or named no pid)."""
    if process.pid is None or process.host != socket.gethostname():
        return None
    try:
        os.kill(process.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _liveness(status: StageStatus, holder: str) -> str | None:
    """Why the holder may be alive (``release`` warns, ``reset`` refuses), None when it looks dead:
    a process of this machine is alive or not; one of another machine (or unknown) is alive as far
    as Redis can tell while a slot of it has lease left (it renewed within its lease)."""
    process = status.process(holder)
    here = None if process is None else _alive_here(process)
    if process is not None and here is not None:
        return f"process {process.pid} of {holder} is running on this machine" if here else None
    owner = owner_of(holder)
    leased = [g for g in status.grants if g.owner == owner and not g.expired]
    if not leased:
        return None
    newest = min(leased, key=lambda g: g.age)
    host = f" on host {process.host}" if process is not None and process.host else ""
    return f"{owner}{host} renewed a slot {newest.age:.1f}s ago ({newest.lease_left:.0f}s of lease left)"


def cmd_release(opts: argparse.Namespace, target: Target, io: Streams) -> int:
    stage = _stage_arg(opts.stage)
    client = target.client()
    status = _require_stage(client, target, stage, _group_arg(opts))
    holder = _holder_of(status, opts.holder)
    held = sum(1 for g in status.grants if g.owner == holder)
    described = _describe(status, holder)
    alive = _liveness(status, holder)
    if alive:
        io.warn(f"warning: {alive}")
    _confirm(f"Release {held} slot(s) of stage {status.label!r} held by {described}?", opts, io)
    keys = _keys(target, status)
    freed = run_operation(client, release_consumer(keys, holder, _is_key(stage)), stage)
    gone = (
        f" (Redis had none of its {held} when the release ran: released or reaped meanwhile)"
        if held and not freed
        else ""
    )
    elsewhere = "" if freed else _held_elsewhere(client, target, status)
    io.say(f"{status.label}: released {freed} slot(s) of {described}{gone}{elsewhere}")
    if stage.startswith(WORKER_LOCK_PREFIX):
        _requeue_workers_of(client, target, status, holder, io)
    return EXIT_OK


def _requeue_workers_of(
    client: RedisClient, target: Target, status: StageStatus, holder: str, io: Streams
) -> None:
    """A released worker slot's process (same host, pid and spider) is a worker known to be dead:
    its in-flight requests go back to the front of their queues now, not when the others notice it
    stopped beating."""
    process = status.process(holder)
    if process is None or process.host is None or process.pid is None or not process.spider:
        return
    _, spiders = read_all(client, target.prefix, target.ttl)
    its = (process.spider, process.host, process.pid)
    for spider in spiders:
        for worker in spider.workers:
            if (spider.spider, worker.host, worker.pid) == its:
                _requeue(client, target, spider, worker, io)


def _requeue(
    client: RedisClient, target: Target, spider: SpiderStatus, worker: WorkerStatus, io: Streams
) -> None:
    moved, left = requeue_now(client, QueueKeys.of(target.prefix, spider.spider), worker.worker)
    io.say(
        f"{spider.spider}: requeued {moved} in-flight request(s) of worker {worker.worker} (stage {worker.stage or '-'}) at the front of their queues; it is unregistered"  # noqa: E501
    )
    if left:
        io.say(
            f"{spider.spider}: {left} request(s) of stages this command does not know stay in its record"
        )


def _worker_of(
    spiders: list[SpiderStatus], given: str, prefix: str
) -> tuple[SpiderStatus, WorkerStatus]:
    """The worker WORKER means: its exact id, else the only one whose id starts with WORKER + ':'
    (host:pid)."""
    found = [(spider, worker) for spider in spiders for worker in spider.workers]
    exact = [(spider, worker) for spider, worker in found if worker.worker == given]
    matches = exact or [(s, w) for s, w in found if w.worker.startswith(given.rstrip(":") + ":")]
    if len(matches) == 1:
        return matches[0]
    names = ", ".join(f"{w.worker} ({s.spider})" for s, w in (matches or found)) or "none"
    if not matches:
        raise CliError(f"no worker {given!r} under prefix {prefix!r}; workers there: {names}")
    raise CliError(f"worker {given!r} is ambiguous: {names}; give the full id")


def cmd_requeue(opts: argparse.Namespace, target: Target, io: Streams) -> int:
    """Put a dead worker's in-flight requests back in their queues now (the live workers would at
    their next beat, once its deadline has passed), and unregister it."""
    client = target.client()
    _, spiders = read_all(client, target.prefix, target.ttl)
    spider, worker = _worker_of(spiders, opts.worker, target.prefix)
    if worker.alive:
        left = (
            "" if worker.deadline_in is None else f", {worker.deadline_in:.1f}s before its deadline"
        )
        io.warn(
            f"warning: worker {worker.worker} beat {worker.silence:.1f}s ago{left}: if it is alive, the requests it has in progress are fetched twice"  # noqa: E501
        )
    question = f"Requeue the {worker.in_flight} in-flight request(s) of worker {worker.worker} (spider {spider.spider}, stage {worker.stage or '-'}) and unregister it?"  # noqa: E501
    _confirm(question, opts, io)
    _requeue(client, target, spider, worker, io)
    return EXIT_OK


def cmd_reset(opts: argparse.Namespace, target: Target, io: Streams) -> int:
    """Free every slot of a stage and forget its holders; refused while a holder looks alive
    (:func:`_liveness`, as ``release`` judges it) unless ``--force``, which says what the site may
    see."""
    stage = _stage_arg(opts.stage)
    client = target.client()
    status = _require_stage(client, target, stage, _group_arg(opts))
    holders = sorted({g.owner for g in status.grants})
    live = [why for owner in holders if (why := _liveness(status, owner))]
    if live:
        cap = "its cap" if status.limit is None else f"the cap of {status.limit}"
        overrun = f"until their requests end, the site may see up to {status.held} request(s) in flight beyond {cap} (their slots are free to others at once)"  # noqa: E501
        if not opts.force:
            raise CliError(
                f"stage {status.label!r} has live holders, nothing was changed: {'; '.join(live)}; {overrun}; pass --force to reset anyway, or `release` a holder known to be dead"  # noqa: E501
            )
        io.warn(f"warning: resetting live holders ({'; '.join(live)}): {overrun}")
    question = f"Reset stage {status.label!r}: free {status.held} held slot(s) of {len(holders)} holder(s), forget {len(status.processes)} registered process(es), keep limit {status.limit}? Live holders lose their slots."  # noqa: E501
    if status.error:
        question = f"Reset stage {status.label!r}, whose state in Redis is unreadable ({status.error}): free every held slot and forget every registered process? Live holders lose their slots."  # noqa: E501
    _confirm(question, opts, io)
    keys = _keys(target, status)
    try:
        freed, limit = run_operation(client, reset_lock(keys, _is_key(stage)), stage)
    except redis.exceptions.ResponseError as exc:
        if "NOLOCK" in str(exc):
            raise CliError(
                f"stage {status.label!r} vanished from Redis before the reset; nothing was changed"
            ) from None
        raise
    name = status.label
    elsewhere = "" if freed else _held_elsewhere(client, target, status)
    # limit None: a key on its light path, where nobody waits and each process keeps its own limit
    if elsewhere or limit is None:
        io.say(f"{name}: reset: freed {freed} held slot(s){elsewhere}")
    elif limit == NO_VALID_LIMIT:
        io.say(
            f"{name}: reset: freed {freed} held slot(s); its limit in Redis is not a valid limit, so no slot is free: `set-limit {stage} N` repairs it"  # noqa: E501
        )
    else:
        io.say(
            f"{name}: reset: freed {freed} held slot(s); limit {limit} kept, {limit} fresh slot(s) for the waiters"
        )
    return EXIT_OK


FORGET_LEASES = 3  # an owner seen within this many leases still uses a stage (retire.lua's rule)


def _users(client: RedisClient, target: Target, status: StageStatus) -> list[str]:
    """Who uses the stage, as ``forget`` (``retire.lua``) judges it: held grants (a dead holder's
    too, until reaped) and registered owners seen within FORGET_LEASES leases; one phrase each, e.g.
    ``2 slot(s) held by vm pid 7``."""
    keys = _keys(target, status)
    lease_ms = round((status.ttl or target.ttl) * 1000)
    held: dict[str, list[float]] = {}
    for grant in status.grants:
        held.setdefault(grant.holder, []).append(grant.lease_left)
    used = [_holding(status, owner, lefts) for owner, lefts in sorted(held.items())]
    reply = client.time()
    if not isinstance(reply, list | tuple):
        return used
    now_ms = reply[0] * 1000 + reply[1] // 1000
    # withscores: (member, score) pairs (redis-py's return type is a union that also has plain
    # members)
    seen = cast(list[Sequence[Any]], client.zrange(keys.seen, 0, -1, withscores=True))
    for owner, score in seen:
        name = str(owner)
        ago = (now_ms - score) / 1000
        if name not in held and ago <= FORGET_LEASES * lease_ms / 1000:
            used.append(f"registered {_describe(status, name)}, seen {ago:.1f}s ago")
    return used


def _holding(status: StageStatus, owner: str, lefts: list[float]) -> str:
    """``2 slot(s) held by vm pid 7 (lease left 12s)``: what one owner holds, for ``forget``."""
    left = min(lefts)
    lease = f"lease left {left:.0f}s" if left >= 0 else "lease expired, not reaped yet"
    return f"{len(lefts)} slot(s) held by {_describe(status, owner)} ({lease})"


def cmd_forget(opts: argparse.Namespace, target: Target, io: Streams) -> int:
    """Delete a stage nobody uses from Redis, in one script (``retire.lua``, through
    ``LockCore.retire``): refused while any grant is held or any owner was seen within 3 leases,
    naming them. ``--force`` first frees every grant and forgets every owner (``reset.lua``), then
    deletes; a process that registers again in between (a live one renewing, a waiter taking a fresh
    slot) makes it refuse all the same."""
    stage = _stage_arg(opts.stage)
    client = target.client()
    status = _require_stage(client, target, stage, _group_arg(opts))
    users = _users(client, target, status)
    if users and not opts.force:
        raise CliError(
            f"stage {stage!r} is in use, nothing was deleted: {'; '.join(users)}; pass --force to free and forget them first (a live process among them recreates the stage at its next renewal)"  # noqa: E501
        )
    freeing = f", freeing what they hold ({'; '.join(users)})" if users else ""
    _confirm(f"Delete stage {status.label!r} (limit {status.limit}) from Redis{freeing}?", opts, io)
    keys = _keys(target, status)
    freed = 0
    if opts.force and (status.error or (status.exists and (status.grants or status.processes))):
        try:
            freed, _ = run_operation(client, reset_lock(keys, _is_key(stage)), stage)
        except redis.exceptions.ResponseError as exc:
            if "NOLOCK" not in str(exc):  # gone meanwhile: the retire below deletes what is left
                raise
    deleted = run_operation(client, forget_lock(keys, _is_key(stage)), stage)
    if not deleted:
        after = stage_status(client, target.prefix, stage, status.group)
        now_used = _users(client, target, after) if after is not None else []
        why = "; ".join(now_used) or (
            "Redis restarted since the stage was last written: its slots are reserved for one lease, for holders that survived to re-adopt them; try again after the lease"  # noqa: E501
        )
        raise CliError(f"stage {stage!r} was not deleted, it is in use: {why}")
    limit = "" if status.limit is None else f" (limit {status.limit})"
    extra = f"; freed {freed} held slot(s) first" if freed else ""
    io.say(f"{status.label}: forgotten: its keys are deleted from Redis{limit}{extra}")
    return EXIT_OK


def project_library() -> tuple[str, str, int]:
    """(library name, FUNCTION LOAD text, number of functions) of every script of the project."""
    sources = {
        *lock_scripts().values(),
        *worker_scripts().values(),
        *crawl_scripts().values(),
    }
    library, code = function_library(sources)
    return library, code, len(sources)


def cmd_load_functions(opts: argparse.Namespace, target: Target, io: Streams) -> int:
    """FUNCTION LOAD REPLACE the project's scripts as one library (every primary of a cluster),
    and name the libraries of other versions still loaded."""
    library, code, count = project_library()
    client = target.client()
    cluster = isinstance(client, redis.RedisCluster)
    route = {"target_nodes": redis.RedisCluster.PRIMARIES} if cluster else {}
    try:
        client.execute_command("FUNCTION", "LOAD", "REPLACE", code, **route)
    except redis.exceptions.ResponseError as exc:
        if "unknown command" in str(exc):
            raise CliError(
                f"Redis at {target.safe_url} has no functions (Redis 7.0 or later has): its clients run the scripts with EVALSHA, and the least-privilege roles need 7.0"  # noqa: E501
            ) from None
        raise
    io.say(
        f"loaded {library}: {count} functions at {target.safe_url}; the crawler and operator roles run these (FCALL)"
    )
    listed = client.execute_command("FUNCTION", "LIST", "LIBRARYNAME", FUNCTION_PREFIX)
    others = sorted(_library_names(listed) - {library})
    if others:
        io.say(
            f"also loaded, of other versions: {', '.join(others)} (`FUNCTION DELETE <name>` once no process of that version runs)"  # noqa: E501
        )
    return EXIT_OK


def _library_names(listed: Any) -> set[str]:
    """The library names of a FUNCTION LIST reply (flat lists, or dicts in RESP3)."""
    names = set()
    for entry in listed or []:
        if isinstance(entry, dict):
            entry = [part for pair in entry.items() for part in pair]
        fields = [text(part) for part in entry] if isinstance(entry, list) else []
        if "library_name" in fields[:-1]:
            names.add(str(fields[fields.index("library_name") + 1]))
    return names


COMMANDS: dict[str, Callable[[argparse.Namespace, Target, Streams], int]] = {
    "status": cmd_status,
    "set-limit": cmd_set_limit,
    "release": cmd_release,
    "reset": cmd_reset,
    "requeue": cmd_requeue,
    "forget": cmd_forget,
    "load-functions": cmd_load_functions,
}
