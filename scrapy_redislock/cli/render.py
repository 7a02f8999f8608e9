"""How the command line shows things: durations, clock times, tables, the status frame, dead
letters."""

from __future__ import annotations

import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from scrapy_redislock._redis import printable
from scrapy_redislock.cli.target import Target
from scrapy_redislock.lock.permit import LIMBO
from scrapy_redislock.lock.status import KEY_LOCK_PREFIX, Grant, Process, StageStatus, wait_reason
from scrapy_redislock.workers.status import DeadLetters, SpiderStatus

# -- rendering -------------------------------------------------------------------------------------


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


def table(
    header: Sequence[str], rows: Sequence[Sequence[object]], numeric: set[int], indent: str = ""
) -> list[str]:
    cells = [list(header)] + [["-" if c is None else printable(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        parts = [
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
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
    lines = [f"{target.safe_url}  prefix {target.prefix!r}  {stamp}", "", *_spider_lines(spiders)]
    if not stages:
        if not keys:
            lines.append(f"no stage locks under prefix {target.prefix!r}")
        return printable("\n".join(lines), keep="\n") + "\n"
    header = ["STAGE", "LIMIT", "HELD", "FREE", "DEBT", "WAITERS", "FENCE", "TTL", "PROCESSES"]
    rows = [_summary_row(s) for s in stages]
    numeric = {1, 2, 3, 4, 5, 6, 7, 8}
    if any(s.group for s in stages):  # cap groups (REDISLOCK_GROUP): which spiders share the cap
        header.insert(1, "GROUP")
        rows = [[row[0], s.group or "-", *row[1:]] for s, row in zip(stages, rows, strict=True)]
        numeric = {i + 1 for i in numeric}
    lines += table(header, rows, numeric=numeric)
    for s in stages:
        lines += ["", *_stage_lines(s, now)]
    lines.append("")
    lines.append("GRANT: fencing token; AGE: since the grant or its last renewal (Redis's clock);")
    lines.append("WAITING: as each process last reported it (at its renewals, every ttl/3)")
    if any(g.holder == LIMBO for s in stages if s.exists for g in s.grants):
        lines.append(
            f"{LIMBO}: slots reserved after a Redis data loss for surviving holders; free after one ttl"
        )
    return printable("\n".join(lines), keep="\n") + "\n"


def _spider_lines(spiders: Sequence[SpiderStatus]) -> list[str]:
    """The worker front's spiders: workers alive and dead, what is queued per stage."""
    lines = []
    for spider in spiders:
        if spider.error:
            lines.append(
                f"spider {spider.spider}: its state in Redis is unreadable: {spider.error}"
            )
            continue
        queued = ", ".join(f"{stage} {n}" for stage, n in spider.queues.items()) or "none"
        lines.append(
            f"spider {spider.spider}: {spider.alive} worker(s) alive, {spider.dead} dead (past the beat they promised); queued: {queued}"  # noqa: E501
        )
        lines += render_dead_workers(spider)
    return [*lines, ""] if spiders else []


def _summary_row(s: StageStatus) -> list[object]:
    if s.error:
        return [s.stage, "unreadable", None, None, None, None, None, None, None]
    if not s.exists:
        return [s.stage, s.limit, None, None, None, None, None, seconds(s.ttl), None]
    counts = [s.held, s.free, s.debt, s.waiters, s.fence]
    return [s.stage, s.limit, *counts, seconds(s.ttl), len(s.processes)]


HOLDER_HEADER = [
    "HOLDER",
    "HOST",
    "PID",
    "SPIDER",
    "STARTED",
    "GRANT",
    "AGE",
    "LEASE LEFT",
    "WAITING",
]


def _stage_lines(s: StageStatus, now: float) -> list[str]:
    """One stage: held of limit, why a request waits, its holders and waiting processes."""
    if s.error:
        return [
            f"{s.label}: its state in Redis is unreadable: {s.error}",
            "  (`reset` or `forget --force` still clear it; `set-limit` rewrites its limit)",
        ]
    if not s.exists:
        return [
            f"{s.label}: its stream is missing in Redis (data loss?); the next process to start or",
            "  renew recreates it",
        ]
    waiting = [p for p in s.processes if p.held == 0 and p.waiting > 0]
    idle = [p for p in s.processes if p.held == 0 and p.waiting == 0]
    lines = [f"{s.label}: {s.held} held of {s.limit}, {s.waiters} waiting"]
    why = wait_reason(s, now).text
    if why:
        lines.append(f"  a request waits because: {why}")
    lines += _holders(s, waiting, now)
    if idle:
        lines.append(f"  + {len(idle)} registered process(es) holding nothing and not waiting")
    return lines


def _holders(s: StageStatus, waiting: list[Process], now: float) -> list[str]:
    if not s.grants and not waiting:
        return ["  no holders"]
    rows = [_grant_row(s, g, now) for g in s.grants]
    rows += [[p.holder, *_who(p, now), None, None, None, p.waiting] for p in waiting]
    return table(HOLDER_HEADER, rows, numeric={2, 5, 6, 7, 8}, indent="  ")


def _who(p: Process | None, now: float) -> list[object]:
    return [p.host, p.pid, p.spider, clock_time(p.started, now)] if p else [None] * 4


def _grant_row(s: StageStatus, g: Grant, now: float) -> list[object]:
    p = s.process(g.holder)
    left = "expired" if g.lease_left < 0 else seconds(g.lease_left)
    return [g.holder, *_who(p, now), g.fence, seconds(g.age), left, p and p.waiting]


def render_dead_workers(spider: SpiderStatus) -> list[str]:
    """One line per dead worker of a spider (the live ones requeue its requests at their next beat;
    ``requeue`` does it now)."""
    lines = []
    for worker in spider.workers:
        if worker.error:
            lines.append(f"  unreadable: worker {worker.worker}: {worker.error}")
            continue
        if worker.alive:
            continue
        late = (
            ""
            if worker.deadline_in is None
            else f", {seconds(-worker.deadline_in)} past its deadline"
        )
        lines.append(
            f"  dead: {worker.worker} (stage {worker.stage or '-'}, {worker.in_flight} request(s) in flight, last beat {seconds(worker.silence)} ago{late}); `requeue {shlex.quote(worker.worker)}` puts its requests back now"  # noqa: E501
        )
    return lines


@dataclass
class Streams:
    stdin: IO[str]
    out: IO[str]
    err: IO[str]

    def say(self, message: str) -> None:
        """One message, its control characters escaped (names in it may come from Redis)."""
        self.out.write(printable(message, keep="\n") + "\n")
        self.out.flush()

    def warn(self, message: str) -> None:
        """A warning on the error stream, escaped as :meth:`say`."""
        self.err.write(printable(message, keep="\n") + "\n")
        self.err.flush()


def render_dead_letters(found: Sequence[DeadLetters], now: float | None = None) -> str:
    """The worker queues' dead letters, if any: entries no worker could load (e.g. pushed by
    hand)."""
    if not found:
        return ""
    now = time.time() if now is None else now
    lines = [
        "",
        "DEAD LETTERS: worker queue entries no worker could load, kept for you (LRANGE to read, DEL to drop)",
    ]
    for spider in found:
        if spider.unread_bytes is not None:
            lines.append(
                f"{spider.spider}: {spider.count} in {spider.key}, not read here: the list holds about {spider.unread_bytes} bytes (`LRANGE {spider.key} 0 0` reads the newest)"  # noqa: E501
            )
            continue
        lines.append(f"{spider.spider}: {spider.count} in {spider.key}, newest first:")
        rows = [
            [d.stage, clock_time(d.time, now), d.worker, d.size, d.error[:60], d.excerpt]
            for d in spider.newest
        ]
        header = ["STAGE", "WHEN", "WORKER", "BYTES", "ERROR", "START"]
        lines += table(header, rows, numeric={3}, indent="  ")
    return printable("\n".join(lines), keep="\n") + "\n"


def never_goes(lock: StageStatus, name: str) -> str | None:
    """Why requests waiting for a stage or scope can never go until an operator acts, if they
    cannot: its limit is 0 (paused). ``name`` is how the operator reads it."""
    if lock.error or lock.limit != 0 or not lock.waiters:
        return None
    return f"paused: {lock.waiters} request(s) wait for {name!r}, whose limit is 0: they go only after `set-limit {lock.stage} N` with N >= 1"  # noqa: E501


KEY_ROWS = 50  # keys listed at most (busiest first); --stage-key narrows the list


def render_keys(keys: Sequence[StageStatus], pattern: str | None = None) -> str:
    """The locks of keys met at run time, one line each, busiest first (only keys in use have a
    lock)."""
    if not keys and pattern is None:
        return ""
    matching = f" matching {pattern!r}" if pattern is not None else ""
    lines = [
        "",
        f"KEYS AND SCOPES (REDISLOCK_STAGE_KEY, REDISLOCK_SCOPES): {len(keys)} in use{matching}, busiest first",
    ]
    rows = [
        [k.stage[len(KEY_LOCK_PREFIX) :], k.limit, k.held, k.waiters, len(k.processes), k.expired]
        if not k.error
        else [k.stage[len(KEY_LOCK_PREFIX) :], "unreadable", None, None, None, None]
        for k in keys[:KEY_ROWS]
    ]
    header, numeric = ["KEY", "LIMIT", "HELD", "WAITING", "PROCESSES", "EXPIRED"], {1, 2, 3, 4, 5}
    if any(k.group for k in keys):
        header.insert(1, "GROUP")
        rows = [[row[0], k.group or "-", *row[1:]] for k, row in zip(keys, rows, strict=False)]
        numeric = {i + 1 for i in numeric}
    if rows:
        lines += table(header, rows, numeric, "  ")
    if len(keys) > KEY_ROWS:
        lines.append(f"  ... and {len(keys) - KEY_ROWS} more (narrow with --stage-key PATTERN)")
    lines += [f"  {why}" for k in keys if (why := never_goes(k, k.stage[len(KEY_LOCK_PREFIX) :]))]
    return printable("\n".join(lines), keep="\n") + "\n"
