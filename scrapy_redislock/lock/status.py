"""Read-only inspection of one lock: what ``redislock status`` shows of a stage, and why a request
waits.

Nothing here writes to Redis. Each lock is read in one MULTI/EXEC (its keys share a hash tag), so
the numbers of one stage are a consistent snapshot: the limit and ttl (``:meta``), the grants in the
group's pending list (consumer, entry id = fencing token, idle time on Redis's clock), the identity
each process registered (``:owners``: host, pid, started, spider/label, and ``waiting`` as of its
last renewal), and the stream's counters, from which follow the free slots and the debt left by
lowering the limit (see ``scripts/_lib.lua``). A pending-list consumer may be one wait of an owner
(``<owner>#<n>``): it counts for the owner (:func:`~scrapy_redislock.lock.permit.owner_of`).
:func:`why_waiting` says in one line why a request of a stage would wait now (held by whom, paused,
a recovery window); the crawl's log and ``redislock status`` both use it.
:func:`astage_status` is the same read for ``redis.asyncio`` clients. Imports neither Scrapy nor
Twisted; reads no settings.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
import redis.asyncio
import redis.exceptions

from scrapy_redislock._redis import AsyncRedisClient, RedisClient, text
from scrapy_redislock.lock.permit import GROUP, LIMBO, LockKeys, fence_of, owner_of

MAX_LISTED = 10_000
# the light path's members that are not grants (scripts/_lib.lua)
LIGHT_LIMIT = "#limit"
LIGHT_STREAM = "~stream"
LIGHT_PAUSE = "~pause"


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
        return pid if isinstance(pid, int) else None

    @property
    def started(self) -> float | None:
        """When the process started (its own wall clock, seconds since the epoch)."""
        started = self.identity.get("started")
        return (
            float(started)
            if isinstance(started, int | float) and not isinstance(started, bool)
            else None
        )

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
        try:
            at, limit, latency, noload, overload, errors, in_flight = json.loads(text(raw))
            return cls(
                at / 1000,
                int(limit),
                None if latency is None else latency / 1000,
                noload / 1000,
                float(overload),
                float(errors),
                None if in_flight is None else float(in_flight),
            )
        except (TypeError, ValueError):
            return None


@dataclass
class StageStatus:
    """One lock (stage) as Redis holds it now."""

    stage: str
    exists: bool  # False: the limit is there but the stream is gone (data loss); the next process recreates it
    limit: int | None
    ttl: float | None
    held: int
    free: int
    # grants still to be given back before a new one is granted (after lowering the limit)
    debt: int
    waiters: int  # sum of `waiting` over processes, as of each one's last renewal
    fence: int  # the last fencing token generated (the stream's last entry id)
    grants: list[Grant] = field(default_factory=list)
    processes: list[Process] = field(default_factory=list)
    # The group's last-delivered sequence less the lock's first id (``base``): every grant since the
    # lock was created, plus the slots withdrawn by lowering the limit (they are skipped, never
    # granted). Only grows, so a rate of it is grants per second.
    delivered: int = 0
    adaptive: AdaptiveStatus | None = None  # its adaptive limit's last window, if it adapts

    def process(self, holder: str) -> Process | None:
        """The registered process of a holder (an owner, or one of its consumers)."""
        owner = owner_of(holder)
        for process in self.processes:
            if process.holder == owner:
                return process
        return None

    @property
    def expired(self) -> int:
        """Grants whose lease ran out (their holder stopped renewing); the next maintain of any
        process frees them."""
        return sum(1 for grant in self.grants if grant.expired)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["why_waiting"] = why_waiting(self)
        for process, raw in zip(self.processes, data["processes"], strict=True):
            raw.update(
                host=process.host, pid=process.pid, spider=process.spider, started=process.started
            )
        for raw in data["grants"]:
            owner = self.process(raw["owner"])
            raw.update(
                host=owner.host if owner else None,
                pid=owner.pid if owner else None,
                spider=owner.spider if owner else None,
                started=owner.started if owner else None,
            )
        data["expired"] = self.expired
        return data


def glob_escape(value: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", value)


def tagged_keys(client: RedisClient, prefix: str, pattern: str) -> dict[str, set[str]]:
    """``{tag: {what follows the tag}}`` for the keys ``<prefix>:{<tag>}<pattern>`` (one SCAN)."""
    head = f"{prefix}:{{"
    found: dict[str, set[str]] = {}
    for key in client.scan_iter(match=f"{glob_escape(head)}*}}{pattern}", count=1000):
        tag, sep, rest = text(key)[len(head) :].partition("}")
        if sep and tag and "{" not in tag:
            found.setdefault(tag, set()).add(rest)
    return found


KEY_LOCK_PREFIX = "key:"  # locks of keys met at run time (REDISLOCK_STAGE_KEY) are named key:<key>


def find_stages(client: RedisClient, prefix: str) -> list[str]:
    """Names of every lock under ``prefix`` (SCAN for ``<prefix>:{*}:meta``), sorted."""
    return sorted(tagged_keys(client, prefix, ":meta"))


def _seq(stream_id: Any) -> int:
    return fence_of(str(text(stream_id)))


def parse_identity(raw: Any) -> dict[str, Any]:
    try:
        value = json.loads(text(raw))
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


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


def stage_status(client: RedisClient, prefix: str, stage: str) -> StageStatus | None:
    """The stage's lock as Redis holds it now; None when there is no such lock under the prefix."""
    with client.pipeline(transaction=True) as pipe:
        _queue_reads(pipe, LockKeys.of(prefix, stage))
        return _parse(stage, pipe.execute(raise_on_error=False))


async def astage_status(client: AsyncRedisClient, prefix: str, stage: str) -> StageStatus | None:
    """:func:`stage_status` for a redis.asyncio client (one MULTI/EXEC, read-only)."""
    async with client.pipeline(transaction=True) as pipe:
        _queue_reads(pipe, LockKeys.of(prefix, stage))
        return _parse(stage, await pipe.execute(raise_on_error=False))


def _parse(stage: str, replies: list[Any]) -> StageStatus | None:
    raw_meta, stream, groups, pending, consumers, owners, light, adapted = replies
    for reply in (raw_meta, owners, light, adapted):
        if isinstance(reply, Exception):
            raise reply
    status = _lock(stage, raw_meta, stream, groups, pending, consumers, owners, light)
    if status is not None and adapted:
        status.adaptive = AdaptiveStatus.of(adapted)
    return status


def _lock(
    stage: str,
    raw_meta: Any,
    stream: Any,
    groups: Any,
    pending: Any,
    consumers: Any,
    owners: Any,
    light: Any,
) -> StageStatus | None:
    meta = {text(k): text(v) for k, v in (raw_meta or {}).items()}
    if "limit" not in meta:
        return _light(stage, light)
    limit = int(meta["limit"])
    ttl = int(meta["ttl"]) / 1000 if "ttl" in meta else None
    if _stream_lost(stream, groups, pending, consumers):
        # No stream or no group: Redis lost it; the next process to start or renew recreates it.
        return StageStatus(stage, False, limit, ttl, held=0, free=0, debt=0, waiters=0, fence=0)
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
        delivered=group_last - int(meta.get("base", 0)),
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
    scores = {str(text(member)): float(score) for member, score in members}
    limit = scores.pop(LIGHT_LIMIT, None)
    scores.pop(LIGHT_STREAM, None)
    scores.pop(LIGHT_PAUSE, None)
    grants = []
    for token, ends in sorted(scores.items()):
        owner, _, grant = token.rpartition("/")
        grants.append(Grant(owner, grant, 0, 0.0, round((ends - now_ms) / 1000, 3)))
    held = sum(1 for g in grants if not g.expired)
    limit_of = None if limit is None else int(limit)
    return StageStatus(
        stage,
        True,
        limit_of,
        None,
        held=held,
        free=0 if limit_of is None else max(0, limit_of - held),
        debt=0,
        waiters=0,
        fence=0,
        grants=grants,
        processes=[
            Process(owner, sum(1 for g in grants if g.holder == owner), 0)
            for owner in sorted({g.holder for g in grants})
        ],
    )


def _group_figures(groups: Any) -> tuple[int, int]:
    """The holders' group (XINFO GROUPS): the sequence it delivered last, and its grants held."""
    group = next((g for g in groups if text(g.get("name")) == GROUP), None)
    if group is None:
        return 0, 0
    return _seq(group["last-delivered-id"]), int(group["pending"])


def _stream_lost(*replies: Any) -> bool:
    """Whether the stream or its group is missing (their reads answered a ResponseError); any
    other error, or an ACL refusal, is raised."""
    broken = [r for r in replies if isinstance(r, Exception)]
    for error in broken:
        if not isinstance(error, redis.exceptions.ResponseError) or str(error).startswith("NOPERM"):
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
        processes.append(
            Process(
                holder=holder,
                held=held_by.get(holder, 0),
                waiting=waiting if isinstance(waiting, int) and waiting > 0 else 0,
                identity=identity,
            )
        )
    return processes


def _short(value: float) -> str:
    return f"{value:.1f}s" if value < 10 else f"{value:.0f}s"


def _who(process: Process | None, holder: str) -> str:
    if process is None or (process.host is None and process.pid is None):
        return f"unregistered holder {holder}"
    return f"{process.host} pid {process.pid}"


@dataclass(frozen=True)
class WaitReason:
    """Why a request of a stage would wait now: ``kind`` is "free" (it would not), "missing",
    "paused", "recovery" or "held"; ``stale`` counts holders that stopped renewing (dead?). False
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


def why_waiting(status: StageStatus, now: float | None = None) -> str:
    """:func:`wait_reason` as its one line; "" when a slot is free."""
    return wait_reason(status, now).text


def wait_reason(status: StageStatus, now: float | None = None) -> WaitReason:
    """Why a request of this stage would wait now.

    Paused (limit 0, and by whom when a registered process configured it), a recovery window after a
    Redis data loss (until when), debt after lowering the limit, or every slot held: by whom (host,
    pid), with how much lease left, and which holders stopped renewing (a dead process: its slots
    come back when the lease ends).
    """
    now = time.time() if now is None else now
    if not status.exists:
        return WaitReason(
            "missing",
            "its lock is missing in Redis (data loss?); the next process to start or renew "
            "recreates it",
        )
    if status.limit == 0:
        return WaitReason("paused", _paused(status))
    reserved = [g for g in status.grants if g.holder == LIMBO]
    if reserved:
        left = max(0.0, max(g.lease_left for g in reserved))
        until = time.strftime("%H:%M:%S", time.localtime(now + left))
        return WaitReason(
            "recovery",
            f"recovery window after a Redis data loss: {len(reserved)} of {status.limit} slots "
            f"reserved for the holders that survived, until {until} (in {_short(left)})",
        )
    if status.free > 0:
        return WaitReason("free")
    return _held(status)


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
                f"{len(grants)} by {who} (not renewed for {_short(oldest)}: dead? freed when its "
                f"lease ends in {left})"
            )
        else:
            parts.append(f"{len(grants)} by {who} (lease left {left})")
    debt = f", {status.debt} more to give back after the limit was lowered" if status.debt else ""
    return WaitReason("held", f"all {status.limit} slots held{debt}: " + "; ".join(parts), stale)
