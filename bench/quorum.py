"""Quorum lock benchmark: the single-master lock against the quorum lock on N = 3 and 5 masters, in one run.

    ./run.sh bench quorum [--processes 6] [--limits 1,2] [--hold-ms 2] [--seconds 5] [--designs single,quorum3,...]

Each design gets fresh redis-servers (testing.redis_server.RedisServer: one for ``single``, N for ``quorumN``) and
fresh spawned processes that loop acquire -> hold H ms -> release, as bench/contention.py does (same start
protocol, same figures, its ``summarize`` and ``table``). Commands are summed over every master's INFO
commandstats (Lua-internal commands included); cmds/grant divides them by the grants in the window, so the
quorum's retried rounds (a lost round gives its partial grants back and backs off) count against it.

Prints Markdown and writes <out>/quorum.md and quorum.json. Nothing is hard-coded: every figure is measured in
this run on this machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import redis

from bench import add_smoke, write_results
from bench.contention import (
    READY_TIMEOUT,
    RESULTS,
    START_DELAY,
    loop_window,
    server_cpu,
    summarize,
    table,
    wait_ready,
)
from scrapy_redislock import CountingLock, QuorumLockFactory, safe_quorum
from testing.redis_server import RedisServer

LEASE = 30.0  # far longer than a run: nothing expires
DESIGNS = {"single": 1, "quorum3": 3, "quorum5": 5}  # design -> masters


def make_lock(design: str, urls: list[str], limit: int) -> Any:
    if design == "single":
        return CountingLock(redis.Redis.from_url(urls[0]), "bench", limit=limit, ttl=LEASE)
    return QuorumLockFactory(urls).lock("bench", limit, LEASE)


def worker(
    design: str,
    urls: list[str],
    limit: int,
    hold: float,
    seconds: float,
    ready: Any,
    go: Any,
    start_at: Any,
    out: Any,
) -> None:
    """One benchmark process: acquire -> hold -> release until the window ends; sends its
    records."""
    lock = make_lock(design, urls, limit)
    out.put(
        loop_window(lock.acquire, lock.release, hold, seconds, ready, go, start_at, os.getpid())
    )


def merged_commandstats(clients: list[redis.Redis]) -> dict[str, dict[str, int]]:
    """INFO commandstats of every master, calls summed per command."""
    merged: dict[str, dict[str, int]] = {}
    for client in clients:
        for name, value in client.info("commandstats").items():
            merged.setdefault(name, {"calls": 0})["calls"] += int(value["calls"])
    return merged


def run_design(design: str, limit: int, args: argparse.Namespace) -> dict[str, Any]:
    hold, seconds = args.hold_ms / 1000, args.seconds
    ctx = mp.get_context("spawn")
    with ExitStack() as stack:
        servers = [stack.enter_context(RedisServer()) for _ in range(DESIGNS[design])]
        urls = [s.url for s in servers]
        clients = [redis.Redis.from_url(url) for url in urls]
        ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
        start_at = ctx.Value("d", 0.0)
        procs = [
            ctx.Process(
                target=worker,
                args=(design, urls, limit, hold, seconds, ready, go, start_at, out),
                daemon=True,
            )
            for _ in range(args.processes)
        ]
        for proc in procs:
            proc.start()
        try:
            wait_ready(ready, procs, time.monotonic() + READY_TIMEOUT)
            for client in clients:
                client.config_resetstat()
            cpu_before = sum(server_cpu(c) for c in clients)
            start = time.monotonic() + START_DELAY
            end = start + seconds
            start_at.value = start
            go.set()
            time.sleep(max(0.0, end - time.monotonic()))
            stats = merged_commandstats(clients)
            cpu_after = sum(server_cpu(c) for c in clients)
            results = [out.get(timeout=seconds + 120) for _ in procs]
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
        version = clients[0].info("server")["redis_version"]
        for client in clients:
            client.close()
    masters = DESIGNS[design]
    label = (
        "single master"
        if design == "single"
        else f"quorum {safe_quorum(masters, limit)} of {masters}"
    )
    return summarize(
        design, label, limit, hold, start, end, results, stats, cpu_after - cpu_before, version
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument(
        "--limits", default="1,2", help="comma-separated limits to run each design with"
    )
    parser.add_argument("--hold-ms", type=float, default=2.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument(
        "--designs", default=",".join(DESIGNS), help=f"comma-separated, from {','.join(DESIGNS)}"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    add_smoke(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.processes, args.seconds, args.limits = 2, 0.3, "1"
    args.designs = [d for d in args.designs.split(",") if d]
    unknown = [d for d in args.designs if d not in DESIGNS]
    if unknown:
        parser.error(f"--designs: unknown {unknown}; known: {list(DESIGNS)}")
    args.limits = [int(x) for x in args.limits.split(",") if x]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    rows = []
    for limit in args.limits:
        for design in args.designs:
            print(f"running {design}, limit {limit} ...", file=sys.stderr, flush=True)
            rows.append(run_design(design, limit, args))
    meta = {
        "processes": args.processes,
        "hold_ms": args.hold_ms,
        "seconds": args.seconds,
        "redis": rows[0]["redis"],
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "redis_py": redis.__version__,
        "when": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "runtime_s": round(time.monotonic() - began, 1),
    }
    text = "\n".join(
        [
            f"# Quorum lock vs single master, {args.processes} processes, hold {args.hold_ms:g} "
            "ms, "
            f"{args.seconds:g} s per design",
            "",
            table(rows),
            "",
            "Both are FIFO here: the quorum lock's waiters queue at the first master "
            "(docs/lock.md, Quorum lock).",
            "",
            f"redis {meta['redis']}, {meta['cpus']} CPUs, {meta['platform']}, Python "
            f"{meta['python']}, "
            f"redis-py {meta['redis_py']}, {meta['when']}, {meta['runtime_s']} s",
        ]
    )
    print(text)
    write_results("quorum", text, {"meta": meta, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
