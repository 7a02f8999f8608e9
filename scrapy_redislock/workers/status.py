"""Read-only inspection of the worker mixin's shared state per spider: queues, workers, dead
letters.

Each spider is read in one MULTI/EXEC (its keys share a hash tag): queue lengths per stage (a
queue's list, and its sorted set where a SCAN found one: requests of another priority than 0), and
each registered worker's last beat (Redis's clock), the deadline that beat promised for the next one
(past it the worker is dead: the live ones requeue its requests), stage and requests in flight; and
the queues' dead-letter lists (:func:`dead_letters`: entries no worker could load, e.g. a payload
someone pushed by hand). Nothing here writes to Redis; imports neither Scrapy nor Twisted; reads no
settings.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from redis.client import NEVER_DECODE

from scrapy_redislock._redis import RedisClient, printable, text
from scrapy_redislock.lock.status import (
    BAD_VALUE,
    StageStatus,
    glob_escape,
    parse_identity,
    read_float,
    read_int,
    read_refused,
)
from scrapy_redislock.workers.queue import QueueKeys, split_value

DEAD_LETTERS_LISTED = 5  # newest dead letters shown per spider; the count is exact
# Dead letters are read only when MEMORY USAGE (sampling the list's first 5 nodes, O(1)) estimates
# the list at most this size: that estimate bounds what LRANGE of the newest 5 returns (they lie in
# the sampled nodes, and the estimate is their mean size times the number of nodes). A list entry
# has no GETRANGE, and a reader that may not run scripts has no other bounded read.
DEAD_LETTERS_READ_BYTES = 4 * 1024 * 1024


WORKER_LOCK_PREFIX = "workers:"  # StageWorkerMixin's slot locks are named workers:<stage>


@dataclass
class WorkerStatus:
    """One registered worker of a StageWorkerMixin spider."""

    worker: str  # host:pid:random
    silence: float  # seconds since its last beat (Redis's clock); it beats every ttl/3, every second with work
    stage: str | None  # the stage it works on, as of its last beat
    in_flight: int  # requests it popped and has not finished (requeued if it dies)
    alive: bool  # its deadline has not passed; the other workers requeue a dead one's requests
    # seconds its last beat (or pop) left before its deadline as of this read (negative: past, it is
    # dead); None for a worker that set none (an older version: dead after the ttl)
    deadline_in: float | None = None
    # deadline - last beat: the silence its last beat promised, or more after a pop
    grace: float | None = None
    # why its record in Redis could not be read (its beat or deadline is not a number); it counts
    # neither alive nor dead
    error: str | None = None

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

    # why its state in Redis could not be read (a value its scripts never write); then its queues
    # and workers are unknown
    error: str | None = None

    @property
    def alive(self) -> int:
        return sum(1 for worker in self.workers if worker.alive)

    @property
    def dead(self) -> int:
        """Registered workers past their deadline (silent for the ttl if they set none), not yet
        reaped."""
        return sum(1 for worker in self.workers if not worker.alive and not worker.error)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for worker, raw in zip(self.workers, data["workers"], strict=True):
            raw.update(host=worker.host, pid=worker.pid)
        data.update(
            alive=self.alive, dead=self.dead, in_flight=sum(w.in_flight for w in self.workers)
        )
        return data


@dataclass
class SpiderKeys:
    """What a SCAN found of one spider's queue keys."""

    queues: set[str] = field(default_factory=set)  # stages with a non-empty queue (either part)
    # stages whose queue has a sorted set (requests of priority != 0)
    scored: set[str] = field(default_factory=set)
    inflight: set[str] = field(default_factory=set)  # workers with a non-empty in-flight hash
    registered: bool = False  # an alive zset or working hash exists


def spiders_in(tagged: dict[str, set[str]]) -> dict[str, SpiderKeys]:
    """The spiders among scanned ``{tag: {rest of key}}`` (none of a lock's keys looks like a
    spider's)."""
    spiders: dict[str, SpiderKeys] = {}
    for tag, rests in tagged.items():
        keys = SpiderKeys()
        for rest in rests:
            if rest.startswith(":queue:"):
                keys.queues.add(rest[len(":queue:") :])
            elif rest.startswith(":pqueue:"):
                keys.queues.add(rest[len(":pqueue:") :])
                keys.scored.add(rest[len(":pqueue:") :])
            elif rest.startswith(":inflight:"):
                keys.inflight.add(rest[len(":inflight:") :])
            elif rest in (":alive", ":working"):
                keys.registered = True
        if keys.queues or keys.inflight or keys.registered:
            spiders[tag] = keys
    return spiders


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
    # bytes MEMORY USAGE estimated for the list when it was too large to read (newest then empty)
    unread_bytes: int | None = None


def _dead_letter(raw: bytes) -> DeadLetter:
    note_line, _, rest = raw.partition(b"\n")
    try:
        stage, _, data = split_value(rest)  # the in-flight value as it was: "<stage><mark>\n<data>"
    except BAD_VALUE:
        stage, data = "?", rest
    note = parse_identity(note_line[:10_000])
    try:
        when: float | None = read_float(note.get("time"), "time")
    except ValueError:
        when = None
    return DeadLetter(
        stage=printable(str(stage)[:200]),
        error=printable(str(note.get("error", "?"))[:500]),
        worker=printable(str(note.get("worker", "?"))[:200]),
        time=when,
        size=len(data),
        excerpt=repr(data[:40]) + ("..." if len(data) > 40 else ""),
    )


def dead_letters(client: RedisClient, prefix: str) -> list[DeadLetters]:
    """Every non-empty ``<prefix>:{<spider>}:deadletter`` list, by spider."""
    head, tail = f"{prefix}:{{", "}:deadletter"
    found = []
    for key in sorted(
        text(k) for k in client.scan_iter(match=f"{glob_escape(head)}*{glob_escape(tail)}")
    ):
        count = int(client.llen(key))
        if not count:
            continue
        spider = printable(key[len(head) : -len(tail)])
        size = client.memory_usage(key, samples=DEAD_LETTERS_LISTED)
        if size is None or int(size) > DEAD_LETTERS_READ_BYTES:
            found.append(DeadLetters(spider, printable(key), count, unread_bytes=int(size or 0)))
            continue
        # Raw bytes even on a client that decodes replies: an entry may be anything (e.g. a pickle
        # payload).
        newest = client.execute_command(
            "LRANGE", key, 0, DEAD_LETTERS_LISTED - 1, **{NEVER_DECODE: []}
        )
        found.append(DeadLetters(spider, printable(key), count, [_dead_letter(r) for r in newest]))
    return found


def worker_ttl(stages: list[StageStatus], default: float) -> float:
    """The silence that makes a worker dead: the ttl of the worker slot locks (``workers:<stage>``),
    else ``default`` (a spider whose stages are all uncapped has no slot lock)."""
    ttls = [s.ttl for s in stages if s.stage.startswith(WORKER_LOCK_PREFIX) and s.ttl is not None]
    return max(ttls) if ttls else default


def spider_status(
    client: RedisClient, prefix: str, spider: str, ttl: float, found: SpiderKeys
) -> SpiderStatus:
    """One spider's queues and workers as Redis holds them now (one MULTI/EXEC: its keys share a
    hash tag); ``found``: its keys that a SCAN saw (queues and in-flight records that are not
    empty)."""
    keys = QueueKeys.of(prefix, spider)
    with client.pipeline(transaction=True) as pipe:
        pipe.time()
        pipe.zrange(keys.alive, 0, -1, withscores=True)
        pipe.zrange(keys.due, 0, -1, withscores=True)
        pipe.hgetall(keys.working)
        for worker in sorted(found.inflight):
            pipe.hlen(keys.inflight(worker))
        for stage in sorted(found.queues):
            pipe.llen(keys.queue(stage))
        for stage in sorted(found.scored):
            pipe.zcard(keys.scored(stage))
        replies = pipe.execute(raise_on_error=False)
    for reply in replies:
        if isinstance(reply, Exception):
            if read_refused(reply):
                raise reply
            return SpiderStatus(
                spider, ttl, {}, error=printable(f"a key has the wrong type ({reply})")
            )
    try:
        return _spider(spider, ttl, found, replies)
    except BAD_VALUE as exc:
        message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        return SpiderStatus(spider, ttl, {}, error=printable(message[:200]))


def _spider(spider: str, ttl: float, found: SpiderKeys, replies: list[Any]) -> SpiderStatus:
    """One spider from the replies of :func:`spider_status`'s reads; a bad value of one worker makes
    that worker unreadable, any other raises (one of BAD_VALUE)."""
    (seconds, micros), beats, dues, working = replies[:4]
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    counts = iter(replies[4:])  # in the order spider_status queued their reads
    in_flight = {worker: int(next(counts)) for worker in sorted(found.inflight)}
    queues = {stage: int(next(counts)) for stage in sorted(found.queues)}
    for stage in sorted(found.scored):
        queues[stage] += int(next(counts))
    due_of = {str(text(name)): score for name, score in dues}
    stage_of = {str(text(k)): str(text(v)) for k, v in (working or {}).items()}
    for stage in stage_of.values():
        # an empty queue is no key in Redis; the stage a worker is on still counts
        queues.setdefault(stage, 0)
    workers = []
    for name, raw_beat in beats:
        name = str(text(name))
        try:
            beat = read_int(round(read_float(raw_beat, "its beat")), "its beat")
            raw_due = due_of.get(name)
            due = None if raw_due is None else read_float(raw_due, "its deadline")
        except ValueError as exc:
            workers.append(WorkerStatus(name, 0.0, None, 0, False, error=printable(str(exc))))
            continue
        silence = max(0.0, (now_ms - beat) / 1000)
        deadline_in = None if due is None else round((due - now_ms) / 1000, 3)
        grace = None if due is None else round(max(0, due - beat) / 1000, 3)
        alive = silence < ttl if deadline_in is None else deadline_in >= 0
        on_stage = stage_of.get(name)
        popped = in_flight.get(name, 0)
        worker = WorkerStatus(name, round(silence, 3), on_stage, popped, alive, deadline_in, grace)
        workers.append(worker)
    return SpiderStatus(spider, ttl, dict(sorted(queues.items())), workers)
