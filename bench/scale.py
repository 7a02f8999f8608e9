"""Redis commands per crawled page, for the middleware and for the worker mixin, at 1, 5 and 20
crawler processes.

    ./run.sh bench scale [--quick] [--processes 1,5,20] [--fronts middleware,workers]
    python bench/scale.py --lists 10 --details 30 --comments 2 --delay 0.05 --concurrency 4 --ttl 30

What it measures: how many commands Redis runs per crawled page when the same crawl is shared by 1,
5 or 20 ``scrapy crawl`` processes, to show how the cost grows with the number of processes. Each
run gets a fresh redis-server and a fresh fake shop (``testing/site.py``: list pages -> product
pages -> comment pages, each page answered after ``--delay`` s), so the pages are the same at every
process count:

- middleware: the example project's ``shop_baseline`` spider (a scrapy-redis RedisSpider: one shared
  FIFO request queue and dupefilter in Redis) with ``StageLockMiddleware`` + ``StageScheduler`` over
  scrapy-redis's scheduler, requests in flight capped at list 1, detail 3, comments unlimited. The
  list pages are seeded into the shared request queue. scrapy-redis workers idle until stopped: once
  the site has served every page (and every process has opened its spider) the benchmark stops them
  with SIGTERM, Scrapy's graceful shutdown.
- workers: the example project's ``shop`` spider (StageWorkerMixin over RedisSpider), workers capped
  at list 1, detail 3, comments unlimited; the list pages are seeded as start URLs; workers close by
  themselves (REDISLOCK_IDLE_CLOSE) once the cluster has had no work for ``--idle-close`` s.

All P processes are started at once; on a 2-core machine 20 Scrapy start-ups take seconds, so late
ones may join a crawl that is half done, or only start, find nothing and close. Counted over the
whole run, from the launch to the exit of the last process, start-up and close included:

- from ``INFO commandstats`` (after ``CONFIG RESETSTAT``): every command Redis ran, the commands Lua
  scripts run included (an EVALSHA whose script makes four ``redis.call``\\ s counts five), EVALSHA
  calls, the top 3 commands;
- from ``MONITOR`` (started before the run; Redis 7 shows the commands a script runs as ``[0 lua]``
  lines, right after their EVALSHA): the commands the clients sent ("client commands" = round trips,
  except that each command of a pipeline or MULTI counts one), the commands run inside scripts, and
  per command (scripts by name) which part sent it: the stage slots (counting locks), the worker
  mixin's stage queues, the start-URL feed, scrapy-redis's request queue and dupefilter, connection
  set-up; what made it happen: a request, the clock (renewals, heartbeats, polling) or a process
  starting, closing or changing stage; and when: before the first page request, during the crawl,
  after the last page was served;
- from the site: pages fetched (its hit counter), every page exactly once, the most requests in
  flight per stage (middleware caps) and the most workers with a request of a stage in flight at
  once (worker caps); and Redis is checked for leftovers (held slots, queued or in-flight requests).

Prints a Markdown report and writes it to ``bench/results/scale.md``, everything (per-command calls,
per-process page counts, exit codes) to ``bench/results/scale.json``; the crawl processes' logs go
to ``bench/results/scale-logs/``. MONITOR costs Redis a little CPU per command; the counts are exact
either way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import scrapy
import scrapy_redis

from bench import RESULTS, add_smoke, write_results
from example_project.run import seed
from scrapy_redislock.crawl.epoch import crawl_scripts
from scrapy_redislock.lock.core import lock_scripts
from scrapy_redislock.workers.queue import worker_scripts
from testing.lockstate import request_leftovers, worker_leftovers
from testing.monitor import Monitor, commands
from testing.processes import CrawlProcesses
from testing.redis_server import RedisServer
from testing.site import STAGES, ShopSite, add_shop_arguments

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ROOT / "example_project"
PREFIX = "redislock"
CAPS: dict[str, int | None] = {"list": 1, "detail": 3, "comments": None}
SPIDER = {"middleware": "shop_baseline", "workers": "shop", "scrapy-redis": "shop_baseline"}
# plain scrapy-redis (no caps): the yardstick of the crawls
FRONTS = ("scrapy-redis", "middleware", "workers")
# plain scrapy-redis: the yardstick of the idle phase
IDLE_FRONTS = ("scrapy-redis", "middleware", "workers")
OWN_COMMANDS = ("config|resetstat", "info")  # the benchmark's own, left out of the idle counts
RUN_TIMEOUT = 300.0  # seconds a run may take before its processes are killed
COMPONENTS = (
    "stage slots",
    "stage queues",
    "start URLs",
    "scrapy-redis queue",
    "connection",
    "other",
)
SHORT = {
    "stage slots": "slots",
    "stage queues": "queues",
    "start URLs": "feed",
    "scrapy-redis queue": "scrapy-redis",
    "connection": "conn",
    "other": "other",
}
PHASES = ("before", "crawl", "after")
CONNECTION = {"hello", "ping", "script", "client", "select", "auth", "quit", "echo"}
# What makes an operation happen: a request, the clock (renewals, heartbeats, looks at the queues),
# or a process starting, closing or changing stage. By command or script name; XREADGROUP is the
# middleware's wait for a slot for one request, but the worker mixin's look for a free stage slot.
PER_REQUEST = {
    "release",
    "queue_pop",
    "queue_ack",
    "queue_push",
    "queue_keep",
    "rpop",
    "lpush",
    "sadd",
}
PERIODIC = {
    "maintain",
    "queue_beat",
    "queue_look",
    "llen",
    "hlen",
    "zrange",
    "zrangebyscore",
    "time",
    "lpop",
    "lrange",
    "ltrim",
}
KINDS = ("per request", "periodic", "start, close, stage change")
# Redis 7 names these commands with their sub-command in INFO commandstats ("xinfo|stream").
CONTAINERS = {
    "client",
    "config",
    "xinfo",
    "xgroup",
    "script",
    "object",
    "memory",
    "command",
    "function",
    "acl",
}


# -- reading MONITOR -------------------------------------------------------------------------------


def script_names() -> dict[str, str]:
    """EVALSHA sha -> script name, for every script of the package (redis-py hashes the source as
    sent)."""
    sources = {
        **lock_scripts(),
        **crawl_scripts(),
        **worker_scripts(),
    }
    return {hashlib.sha1(src.encode()).hexdigest(): name for name, src in sources.items()}


def first_key(name: str, args: list[bytes]) -> str | None:
    """The first key a command names (enough to tell which component sent it), None for keyless
    commands."""
    if name in ("evalsha", "eval", "evalsha_ro", "eval_ro"):
        return args[3].decode(errors="replace") if len(args) > 3 and args[2] != b"0" else None
    if name in ("xreadgroup", "xread"):
        upper = [a.upper() for a in args]
        return (
            args[upper.index(b"STREAMS") + 1].decode(errors="replace")
            if b"STREAMS" in upper
            else None
        )
    if "|" in name:  # xinfo|stream KEY, xgroup|create KEY; client|setinfo, script|load have none
        return (
            args[2].decode(errors="replace") if name.split("|")[0] in ("xinfo", "xgroup") else None
        )
    if name in (
        "multi",
        "exec",
        "discard",
        "hello",
        "ping",
        "echo",
        "select",
        "info",
        "time",
        "auth",
        "quit",
    ):
        return None
    return args[1].decode(errors="replace") if len(args) > 1 else None


def component(name: str, key: str | None, spider: str) -> str:
    if key is None:
        return "connection" if name.split("|")[0] in CONNECTION else "other"
    if key.startswith(f"{PREFIX}:{{{spider}}}"):
        return "stage queues"
    if key.startswith(f"{PREFIX}:{{"):
        return "stage slots"
    if key.endswith(":start_urls"):
        return "start URLs"
    if key.startswith(f"{spider}:"):
        return "scrapy-redis queue"
    return "other"


@dataclass
class Traffic:
    """What MONITOR showed: client commands and commands inside scripts, by component, operation and
    phase."""

    # "component/operation" -> commands sent by clients
    client: Counter[str] = field(default_factory=Counter)
    # the same, with the commands their scripts ran
    total: Counter[str] = field(default_factory=Counter)
    in_scripts: Counter[str] = field(default_factory=Counter)  # command -> calls inside scripts
    phases: Counter[str] = field(default_factory=Counter)  # phase -> commands (client + in scripts)
    client_phases: Counter[str] = field(default_factory=Counter)
    clients: int = 0  # connections seen


def command_name(args: list[bytes]) -> str:
    name = args[0].decode(errors="replace").lower()
    if name in CONTAINERS and len(args) > 1:
        name = f"{name}|{args[1].decode(errors='replace').lower()}"
    return name


def parse_monitor(raw: bytes, spider: str, skip: set[str], window: tuple[float, float]) -> Traffic:
    """Tally MONITOR's lines; ``skip``: client addresses of the benchmark itself; ``window``: the
    crawl's first request and last page served (time.time(), the clock MONITOR stamps lines
    with)."""
    shas = script_names()
    traffic = Traffic()
    current = "other/?"  # operation of the last EVALSHA: the lua lines that follow are its commands
    last_of: dict[str, str] = {}  # client -> its last operation (EXEC belongs to what it wrapped)
    # client -> MULTIs not yet attributed (they go to the next command)
    multi_open: Counter[str] = Counter()
    addresses: set[str] = set()
    for stamp, source, args in commands(raw):
        name = command_name(args)
        if source in skip:
            continue
        phase = "before" if stamp < window[0] else "crawl" if stamp <= window[1] else "after"
        traffic.phases[phase] += 1
        if source == "lua":
            traffic.in_scripts[name] += 1
            traffic.total[current] += 1
            continue
        addresses.add(source)
        traffic.client_phases[phase] += 1
        if name == "multi":
            multi_open[source] += 1
            continue
        if name == "exec":
            op = last_of.get(source, "connection/exec")
        else:
            part = component(name, first_key(name, args), spider)
            if name.startswith("eval"):
                sha = args[1].decode(errors="replace").lower() if len(args) > 1 else ""
                op = f"{part}/{shas.get(sha, 'script ' + sha[:8])}"
                current = op
            else:
                op = f"{part}/{name}"
            last_of[source] = op
        opened = multi_open.pop(source, 0)
        traffic.client[op] += 1 + opened
        traffic.total[op] += 1 + opened
    traffic.clients = len(addresses)
    return traffic


# -- one run ---------------------------------------------------------------------------------------


def settings_for(
    front: str, index: int, redis_url: str, opts: argparse.Namespace
) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "REDIS_URL": redis_url,
        "CONCURRENT_REQUESTS": opts.concurrency,
        "REDISLOCK_TTL": opts.ttl,
        "USER_AGENT": f"scale-{front}-{index}",  # the site tells the processes apart by it
        "LOG_LEVEL": "INFO",
        "TELNETCONSOLE_ENABLED": False,
    }
    if front == "middleware":
        settings.update(
            SCHEDULER="scrapy_redislock.StageScheduler",
            REDISLOCK_SCHEDULER_INNER="scrapy_redis.scheduler.Scheduler",
            DOWNLOADER_MIDDLEWARES={"scrapy_redislock.StageLockMiddleware": 950},
            REDISLOCK_STAGES=CAPS,
            MAX_IDLE_TIME_BEFORE_CLOSE=0,  # a scrapy-redis worker idles until it is stopped
        )
    elif front == "scrapy-redis":
        # the example project's shop_baseline, nothing of ours
        settings.update(MAX_IDLE_TIME_BEFORE_CLOSE=0)
    else:
        settings.update(REDISLOCK_WORKER_STAGES=CAPS, REDISLOCK_IDLE_CLOSE=opts.idle_close)
    return settings


def leftovers(client: redis.Redis, front: str) -> dict[str, int]:
    """What the finished crawl left in Redis: held slots, queued and in-flight requests, registered
    workers."""
    if front == "workers":
        return worker_leftovers(client, PREFIX, SPIDER[front], STAGES)
    capped = [stage for stage, cap in CAPS.items() if cap is not None]
    return request_leftovers(client, PREFIX, SPIDER[front], capped if front == "middleware" else [])


def run(front: str, processes: int, opts: argparse.Namespace) -> dict[str, Any]:
    """One crawl of the shop by ``processes`` processes of ``front``; what Redis ran for it, and the
    checks."""
    logs = RESULTS / "scale-logs" / f"{front}-{processes}"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    load = os.getloadavg()[0]
    with (
        RedisServer() as server,
        ShopSite(opts.lists, opts.details, opts.comments, opts.delay) as site,
    ):
        client = redis.Redis.from_url(server.url)
        seed(client, SPIDER[front], site)  # before the count starts
        own = client.client_info()["addr"]
        monitor = Monitor(server.port)
        client.config_resetstat()
        expected = site.expected_paths()
        launched = time.time()
        stopped = False
        with CrawlProcesses(cwd=PROJECT) as crawlers:  # killed on the way out, on error too
            for n in range(processes):
                settings = settings_for(front, n, server.url, opts)
                crawlers.start_crawl(SPIDER[front], settings, log=logs / f"{n}.log")
            while crawlers.running:
                if time.time() - launched > RUN_TIMEOUT:
                    raise TimeoutError(
                        f"{front} x {processes}: processes still running after {RUN_TIMEOUT:.0f} s"
                    )
                # every process has opened its spider (one still starting up would die of a
                # SIGTERM), or has exited
                if (
                    front != "workers"
                    and not stopped
                    and crawl_done(site, expected)
                    and not crawlers.starting()
                ):
                    time.sleep(0.5)  # the last callbacks (they only yield items)
                    crawlers.terminate()
                    stopped = True
                time.sleep(0.05)
        ended = time.time()
        stats = client.info("commandstats")
        raw = monitor.stop(client)
        left = leftovers(client, front)
        client.close()
        with site.lock:
            hits = Counter(site.hits)
            first, last = site.first_request or launched, site.last_served or ended
            max_in_flight = {s: site.max_in_flight[s] for s in STAGES}
            max_workers = {s: site.max_workers[s] for s in STAGES}
    calls = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
    calls["config|resetstat"] = calls.get("config|resetstat", 1) - 1  # the benchmark's own
    calls = {name: n for name, n in calls.items() if n > 0}
    traffic = parse_monitor(raw, SPIDER[front], {own}, (first, last))
    total = sum(calls.values())
    fetched = sum(hits.values())
    per_process = [crawler.logged_count("downloader/response_count") for crawler in crawlers]
    checks = verdicts(front, expected, hits, max_in_flight, max_workers, crawlers.codes, left)
    return {
        "front": front,
        "processes": processes,
        "pages": fetched,
        "expected_pages": len(expected),
        "wall_s": ended - launched,
        "crawl_s": last - first,
        "first_page_after_s": first - launched,
        "process_s": sum((c.exited_at or ended) - c.started_at for c in crawlers),
        "commands": total,
        "evalsha": calls.get("evalsha", 0),
        "client_commands": sum(traffic.client.values()),
        "in_scripts": sum(traffic.in_scripts.values()),
        "monitor_minus_commandstats": sum(traffic.client.values())
        + sum(traffic.in_scripts.values())
        - total,
        "top": sorted(calls.items(), key=lambda kv: -kv[1])[:3],
        "calls": dict(sorted(calls.items(), key=lambda kv: -kv[1])),
        "client_ops": dict(traffic.client.most_common()),
        "ops": dict(traffic.total.most_common()),
        "in_scripts_by_command": dict(traffic.in_scripts.most_common()),
        "phases": {p: traffic.phases[p] for p in PHASES},
        "client_phases": {p: traffic.client_phases[p] for p in PHASES},
        "connections": traffic.clients,
        "pages_per_process": per_process,
        "processes_with_pages": sum(1 for n in per_process if n),
        "max_in_flight": max_in_flight,
        "max_workers": max_workers,
        "exit_codes": crawlers.codes,
        "leftovers": left,
        "checks": checks,
        "ok": all(ok for _, ok in checks),
        "load_before": load,
        "load_after": os.getloadavg()[0],
    }


def crawl_done(site: ShopSite, expected: set[str]) -> bool:
    with site.lock:
        return expected <= set(site.hits) and not any(site.in_flight.values())


def verdicts(
    front: str,
    expected: set[str],
    hits: Counter[str],
    max_in_flight: dict[str, int],
    max_workers: dict[str, int],
    codes: list[int | None],
    left: dict[str, int],
) -> list[tuple[str, bool]]:
    missing = len(expected - set(hits))
    twice = sum(n - 1 for n in hits.values() if n > 1)
    unexpected = len(set(hits) - expected)
    result = [
        (
            f"every page once: {len(expected) - missing}/{len(expected)} fetched, {twice} fetched "
            "again, "
            f"{unexpected} unexpected",
            missing == 0 and twice == 0 and unexpected == 0,
        )
    ]
    seen, unit = (
        (max_in_flight, "requests in flight") if front == "middleware" else (max_workers, "workers")
    )
    for stage, cap in CAPS.items() if front != "scrapy-redis" else ():
        if cap is not None:
            result.append(
                (f"{stage}: at most {seen[stage]} {unit} at once (cap {cap})", seen[stage] <= cap)
            )
    exits = ", ".join(f"{n} x {code}" for code, n in sorted(Counter(codes).items(), key=str))
    result.append((f"exit codes all 0: {exits}", all(c == 0 for c in codes)))
    result.append((f"nothing left in Redis: {left}", not any(left.values())))
    return result


# -- the idle phase --------------------------------------------------------------------------------


def idle_settings(
    front: str, index: int, redis_url: str, opts: argparse.Namespace
) -> dict[str, Any]:
    """An idle process of ``front``: no start URLs, never closes by itself (stopped by the
    benchmark)."""
    if front == "scrapy-redis":
        return {
            "REDIS_URL": redis_url,
            "USER_AGENT": f"scale-idle-{index}",
            "LOG_LEVEL": "INFO",
            "TELNETCONSOLE_ENABLED": False,
            "MAX_IDLE_TIME_BEFORE_CLOSE": 0,
        }
    settings = settings_for(front, index, redis_url, opts)
    # idles until stopped (the example project's settings close after 3 idle seconds)
    if front == "workers":
        settings.update(REDISLOCK_IDLE_CLOSE="None", MAX_IDLE_TIME_BEFORE_CLOSE=0)
    return settings


def idle_ramp(front: str, counts: list[int], opts: argparse.Namespace) -> list[dict[str, Any]]:
    """Idle processes of ``front`` on one fresh Redis, started in waves of ``--wave`` up to each
    count in turn; at each count, every command Redis runs over ``--idle-window`` s (INFO
    commandstats after CONFIG RESETSTAT)."""
    logs_dir = RESULTS / "scale-logs" / f"idle-{front}"
    shutil.rmtree(logs_dir, ignore_errors=True)
    logs_dir.mkdir(parents=True)
    rows: list[dict[str, Any]] = []
    with RedisServer() as server, CrawlProcesses(cwd=PROJECT) as crawlers:
        client = redis.Redis.from_url(server.url)
        try:
            for target in sorted(counts):
                while len(crawlers) < target:
                    for n in range(len(crawlers), min(target, len(crawlers) + opts.wave)):
                        settings = idle_settings(front, n, server.url, opts)
                        crawlers.start_crawl(SPIDER[front], settings, log=logs_dir / f"{n}.log")
                    crawlers.wait_opened(RUN_TIMEOUT)
                time.sleep(opts.settle)  # the last start-ups' own commands are not idle cost
                client.config_resetstat()
                began = time.monotonic()
                time.sleep(opts.idle_window)
                stats = client.info("commandstats")
                window = time.monotonic() - began
                calls = {
                    name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()
                }
                for own in OWN_COMMANDS:
                    calls[own] = calls.get(own, 1) - 1
                calls = {name: n for name, n in calls.items() if n > 0}
                total = sum(calls.values())
                rows.append(
                    {
                        "front": front,
                        "processes": target,
                        "window_s": window,
                        "commands": total,
                        "per_s": total / window,
                        "per_process_s": total / window / target,
                        "calls": dict(sorted(calls.items(), key=lambda kv: -kv[1])),
                        "load": os.getloadavg()[0],
                    }
                )
                print(
                    f"  idle {front} x {target}: {total / window:.1f} commands/s, "
                    f"{total / window / target:.2f} per process",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            codes = crawlers.stop()  # SIGTERM, then SIGKILL after 60 s
            client.close()
    for row in rows:
        row["exit_codes"] = dict(Counter(str(c) for c in codes))
    return rows


def idle_table(rows: list[dict[str, Any]]) -> list[str]:
    counts = sorted({r["processes"] for r in rows})
    fronts = [f for f in IDLE_FRONTS if any(r["front"] == f for r in rows)]
    by = {(r["front"], r["processes"]): r for r in rows}
    lines = [
        "| processes | "
        + " | ".join(f"{f}: per process (total) commands/s" for f in fronts)
        + " |",
        "|---:|" + "---:|" * len(fronts),
    ]
    for n in counts:
        cells = []
        for f in fronts:
            r = by.get((f, n))
            cells.append("" if r is None else f"{r['per_process_s']:.2f} ({r['per_s']:.0f})")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "| front | processes | top commands over the window (calls) |", "|---|---:|---|"]
    for r in rows:
        top = ", ".join(f"{name} {n}" for name, n in list(r["calls"].items())[:5])
        lines.append(f"| {r['front']} | {r['processes']} | {top} |")
    return lines


def idle_plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Redis commands/s against idle processes, total and per process, one line per front."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (total, each) = plt.subplots(1, 2, figsize=(11, 4))
    for front in IDLE_FRONTS:
        mine = sorted(
            (r["processes"], r["per_s"], r["per_process_s"]) for r in rows if r["front"] == front
        )
        if not mine:
            continue
        counts = [m[0] for m in mine]
        total.plot(counts, [m[1] for m in mine], marker="o", label=front)
        each.plot(counts, [m[2] for m in mine], marker="o", label=front)
    total.set(
        xlabel="idle crawler processes",
        ylabel="Redis commands/s (all processes)",
        title="Idle: total",
    )
    each.set(
        xlabel="idle crawler processes",
        ylabel="Redis commands/s per process",
        title="Idle: per process",
    )
    each.set_ylim(bottom=0)
    total.set_ylim(bottom=0)
    for ax in (total, each):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- the report ------------------------------------------------------------------------------------


def main_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| front | processes | pages | wall s | process-s | Redis commands | per page | "
        "scrapy_redislock's per page "
        "| client commands per page | EVALSHA per page | in scripts per page | per process-s "
        "| top 3 commands (calls) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        pages = max(1, r["pages"])
        top = ", ".join(f"{name} {n}" for name, n in r["top"])
        lines.append(
            f"| {r['front']} | {r['processes']} | {r['pages']} | {r['wall_s']:.1f} | "
            f"{r['process_s']:.0f} | "
            f"{r['commands']} | {r['commands'] / pages:.2f} | {ours(r) / pages:.2f} | "
            f"{r['client_commands'] / pages:.2f} | "
            f"{r['evalsha'] / pages:.2f} | {r['in_scripts'] / pages:.2f} | "
            f"{r['commands'] / r['process_s']:.1f} "
            f"| {top} |"
        )
    return lines


def ours(row: dict[str, Any]) -> int:
    """Commands sent by scrapy_redislock: the stage slots and queues, and the worker scheduler's
    start-URL feed."""
    parts = by_component(row["ops"])
    mine = parts["stage slots"] + parts["stage queues"]
    return mine + (parts["start URLs"] if row["front"] == "workers" else 0)


def split_table(rows: list[dict[str, Any]]) -> list[str]:
    """Per page: which part sent the commands (with what their scripts ran), and when."""
    parts = [c for c in COMPONENTS if any(by_component(r["ops"]).get(c) for r in rows)]
    lines = [
        "| front | processes | "
        + " | ".join(parts)
        + " | before 1st page | during crawl | after last page |",
        "|---|---:|" + "---:|" * (len(parts) + 3),
    ]
    for r in rows:
        pages = max(1, r["pages"])
        totals, sent = by_component(r["ops"]), by_component(r["client_ops"])
        cells = [f"{totals.get(c, 0) / pages:.2f} ({sent.get(c, 0) / pages:.2f})" for c in parts]
        cells += [f"{r['phases'][p] / pages:.2f}" for p in PHASES]
        lines.append(f"| {r['front']} | {r['processes']} | " + " | ".join(cells) + " |")
    return lines


def kind(front: str, op: str) -> str:
    name = op.split("/", 1)[1]
    if name == "xreadgroup":
        return KINDS[0] if front == "middleware" else KINDS[1]
    if name == "release" and front == "workers":
        return KINDS[2]  # a worker leaving a capped stage
    return KINDS[0] if name in PER_REQUEST else KINDS[1] if name in PERIODIC else KINDS[2]


def by_kind(front: str, ops: dict[str, int]) -> Counter[str]:
    out: Counter[str] = Counter()
    for op, n in ops.items():
        out[kind(front, op)] += n
    return out


def kind_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| front | processes | per request, per page | periodic, per page | start, close, stage "
        "change, per page "
        "| periodic per process-s | start and close per process |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        pages = max(1, r["pages"])
        totals, sent = by_kind(r["front"], r["ops"]), by_kind(r["front"], r["client_ops"])
        cells = [f"{totals[k] / pages:.2f} ({sent[k] / pages:.2f})" for k in KINDS]
        cells += [
            f"{totals[KINDS[1]] / r['process_s']:.1f}",
            f"{totals[KINDS[2]] / r['processes']:.0f}",
        ]
        lines.append(f"| {r['front']} | {r['processes']} | " + " | ".join(cells) + " |")
    return lines


def by_component(ops: dict[str, int]) -> Counter[str]:
    out: Counter[str] = Counter()
    for op, n in ops.items():
        out[op.split("/", 1)[0]] += n
    return out


def ops_table(rows: list[dict[str, Any]], top: int = 6) -> list[str]:
    lines = [
        "| front | processes | most frequent client commands per page, as part:command (EVALSHA by "
        "script "
        "name, the commands it ran in parentheses; feed = start URLs, conn = connection set-up) |",
        "|---|---:|---|",
    ]
    for r in rows:
        pages = max(1, r["pages"])
        cells = []
        for op, n in list(r["client_ops"].items())[:top]:
            inside = r["ops"].get(op, n) - n
            part, name = op.split("/", 1)
            label = f"{SHORT[part]}:{name}"
            cells.append(
                f"{label} {n / pages:.2f}" + (f" ({inside / pages:.2f})" if inside else "")
            )
        lines.append(f"| {r['front']} | {r['processes']} | " + ", ".join(cells) + " |")
    return lines


def check_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in rows:
        verdict = "ok" if r["ok"] else "FAILED"
        lines.append(
            f"- {r['front']} x {r['processes']}: [{verdict}] "
            + "; ".join(("" if ok else "FAILED: ") + text for text, ok in r["checks"])
            + f"; {r['processes_with_pages']} of {r['processes']} processes fetched pages; first "
            "page "
            f"{r['first_page_after_s']:.1f} s after the launch, crawl {r['crawl_s']:.1f} s; "
            f"{r['connections']} Redis connections; load average {r['load_before']:.2f} before, "
            f"{r['load_after']:.2f} after"
        )
    return lines


def library_state() -> str:
    """The commit the package was measured at, and whether its files had uncommitted changes."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "scrapy_redislock"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "scrapy_redislock (not a git checkout)"
    changes = f", with uncommitted changes in {len(dirty)} of its files" if dirty else ""
    return f"scrapy_redislock at commit {commit}{changes}"


def header(opts: argparse.Namespace, counts: list[int], version: str) -> list[str]:
    pages = opts.lists * (1 + opts.details * (1 + opts.comments))
    return [
        "# Redis commands per crawled page, by number of crawler processes",
        "",
        f"The same shop crawl at every process count ({counts}): {pages} pages ({opts.lists} list "
        "pages x "
        f"{opts.details} products x {opts.comments} comment pages), {opts.delay * 1000:.0f} ms a "
        "page; caps "
        f"{json.dumps(CAPS)} (middleware: requests in flight; workers: workers); "
        "CONCURRENT_REQUESTS "
        f"{opts.concurrency} per process; REDISLOCK_TTL {opts.ttl:g} s; workers' "
        "REDISLOCK_IDLE_CLOSE "
        f"{opts.idle_close:g} s. A fresh redis-server and site per run; all processes started at "
        "once.",
        "",
        "**Whole runs**: from the launch of the processes to the exit of the last one, so Scrapy "
        "start-up, idle "
        "polling, the workers' idle close and the middleware processes' SIGTERM shutdown are "
        "counted. *Redis "
        "commands*: INFO commandstats, commands inside Lua scripts included; *client commands*: "
        "what the clients "
        "sent (MONITOR), each command of a pipeline counted; *in scripts*: commands the scripts "
        "ran; "
        "*scrapy_redislock's*: the commands of the stage slots and queues and of the worker "
        "scheduler's start-URL "
        "feed (the rest is scrapy-redis's request queue, dupefilter and RedisSpider feed, and "
        "connection set-up).",
        "",
        f"Machine: {os.cpu_count()} CPUs, {platform.platform()}, Python "
        f"{platform.python_version()}; redis-server "
        f"{version}, Scrapy {scrapy.__version__}, redis-py {redis.__version__}, scrapy-redis "
        f"{getattr(scrapy_redis, '__version__', '?')}; {library_state()}; "
        f"{time.strftime('%Y-%m-%d %H:%M')}.",
    ]


def report(
    rows: list[dict[str, Any]], opts: argparse.Namespace, counts: list[int], version: str
) -> str:
    lines = header(opts, counts, version)
    lines += ["", *main_table(rows), ""]
    lines += [
        "Where the commands come from, per page: all commands (client commands in parentheses) by "
        "the part that "
        "sent them (stage slots: the counting locks; stage queues: the worker mixin's queues; "
        "start URLs: the "
        "RedisSpider feed; scrapy-redis queue: its request queue and dupefilter; connection: "
        "HELLO, PING, SCRIPT "
        "LOAD; other: TIME), and when Redis ran them:",
        "",
        *split_table(rows),
        "",
        "What makes the commands happen, per page (client commands in parentheses): a request (a "
        "slot grant and "
        "release; a queue push, pop and ack; scrapy-redis's RPOP counts its empty polls too), the "
        "clock (slot "
        "renewals every second, worker beats every ttl/3, the worker loop's looks at the queues "
        "every 0.2 s, "
        "RedisSpider's idle reads of its start URLs every 5 s), or a process starting, closing or "
        "changing stage:",
        "",
        *kind_table(rows),
        "",
        *ops_table(rows),
        "",
        "Checks:",
        "",
        *check_lines(rows),
    ]
    return "\n".join(lines) + "\n"


def options(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/scale.py", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument(
        "--processes", default="1,5,20", help="process counts, comma list (default 1,5,20)"
    )
    parser.add_argument(
        "--fronts", default=",".join(FRONTS), help="middleware,workers (default both)"
    )
    add_shop_arguments(parser, lists=10, details=30, comments=2, delay=0.05)
    parser.add_argument(
        "--concurrency", type=int, default=4, help="CONCURRENT_REQUESTS per process (default 4)"
    )
    parser.add_argument(
        "--ttl", type=float, default=30.0, help="REDISLOCK_TTL (default 30, the library's)"
    )
    parser.add_argument(
        "--idle-close", type=float, default=2.0, help="workers' REDISLOCK_IDLE_CLOSE (default 2)"
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="where scale.md and scale.json go"
    )
    parser.add_argument(
        "--quick", action="store_true", help="processes 1,5 and a 5 x 10 x 2 shop: a smoke run"
    )
    parser.add_argument(
        "--idle",
        default="1,10,50,100",
        help="idle phase: process counts, comma list ('' = none; default 1,10,50,100)",
    )
    parser.add_argument(
        "--idle-fronts", default=",".join(IDLE_FRONTS), help="scrapy-redis,middleware,workers"
    )
    parser.add_argument(
        "--idle-window", type=float, default=10.0, help="seconds counted at each idle count"
    )
    parser.add_argument(
        "--wave", type=int, default=10, help="idle processes started at once (default 10)"
    )
    parser.add_argument(
        "--settle", type=float, default=3.0, help="seconds after the last start-up before counting"
    )
    parser.add_argument(
        "--plot", type=Path, default=ROOT / "docs" / "scale-idle.png", help="the idle phase's plot"
    )
    add_smoke(parser)
    opts = parser.parse_args(argv)
    if opts.smoke:
        opts.processes, opts.lists, opts.details, opts.comments = "1", 2, 3, 1
        opts.idle, opts.idle_window, opts.settle, opts.wave = "1", 1.0, 0.5, 1
        opts.plot = opts.out / "scale-idle.png"  # not the docs' plot
    elif opts.quick:
        opts.processes, opts.lists, opts.details = "1,5", 5, 10
        opts.idle = "1,5"
    unknown = set(filter(None, opts.fronts.split(","))) - set(FRONTS)
    if unknown:
        parser.error(f"unknown fronts {sorted(unknown)}; choose from {list(FRONTS)}")
    unknown = set(filter(None, opts.idle_fronts.split(","))) - set(IDLE_FRONTS)
    if unknown:
        parser.error(f"unknown idle fronts {sorted(unknown)}; choose from {list(IDLE_FRONTS)}")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = options(argv)
    counts = [int(n) for n in opts.processes.split(",") if n]
    idle_counts = [int(n) for n in opts.idle.split(",") if n]
    version = RedisServer().version()
    rows = []
    idle_rows: list[dict[str, Any]] = []
    began = time.monotonic()
    opts.out.mkdir(parents=True, exist_ok=True)
    for front in filter(None, opts.idle_fronts.split(",") if idle_counts else ()):
        print(f"idle {front} up to {max(idle_counts)} processes ...", file=sys.stderr, flush=True)
        idle_rows += idle_ramp(front, idle_counts, opts)
        idle_plot(idle_rows, opts.plot)  # what is measured so far, should a later run be cut off
        (opts.out / "scale-idle.json").write_text(json.dumps(idle_rows, indent=2))
    for front in filter(None, opts.fronts.split(",")):
        for processes in counts:
            print(f"{front} x {processes} processes ...", file=sys.stderr, flush=True)
            row = run(front, processes, opts)
            print(
                f"  {row['pages']} pages, {row['commands']} commands "
                f"({row['commands'] / max(1, row['pages']):.2f} "
                f"per page), {row['wall_s']:.1f} s{'' if row['ok'] else ', CHECKS FAILED'}",
                file=sys.stderr,
                flush=True,
            )
            rows.append(row)
    text = (
        report(rows, opts, counts, version)
        if rows
        else "\n".join(header(opts, counts, version)) + "\n"
    )
    if idle_rows:
        idle_plot(idle_rows, opts.plot)
        text += "\n" + "\n".join(idle_report(idle_rows, opts)) + "\n"
    text += f"\nBenchmark wall time {time.monotonic() - began:.0f} s.\n"
    print(text)
    meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(opts).items()}
    machine = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "redis_server": version,
        "scrapy": scrapy.__version__,
        "redis_py": redis.__version__,
        "scrapy_redis": getattr(scrapy_redis, "__version__", None),
        "library": library_state(),
    }
    everything = {"options": meta, "machine": machine, "runs": rows, "idle": idle_rows}
    write_results("scale", text, everything, opts.out)
    print(
        f"written: {opts.out / 'scale.md'}, {opts.out / 'scale.json'}; logs in "
        f"{RESULTS / 'scale-logs'}"
    )
    return 0 if all(r["ok"] for r in rows) else 1


def idle_report(rows: list[dict[str, Any]], opts: argparse.Namespace) -> list[str]:
    return [
        "## Idle: Redis commands per second with nothing to crawl",
        "",
        "Each front on its own fresh redis-server: idle processes (no start URLs, nothing queued) "
        "started in waves "
        f'of {opts.wave}, each wave waited for until every process logged "Spider opened"; at each '
        "count, "
        f"{opts.settle:g} s after the last start-up, every command Redis ran over "
        f"{opts.idle_window:g} s (INFO "
        "commandstats after CONFIG RESETSTAT, commands inside scripts included, the benchmark's "
        "own left out). "
        "scrapy-redis: the plain RedisSpider with scrapy-redis's scheduler, the yardstick; "
        "middleware: the same "
        "spider with StageLockMiddleware + StageScheduler; workers: the StageWorkerMixin spider. "
        f"Plot: {opts.plot.name}.",
        "",
        *idle_table(rows),
    ]


if __name__ == "__main__":
    sys.exit(main())
