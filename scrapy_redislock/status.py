"""Read-only inspection of every lock under a key prefix: what ``redislock status`` shows.

Nothing here writes to Redis. Each lock is read in one MULTI/EXEC (its keys share a hash tag), so the
numbers of one stage are a consistent snapshot: the limit and ttl (``:meta``), the grants in the
group's pending list (consumer, entry id = fencing token, idle time on Redis's clock), the identity each
process registered (``:owners``: host, pid, started, spider/label, and ``waiting`` as of its last renewal),
and the stream's counters, from which follow the free slots and the debt left by lowering the limit
(see ``scripts/_lib.lua``). A pending-list consumer may be one wait of an owner (``<owner>#<n>``): it counts for
the owner (:func:`~scrapy_redislock.core.owner_of`). :func:`why_waiting` says in one line why a request of a
stage would wait now (held by whom, paused, a recovery window); the crawl's log and ``redislock status`` both use it.
:func:`astage_status` is the same read for ``redis.asyncio`` clients. Also the worker queues' dead-letter lists
(:func:`dead_letters`: entries no worker could load, e.g. a payload someone pushed by hand).

The worker mixin's state per spider (``stagequeue.py``) is read the same way, one MULTI/EXEC per spider: queue
lengths per stage, and each registered worker's last beat (Redis's clock), stage and requests in flight.
Everything the command line and the dashboard show of Redis is read here. Imports neither Scrapy nor Twisted;
reads no settings.
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
from redis.client import NEVER_DECODE

from scrapy_redislock.core import GROUP, LIMBO, LockKeys, fence_of, owner_of, text
from scrapy_redislock.stagequeue import QueueKeys

# Grants listed per stage; the counts (held, free, ...) are exact whatever the number.
MAX_LISTED = 10_000
DEAD_LETTERS_LISTED = 5  # newest dead letters shown per spider; the count is exact
WORKER_LOCK_PREFIX = "workers:"  # StageWorkerMixin's slot locks are named workers:<stage>


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
    """One registered consumer of a lock (a lock object in some process) and what it told Redis about itself."""

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
        return float(started) if isinstance(started, int | float) and not isinstance(started, bool) else None

    @property
    def spider(self) -> str | None:
        name = self.identity.get("spider") or self.identity.get("label")
        return None if name is None else str(name)


@dataclass
class StageStatus:
    """One lock (stage) as Redis holds it now."""

    stage: str
    exists: bool  # False: the limit is there but the stream is gone (data loss); the next process recreates it
    limit: int | None
    ttl: float | None
    held: int
    free: int
    debt: int  # grants still to be given back before a new one is granted (after lowering the limit)
    waiters: int  # sum of `waiting` over processes, as of each one's last renewal
    fence: int  # the last fencing token generated (the stream's last entry id)
    grants: list[Grant] = field(default_factory=list)
    processes: list[Process] = field(default_factory=list)
    # The group's last-delivered sequence less the lock's first id (``base``): every grant since the lock was
    # created, plus the slots withdrawn by
    # lowering the limit (they are skipped, never granted). Only grows, so a rate of it is grants per second.
    delivered: int = 0

    def process(self, holder: str) -> Process | None:
        """The registered process of a holder (an owner, or one of its consumers)."""
        owner = owner_of(holder)
        for process in self.processes:
            if process.holder == owner:
                return process
        return None

    @property
    def expired(self) -> int:
        """Grants whose lease ran out (their holder stopped renewing); the next maintain of any process frees them."""
        return sum(1 for grant in self.grants if grant.expired)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["why_waiting"] = why_waiting(self)
        for process, raw in zip(self.processes, data["processes"], strict=True):
            raw.update(host=process.host, pid=process.pid, spider=process.spider, started=process.started)
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


@dataclass
class WorkerStatus:
    """One registered worker of a StageWorkerMixin spider."""

    worker: str  # host:pid:random
    silence: float  # seconds since its last beat (Redis's clock); it beats every ttl/3
    stage: str | None  # the stage it works on, as of its last beat
    in_flight: int  # requests it popped and has not finished (requeued if it dies)
    alive: bool  # silent for less than the ttl; the other workers requeue a dead one's requests

    @property
    def host(self) -> str:
        return self.worker.rsplit(":", 2)[0]

    @property
    def pid(self) -> int | None:
        parts = self.worker.rsplit(":", 2)
        return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


@dataclass
class SpiderStatus:
    """The shared crawl state of one StageWorkerMixin spider: its stage queues and its workers."""

    spider: str
    ttl: float  # silence after which a worker counts as dead (the ttl of the worker slot locks)
    queues: dict[str, int]  # stage -> requests waiting in its queue
    workers: list[WorkerStatus] = field(default_factory=list)

    @property
    def alive(self) -> int:
        return sum(1 for worker in self.workers if worker.alive)

    @property
    def dead(self) -> int:
        """Registered workers silent for the ttl, not yet reaped by a live worker."""
        return sum(1 for worker in self.workers if not worker.alive)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for worker, raw in zip(self.workers, data["workers"], strict=True):
            raw.update(host=worker.host, pid=worker.pid)
        data.update(alive=self.alive, dead=self.dead, in_flight=sum(w.in_flight for w in self.workers))
        return data


def _glob_escape(value: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", value)


def _tagged_keys(client: redis.Redis, prefix: str, pattern: str) -> dict[str, set[str]]:
    """``{tag: {what follows the tag}}`` for the keys ``<prefix>:{<tag>}<pattern>`` (one SCAN)."""
    head = f"{prefix}:{{"
    found: dict[str, set[str]] = {}
    for key in client.scan_iter(match=f"{_glob_escape(head)}*}}{pattern}", count=1000):
        tag, sep, rest = text(key)[len(head) :].partition("}")
        if sep and tag and "{" not in tag:
            found.setdefault(tag, set()).add(rest)
    return found


def find_stages(client: redis.Redis, prefix: str) -> list[str]:
    """Names of every lock under ``prefix`` (SCAN for ``<prefix>:{*}:meta``), sorted."""
    return sorted(_tagged_keys(client, prefix, ":meta"))


@dataclass
class _SpiderKeys:
    """What a SCAN found of one spider's queue keys."""

    queues: set[str] = field(default_factory=set)  # stages with a non-empty queue
    inflight: set[str] = field(default_factory=set)  # workers with a non-empty in-flight hash
    registered: bool = False  # an alive zset or working hash exists


def _spiders_in(tagged: dict[str, set[str]]) -> dict[str, _SpiderKeys]:
    """The spiders among scanned ``{tag: {rest of key}}`` (none of a lock's keys looks like a spider's)."""
    spiders: dict[str, _SpiderKeys] = {}
    for tag, rests in tagged.items():
        keys = _SpiderKeys()
        for rest in rests:
            if rest.startswith(":queue:"):
                keys.queues.add(rest[len(":queue:") :])
            elif rest.startswith(":inflight:"):
                keys.inflight.add(rest[len(":inflight:") :])
            elif rest in (":alive", ":working"):
                keys.registered = True
        if keys.queues or keys.inflight or keys.registered:
            spiders[tag] = keys
    return spiders


def _seq(stream_id: Any) -> int:
    return fence_of(str(text(stream_id)))


def _identity(raw: Any) -> dict[str, Any]:
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


def stage_status(client: redis.Redis, prefix: str, stage: str) -> StageStatus | None:
    """The stage's lock as Redis holds it now; None when there is no such lock under the prefix."""
    with client.pipeline(transaction=True) as pipe:
        _queue_reads(pipe, LockKeys.of(prefix, stage))
        return _parse(stage, pipe.execute(raise_on_error=False))


async def astage_status(client: redis.asyncio.Redis, prefix: str, stage: str) -> StageStatus | None:
    """:func:`stage_status` for a redis.asyncio client (one MULTI/EXEC, read-only)."""
    async with client.pipeline(transaction=True) as pipe:
        _queue_reads(pipe, LockKeys.of(prefix, stage))
        return _parse(stage, await pipe.execute(raise_on_error=False))


def _parse(stage: str, replies: list[Any]) -> StageStatus | None:
    meta, stream, groups, pending, consumers, owners = replies
    for reply in (meta, owners):
        if isinstance(reply, Exception):
            raise reply
    meta = {text(k): text(v) for k, v in (meta or {}).items()}
    if "limit" not in meta:
        return None
    limit = int(meta["limit"])
    ttl = int(meta["ttl"]) / 1000 if "ttl" in meta else None
    broken = [r for r in (stream, groups, pending, consumers) if isinstance(r, Exception)]
    for error in broken:
        if not isinstance(error, redis.exceptions.ResponseError) or str(error).startswith("NOPERM"):
            raise error
    if broken:
        # No stream or no group: Redis lost it; the next process to start or renew recreates it.
        return StageStatus(stage, False, limit, ttl, held=0, free=0, debt=0, waiters=0, fence=0)

    stream_last = _seq(stream["last-generated-id"])
    group = next((g for g in groups if text(g.get("name")) == GROUP), None)
    group_last = _seq(group["last-delivered-id"]) if group else 0
    held = int(group["pending"]) if group else 0

    grants = []
    for entry in pending:
        grant = str(text(entry["message_id"]))
        age = int(entry["time_since_delivered"]) / 1000
        left = round(ttl - age, 3) if ttl is not None else 0.0
        grants.append(
            Grant(
                holder=owner_of(str(text(entry["consumer"]))),  # a wait's consumer name is a detail
                grant=grant,
                fence=fence_of(grant),
                age=age,
                lease_left=left,
            )
        )

    held_by: dict[str, int] = {}
    for consumer in consumers:  # an owner's grants sit under its own name and its waits' ('<owner>#<n>')
        owner = owner_of(str(text(consumer["name"])))
        held_by[owner] = held_by.get(owner, 0) + int(consumer.get("pending", 0))
    identities = {str(text(k)): _identity(v) for k, v in (owners or {}).items()}
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
        grants=grants,
        processes=processes,
        delivered=group_last - int(meta.get("base", 0)),
    )


def _short(value: float) -> str:
    return f"{value:.1f}s" if value < 10 else f"{value:.0f}s"


def _who(process: Process | None, holder: str) -> str:
    if process is None or (process.host is None and process.pid is None):
        return f"unregistered holder {holder}"
    return f"{process.host} pid {process.pid}"


def why_waiting(status: StageStatus, now: float | None = None) -> str:
    """Why a request of this stage would wait now, in one line; "" when a slot is free.

    Paused (limit 0, and by whom when a registered process configured it), a recovery window after a Redis
    data loss (until when), debt after lowering the limit, or every slot held: by whom (host, pid), with how much
    lease left, and which holders stopped renewing (a dead process: its slots come back when the lease ends).
    """
    now = time.time() if now is None else now
    if not status.exists:
        return "its lock is missing in Redis (data loss?); the next process to start or renew recreates it"
    if status.limit == 0:
        pausers = sorted(
            _who(p, p.holder) for p in status.processes if p.identity.get("limit") == 0 and p.holder != LIMBO
        )
        by = f"by {', '.join(pausers)} (its REDISLOCK_STAGES)" if pausers else "by set-limit or a process gone since"
        return f"paused: limit 0 in Redis, set {by}; nothing is granted until the limit is raised"
    reserved = [g for g in status.grants if g.holder == LIMBO]
    if reserved:
        left = max(0.0, max(g.lease_left for g in reserved))
        until = time.strftime("%H:%M:%S", time.localtime(now + left))
        return (
            f"recovery window after a Redis data loss: {len(reserved)} of {status.limit} slots reserved for the "
            f"holders that survived, until {until} (in {_short(left)})"
        )
    if status.free > 0:
        return ""
    ttl = status.ttl or 0.0
    stale_after = min(ttl, 3.0)  # live holders renew every min(ttl/3, 1 s)
    by_owner: dict[str, list[Grant]] = {}
    for grant in status.grants:
        by_owner.setdefault(owner_of(grant.holder), []).append(grant)
    parts = []
    for owner, grants in sorted(by_owner.items(), key=lambda item: -len(item[1])):
        who = _who(status.process(owner), owner)
        left = min(g.lease_left for g in grants)
        oldest = max(g.age for g in grants)
        if oldest > stale_after:
            parts.append(
                f"{len(grants)} by {who} (not renewed for {_short(oldest)}: dead? freed when its lease ends in "
                f"{_short(max(0.0, left))})"
            )
        else:
            parts.append(f"{len(grants)} by {who} (lease left {_short(max(0.0, left))})")
    debt = f", {status.debt} more to give back after the limit was lowered" if status.debt else ""
    return f"all {status.limit} slots held{debt}: " + "; ".join(parts)


@dataclass
class DeadLetter:
    """An entry of a worker queue that could not be loaded, as the worker noted it."""

    stage: str
    error: str
    worker: str
    time: float | None
    size: int
    excerpt: str  # the first bytes, escaped (repr)


@dataclass
class DeadLetters:
    """One spider's dead-letter list: how many, and the newest few."""

    spider: str
    key: str
    count: int
    newest: list[DeadLetter] = field(default_factory=list)


def _dead_letter(raw: bytes) -> DeadLetter:
    note_line, _, rest = raw.partition(b"\n")
    stage, _, data = rest.partition(b"\n")
    note = _identity(note_line)
    when = note.get("time")
    return DeadLetter(
        stage=stage.decode("utf-8", "replace"),
        error=str(note.get("error", "?")),
        worker=str(note.get("worker", "?")),
        time=float(when) if isinstance(when, int | float) and not isinstance(when, bool) else None,
        size=len(data),
        excerpt=repr(data[:40]) + ("..." if len(data) > 40 else ""),
    )


def dead_letters(client: redis.Redis, prefix: str) -> list[DeadLetters]:
    """Every non-empty ``<prefix>:{<spider>}:deadletter`` list, by spider."""
    head, tail = f"{prefix}:{{", "}:deadletter"
    found = []
    for key in sorted(text(k) for k in client.scan_iter(match=f"{_glob_escape(head)}*{_glob_escape(tail)}")):
        count = int(client.llen(key))
        # Raw bytes even on a client that decodes replies: an entry may be anything (e.g. a pickle payload).
        newest = client.execute_command("LRANGE", key, 0, DEAD_LETTERS_LISTED - 1, **{NEVER_DECODE: []})
        if count:
            found.append(DeadLetters(key[len(head) : -len(tail)], key, count, [_dead_letter(r) for r in newest]))
    return found


def worker_ttl(stages: list[StageStatus], default: float) -> float:
    """The silence that makes a worker dead: the ttl of the worker slot locks (``workers:<stage>``), else ``default``
    (a spider whose stages are all uncapped has no slot lock)."""
    ttls = [s.ttl for s in stages if s.stage.startswith(WORKER_LOCK_PREFIX) and s.ttl is not None]
    return max(ttls) if ttls else default


def spider_status(client: redis.Redis, prefix: str, spider: str, ttl: float, found: _SpiderKeys) -> SpiderStatus:
    """One spider's queues and workers as Redis holds them now (one MULTI/EXEC: its keys share a hash tag);
    ``found``: its keys that a SCAN saw (queues and in-flight records that are not empty)."""
    keys = QueueKeys.of(prefix, spider)
    with client.pipeline(transaction=True) as pipe:
        pipe.time()
        pipe.zrange(keys.alive, 0, -1, withscores=True)
        pipe.hgetall(keys.working)
        for worker in sorted(found.inflight):
            pipe.hlen(keys.inflight(worker))
        for stage in sorted(found.queues):
            pipe.llen(keys.queue(stage))
        replies = pipe.execute()
    (seconds, micros), beats, working = replies[:3]
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    in_flight = dict(zip(sorted(found.inflight), (int(n) for n in replies[3 : 3 + len(found.inflight)]), strict=True))
    queues = dict(zip(sorted(found.queues), (int(n) for n in replies[3 + len(found.inflight) :]), strict=True))
    stage_of = {str(text(k)): str(text(v)) for k, v in (working or {}).items()}
    for stage in stage_of.values():
        queues.setdefault(stage, 0)  # an empty queue is no key in Redis; the stage a worker is on still counts
    workers = []
    for name, beat in beats:
        name = str(text(name))
        silence = max(0.0, (now_ms - int(beat)) / 1000)
        workers.append(
            WorkerStatus(name, round(silence, 3), stage_of.get(name), in_flight.get(name, 0), alive=silence < ttl)
        )
    return SpiderStatus(spider, ttl, dict(sorted(queues.items())), workers)


def read_all(client: redis.Redis, prefix: str, default_ttl: float) -> tuple[list[StageStatus], list[SpiderStatus]]:
    """Every stage lock and every StageWorkerMixin spider under the prefix, found with one SCAN.

    ``default_ttl`` makes a worker dead when no worker slot lock says its ttl (see :func:`worker_ttl`).
    """
    tagged = _tagged_keys(client, prefix, "*")
    found = (stage_status(client, prefix, tag) for tag, rests in sorted(tagged.items()) if ":meta" in rests)
    stages = [status for status in found if status is not None]
    ttl = worker_ttl(stages, default_ttl)
    spiders = [spider_status(client, prefix, name, ttl, keys) for name, keys in sorted(_spiders_in(tagged).items())]
    return stages, spiders


def snapshot(
    stages: list[StageStatus],
    prefix: str,
    url: str,
    spiders: list[SpiderStatus] | None = None,
    dead: list[DeadLetters] | None = None,
) -> dict[str, Any]:
    """Everything ``status --json`` prints (``url`` must already be masked)."""
    return {
        "url": url,
        "prefix": prefix,
        "time": round(time.time(), 3),
        "stages": [s.to_json() for s in stages],
        "spiders": [s.to_json() for s in spiders or []],
        "dead_letters": [asdict(d) for d in dead or []],
    }


__all__ = [
    "DeadLetter",
    "DeadLetters",
    "Grant",
    "Process",
    "SpiderStatus",
    "StageStatus",
    "WorkerStatus",
    "astage_status",
    "dead_letters",
    "find_stages",
    "read_all",
    "snapshot",
    "spider_status",
    "stage_status",
    "why_waiting",
]
