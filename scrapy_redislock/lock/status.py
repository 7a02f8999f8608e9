"""Read-only inspection of one lock: what ``redislock status`` shows of a stage, and why a request
waits.

Nothing here writes to Redis. Each lock is read in one MULTI/EXEC (its keys share a hash tag), so
the numbers of one stage are a consistent snapshot: the limit and ttl (``:meta``), the grants in the
group's pending list (consumer, entry id = fencing token, idle time on Redis's clock), the identity
each process registered (``:owners``: host, pid, started, spider/label, and ``waiting`` as of its
last renewal), and the stream's counters, from which follow the free slots and the debt left by
lowering the limit (see ``scripts/_lib.lua``). A pending-list consumer may be one wait of an owner
(``<owner>#<n>``): it counts for the owner (:func:`~scrapy_redislock.lock.permit.owner_of`).
:func:`wait_reason` says why a request of a stage would wait now (held by whom, paused, a recovery
window), in one line; the crawl's log and ``redislock status`` both use it.
:func:`astage_status` is the same read for ``redis.asyncio`` clients. Imports neither Scrapy nor
Twisted; reads no settings.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
import redis.asyncio
import redis.exceptions

from scrapy_redislock._redis import AsyncRedisClient, RedisClient, printable, text
from scrapy_redislock.lock.permit import (
    GROUP,
    LIMBO,
    LockKeys,
    fence_of,
    group_prefix,
    owner_of,
    split_group,
)

MAX_LISTED = 10_000
# What parsing a value that is not what the scripts write raises (a crawler may write anything to its
# prefix): the stage, spider or worker is shown as unreadable, and the others as usual.
BAD_VALUE = (
    ValueError,
    TypeError,
    KeyError,
    AttributeError,
    IndexError,
    OverflowError,
    RecursionError,
)
# an integer read from Redis has at most this many digits (int() of 4000 takes long)
MAX_DIGITS = 20


def read_int(value: Any, what: str) -> int:
    """An integer written as digits (``-`` allowed), at most MAX_DIGITS of them; ValueError naming
    ``what`` and the value (escaped, cut) otherwise."""
    raw = text(value)
    if isinstance(raw, int) and not isinstance(raw, bool) and abs(raw) < 10**MAX_DIGITS:
        return raw
    if isinstance(raw, str) and re.fullmatch(rf"-?[0-9]{{1,{MAX_DIGITS}}}", raw):
        return int(raw)
    raise ValueError(f"{what} is not an integer: {shown(raw)}")


def read_float(value: Any, what: str) -> float:
    """A finite number (an int, a float, or its text); ValueError naming ``what`` otherwise."""
    raw = text(value)
    try:
        if isinstance(raw, bool) or not isinstance(raw, int | float | str) or len(str(raw)) > 40:
            raise ValueError
        number = float(raw)
    except (ValueError, OverflowError):
        number = math.nan
    if not math.isfinite(number):
        raise ValueError(f"{what} is not a finite number: {shown(raw)}")
    return number


def shown(value: Any, most: int = 40) -> str:
    """A value read from Redis as an error message shows it: repr, control characters escaped,
    cut to ``most`` characters."""
    raw = repr(value)
    return printable(raw[:most] + ("..." if len(raw) > most else ""))


# the light path's members that are not grants (scripts/_lib.lua)
LIGHT_LIMIT = "#limit"
LIGHT_STREAM = "~stream"
LIGHT_PAUSE = "~pause"
LIGHT_PIN = "#pinned"  # while an operator's limit stands (lock/scripts/_lib.lua's PIN_MEMBER)


@dataclass
class Grant:
    """One held slot."""

    holder: str
    grant: str
    fence: int
    age: float  # seconds since the grant or its last renewal (PEL idle time, Redis's clock)
    lease_left: float  # ttl - age; negative: expired, freed by the next maintain of any process
    owner: str = ""  # the process's lock object the holder (consumer) belongs to; see owner_of

    def __post_init__(self) -> None:
        self.owner = self.owner or owner_of(self.holder)

    @property
    def expired(self) -> bool:
        return self.lease_left < 0


@dataclass
class Process:
    """One registered consumer of a lock (a lock object in some process) and what it told Redis
    about itself."""

    holder: str
    held: int
    waiting: int
    identity: dict[str, Any] = field(default_factory=dict)

    @property
    def host(self) -> str | None:
        host = self.identity.get("host")
        return None if host is None else str(host)

    @property
    def pid(self) -> int | None:
        pid = self.identity.get("pid")
        return (
            pid if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 2**31 else None
        )

    @property
    def started(self) -> float | None:
        """When the process started (its own wall clock, seconds since the epoch); None when it
        is no number a clock can show."""
        try:
            return read_float(self.identity.get("started"), "started")
        except ValueError:
            return None

    @property
    def spider(self) -> str | None:
        name = self.identity.get("spider") or self.identity.get("label")
        return None if name is None else str(name)


@dataclass
class AdaptiveStatus:
    """The last window of a lock's adaptive limit (its ``adapt_log``'s newest record)."""

    at: float  # when it closed, seconds since the epoch (Redis's clock)
    limit: int  # the limit it applied
    latency: float | None  # mean latency of the window, seconds (None: no answer)
    noload: float  # the no-load latency estimate, seconds
    overload_rate: float  # 429/503 answers per outcome
    error_rate: float  # timeouts and connection errors per outcome
    in_flight: float | None  # mean slots in use

    @classmethod
    def of(cls, raw: Any) -> AdaptiveStatus | None:
        """The record adapt_commit.lua writes; None for anything else (no non-finite number in
        it: a JSON reader of ``status --json`` or the dashboard's frames would choke on one)."""
        try:
            at, limit, latency, noload, overload, errors, in_flight = read_json(raw, 1000)
            return cls(
                read_float(at, "at") / 1000,
                read_int(limit, "limit"),
                None if latency is None else read_float(latency, "latency") / 1000,
                read_float(noload, "noload") / 1000,
                read_float(overload, "overload"),
                read_float(errors, "errors"),
                None if in_flight is None else read_float(in_flight, "in_flight"),
            )
        except BAD_VALUE:
            return None


@dataclass
class StageStatus:
    """One lock (stage) as Redis holds it now."""

    stage: str
    exists: bool  # False: the limit is there but the stream is gone (data loss); the next process recreates it
    limit: int | None
    ttl: float | None
    held: int = 0
    free: int = 0
    # grants still to be given back before a new one is granted (after lowering the limit)
    debt: int = 0
    waiters: int = 0  # sum of `waiting` over processes, as of each one's last renewal
    fence: int = 0  # the last fencing token generated (the stream's last entry id)
    grants: list[Grant] = field(default_factory=list)
    processes: list[Process] = field(default_factory=list)
    # The group's last-delivered sequence less the lock's first id (``base``): every grant since the
    # lock was created, plus the slots withdrawn by lowering the limit (they are skipped, never
    # granted). Only grows, so a rate of it is grants per second.
    delivered: int = 0
    adaptive: AdaptiveStatus | None = None  # its adaptive limit's last window, if it adapts
    # why its state in Redis could not be read (a value the scripts never write, e.g. written by
    # hand or by a compromised crawler); then nothing else of it is known (``exists`` False)
    error: str | None = None
    # its cap group (REDISLOCK_GROUP): the spider's name by default; "" for the 0.x keys of no group
    group: str = ""

    @property
    def label(self) -> str:
        """How an operator reads the stage: ``detail (group shop)``, or ``detail`` without one."""
        return f"{self.stage} (group {self.group})" if self.group else self.stage

    @classmethod
    def unreadable(cls, stage: str, error: str) -> StageStatus:
        return cls(stage, False, None, None, error=error)

    def process(self, holder: str) -> Process | None:
        """The registered process of a holder (an owner, or one of its consumers)."""
        owner = owner_of(holder)
        return next((process for process in self.processes if process.holder == owner), None)

    @property
    def expired(self) -> int:
        """Grants whose lease ran out (their holder stopped renewing); the next maintain of any
        process frees them."""
        return sum(1 for grant in self.grants if grant.expired)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["why_waiting"] = wait_reason(self).text
        for process, raw in zip(self.processes, data["processes"], strict=True):
            raw.update(_identity_json(process))
        for raw in data["grants"]:
            raw.update(_identity_json(self.process(raw["owner"])))
        data["expired"] = self.expired
        return data


def _identity_json(process: Process | None) -> dict[str, Any]:
    """What ``status --json`` shows of a registered process beside a holder (None: unregistered)."""
    names = ("host", "pid", "spider", "started")
    return {name: getattr(process, name) if process else None for name in names}


def glob_escape(value: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", value)


def grouped_keys(client: RedisClient, prefix: str, pattern: str) -> dict[tuple[str, str], set[str]]:
    """``{(group, tag): {what follows the tag}}`` for the keys ``<prefix>:[<group>:]{<tag>}<pattern>``
    (one SCAN; group "" for the keys of no group, :func:`~scrapy_redislock.lock.permit.split_group`)."""
    found: dict[tuple[str, str], set[str]] = {}
    for key in client.scan_iter(match=f"{glob_escape(prefix)}:*{{*}}{pattern}", count=1000):
        parts = split_group(prefix, str(text(key)))
        if parts is not None:
            found.setdefault(parts[:2], set()).add(parts[2])
    return found


KEY_LOCK_PREFIX = "key:"  # locks of keys met at run time (REDISLOCK_STAGE_KEY) are named key:<key>


def find_stages(client: RedisClient, prefix: str) -> list[tuple[str, str]]:
    """``(group, name)`` of every lock under ``prefix`` (one SCAN for its ``:meta`` and ``:light``
    keys), sorted."""
    found = grouped_keys(client, prefix, "*")
    return sorted(place for place, rests in found.items() if ":meta" in rests or ":light" in rests)


def _seq(stream_id: Any) -> int:
    return fence_of(str(text(stream_id)))


def _finite(number: str) -> float:
    """A JSON number, or constant (NaN, Infinity), that is finite; ValueError otherwise."""
    value = float(number)
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {number[:40]}")
    return value


def read_json(raw: Any, most: int = 100_000) -> Any:
    """JSON read from Redis: at most ``most`` characters, no number that is not finite (1e999,
    NaN: a JSON reader of our own output would choke on it); one of BAD_VALUE otherwise (deep
    nesting is a RecursionError)."""
    raw = text(raw)
    if not isinstance(raw, str) or len(raw) > most:
        raise ValueError(f"not a JSON text of at most {most} characters")
    return json.loads(raw, parse_float=_finite, parse_constant=_finite)


def parse_identity(raw: Any) -> dict[str, Any]:
    """A JSON object as a process wrote it; {} for anything else (deep nesting, not JSON, too
    long, a number that is not finite)."""
    try:
        value = read_json(raw)
    except BAD_VALUE:
        return {}
    return value if isinstance(value, dict) and _shallow(value, 8) else {}


def _shallow(value: Any, most: int) -> bool:
    """Whether ``value`` nests lists and dicts at most ``most`` deep (what status copies and
    prints of an identity is copied recursively)."""
    level = [value]
    for _ in range(most + 1):
        level = [
            child
            for item in level
            if isinstance(item, dict | list)
            for child in (item.values() if isinstance(item, dict) else item)
        ]
        if not level:
            return True
    return False


def _queue_reads(pipe: Any, keys: LockKeys) -> None:
    pipe.hgetall(keys.meta)
    pipe.xinfo_stream(keys.slots)
    pipe.xinfo_groups(keys.slots)
    pipe.xpending_range(keys.slots, GROUP, "-", "+", MAX_LISTED)
    pipe.xinfo_consumers(keys.slots, GROUP)
    pipe.hgetall(keys.owners)
    # the light path of a key's lock (lock/light.py)
    pipe.zrange(keys.light, 0, MAX_LISTED, withscores=True)
    # the adaptive limit's last window (lock/adaptive.py), if it adapts
    pipe.lindex(keys.adapt_log, 0)


def stage_status(
    client: RedisClient, prefix: str, stage: str, group: str = ""
) -> StageStatus | None:
    """The stage's lock (of cap group ``group``) as Redis holds it now; None when there is no such
    lock under the prefix."""
    with client.pipeline(transaction=True) as pipe:
        _queue_reads(pipe, LockKeys.of(group_prefix(prefix, group), stage))
        status = _parse(stage, pipe.execute(raise_on_error=False))
    if status is not None:
        status.group = group
    return status


async def astage_status(client: AsyncRedisClient, prefix: str, stage: str) -> StageStatus | None:
    """:func:`stage_status` for a redis.asyncio client (one MULTI/EXEC, read-only); ``prefix`` is
    the group's (:func:`~scrapy_redislock.lock.permit.group_prefix`)."""
    async with client.pipeline(transaction=True) as pipe:
        _queue_reads(pipe, LockKeys.of(prefix, stage))
        return _parse(stage, await pipe.execute(raise_on_error=False))


def _parse(stage: str, replies: list[Any]) -> StageStatus | None:
    """The stage from its replies; unreadable (its ``error`` says why) when a value in Redis is not
    one the scripts write."""
    raw_meta, *_, owners, light, adapted = replies
    for reply in (raw_meta, owners, light, adapted):
        if isinstance(reply, Exception):
            if read_refused(reply):
                raise reply
            return StageStatus.unreadable(stage, f"a key has the wrong type ({reply})")
    try:
        status = _lock(stage, replies)
        if status is not None and adapted:
            status.adaptive = AdaptiveStatus.of(adapted)
    except BAD_VALUE as exc:
        message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        return StageStatus.unreadable(stage, printable(message[:200]))
    return status


def read_refused(error: Exception) -> bool:
    """An error that is not about the value read: the connection, an ACL refusal."""
    return not isinstance(error, redis.exceptions.ResponseError) or str(error).startswith("NOPERM")


def _lock(stage: str, replies: list[Any]) -> StageStatus | None:
    raw_meta, stream, groups, pending, consumers, owners, light, _ = replies
    meta = {text(k): text(v) for k, v in (raw_meta or {}).items()}
    if "limit" not in meta:
        return _light(stage, light)
    limit = read_int(meta["limit"], "its limit")
    ttl = read_float(meta["ttl"], "its ttl") / 1000 if "ttl" in meta else None
    if _stream_lost(stream, groups, pending, consumers):
        # No stream or no group: Redis lost it; the next process to start or renew recreates it.
        return StageStatus(stage, False, limit, ttl)
    stream_last = _seq(stream["last-generated-id"])
    group_last, held = _group_figures(groups)
    processes = _processes(consumers, owners)
    return StageStatus(
        stage=stage,
        exists=True,
        limit=limit,
        ttl=ttl,
        held=held,
        free=max(0, stream_last - group_last),
        debt=max(0, group_last - stream_last),
        waiters=sum(p.waiting for p in processes),
        fence=stream_last,
        grants=[_grant(entry, ttl) for entry in pending],
        processes=processes,
        delivered=group_last - read_int(meta.get("base", 0), "its base"),
    )


def _light(stage: str, members: Any) -> StageStatus | None:
    """A key's lock on its light path (no stream: lock/light.py), or None when there is none.

    Its grants are the zset's members (``<owner>/L<n>``) with their lease ends (lease left is
    counted on this machine's clock: a read-only reader may not run TIME); the limit is there only
    when an operator set one (else each process counts against its own REDISLOCK_KEY_LIMITS).
    Nobody waits on the light path, and a light grant has no fence and no renewal age."""
    if not members:
        return None
    now_ms = time.time() * 1000
    scores = {str(text(member)): read_float(score, "a light score") for member, score in members}
    limit = scores.pop(LIGHT_LIMIT, None)
    scores.pop(LIGHT_STREAM, None)
    scores.pop(LIGHT_PAUSE, None)
    scores.pop(LIGHT_PIN, None)
    grants = []
    for token, ends in sorted(scores.items()):
        owner, _, grant = token.rpartition("/")
        grants.append(Grant(owner, grant, 0, 0.0, round((ends - now_ms) / 1000, 3)))
    held = sum(1 for g in grants if not g.expired)
    limit_of = None if limit is None else read_int(round(limit), "its light limit")
    free = 0 if limit_of is None else max(0, limit_of - held)
    owners = sorted({g.holder for g in grants})
    processes = [Process(owner, sum(1 for g in grants if g.holder == owner), 0) for owner in owners]
    return StageStatus(stage, True, limit_of, None, held, free, grants=grants, processes=processes)


def _group_figures(groups: Any) -> tuple[int, int]:
    """The holders' group (XINFO GROUPS): the sequence it delivered last, and its grants held."""
    group = next((g for g in groups if text(g.get("name")) == GROUP), None)
    if group is None:
        return 0, 0
    return _seq(group["last-delivered-id"]), read_int(group["pending"], "pending")


def _stream_lost(*replies: Any) -> bool:
    """Whether the stream or its group is missing (their reads answered a ResponseError); any
    other error, or an ACL refusal, is raised."""
    broken = [r for r in replies if isinstance(r, Exception)]
    for error in broken:
        if read_refused(error):
            raise error
    return bool(broken)


def _grant(entry: Any, ttl: float | None) -> Grant:
    """One pending entry of the group (XPENDING) as a held slot."""
    grant = str(text(entry["message_id"]))
    age = int(entry["time_since_delivered"]) / 1000
    return Grant(
        holder=owner_of(str(text(entry["consumer"]))),  # a wait's consumer name is a detail
        grant=grant,
        fence=fence_of(grant),
        age=age,
        lease_left=round(ttl - age, 3) if ttl is not None else 0.0,
    )


def _processes(consumers: Any, owners: Any) -> list[Process]:
    """Every registered owner and every consumer holding grants, with what it told Redis."""
    held_by: dict[str, int] = {}
    # an owner's grants sit under its own name and its waits' ('<owner>#<n>')
    for consumer in consumers:
        owner = owner_of(str(text(consumer["name"])))
        held_by[owner] = held_by.get(owner, 0) + int(consumer.get("pending", 0))
    identities = {str(text(k)): parse_identity(v) for k, v in (owners or {}).items()}
    processes = []
    for holder in sorted(set(held_by) | set(identities)):
        identity = identities.get(holder, {})
        waiting = identity.get("waiting", 0)
        if not (isinstance(waiting, int) and 0 < waiting < 10**9):
            waiting = 0
        processes.append(Process(holder, held_by.get(holder, 0), waiting, identity))
    return processes


def _short(value: float) -> str:
    return f"{value:.1f}s" if value < 10 else f"{value:.0f}s"


def _who(process: Process | None, holder: str) -> str:
    if process is None or (process.host is None and process.pid is None):
        return f"unregistered holder {holder}"
    return f"{process.host} pid {process.pid}"


@dataclass(frozen=True)
class WaitReason:
    """Why a request of a stage would wait now: ``kind`` is "free" (it would not), "unreadable",
    "missing", "paused", "recovery" or "held"; ``stale`` counts holders that stopped renewing (dead?). False
    when a slot is free; ``str()`` is the one-line text the log and the CLI show."""

    kind: str
    text: str = ""
    stale: int = 0

    @property
    def calm(self) -> bool:
        """Every slot held by live holders: the ordinary state of a capped stage (INFO, not a
        warning)."""
        return self.kind == "held" and not self.stale

    def __bool__(self) -> bool:
        return self.kind != "free"

    def __str__(self) -> str:
        return self.text


def wait_reason(status: StageStatus, now: float | None = None) -> WaitReason:
    """Why a request of this stage would wait now.

    Paused (limit 0, and by whom when a registered process configured it), a recovery window after a
    Redis data loss (until when), debt after lowering the limit, or every slot held: by whom (host,
    pid), with how much lease left, and which holders stopped renewing (a dead process: its slots
    come back when the lease ends).
    """
    now = time.time() if now is None else now
    if status.error:
        return WaitReason("unreadable", f"its state in Redis is unreadable: {status.error}")
    if not status.exists:
        return WaitReason(
            "missing",
            "its lock is missing in Redis (data loss?); the next process to start or renew recreates it",
        )
    if status.limit == 0:
        return WaitReason("paused", printable(_paused(status)))
    reserved = [g for g in status.grants if g.holder == LIMBO]
    if reserved:
        left = max(0.0, max(g.lease_left for g in reserved))
        until = time.strftime("%H:%M:%S", time.localtime(now + left))
        return WaitReason(
            "recovery",
            f"recovery window after a Redis data loss: {len(reserved)} of {status.limit} slots reserved for the holders that survived, until {until} (in {_short(left)})",  # noqa: E501
        )
    if status.free > 0:
        return WaitReason("free")
    held = _held(status)  # it names holders and hosts, as processes wrote them to Redis
    return WaitReason(held.kind, printable(held.text), held.stale)


def _paused(status: StageStatus) -> str:
    pausers = sorted(
        _who(p, p.holder)
        for p in status.processes
        if p.identity.get("limit") == 0 and p.holder != LIMBO
    )
    by = (
        f"by {', '.join(pausers)} (its REDISLOCK_STAGES)"
        if pausers
        else "by set-limit or a process gone since"
    )
    return f"paused: limit 0 in Redis, set {by}; nothing is granted until the limit is raised"


def _held(status: StageStatus) -> WaitReason:
    """Every slot held: by whom, lease left, and the holders that stopped renewing."""
    stale_after = min(status.ttl or 0.0, 3.0)  # live holders renew every min(ttl/3, 1 s)
    by_owner: dict[str, list[Grant]] = {}
    for grant in status.grants:
        by_owner.setdefault(owner_of(grant.holder), []).append(grant)
    parts = []
    stale = 0
    for owner, grants in sorted(by_owner.items(), key=lambda item: -len(item[1])):
        who = _who(status.process(owner), owner)
        left = _short(max(0.0, min(g.lease_left for g in grants)))
        oldest = max(g.age for g in grants)
        if oldest > stale_after:
            stale += 1
            parts.append(
                f"{len(grants)} by {who} (not renewed for {_short(oldest)}: dead? freed when its lease ends in {left})"
            )
        else:
            parts.append(f"{len(grants)} by {who} (lease left {left})")
    debt = f", {status.debt} more to give back after the limit was lowered" if status.debt else ""
    return WaitReason("held", f"all {status.limit} slots held{debt}: " + "; ".join(parts), stale)
