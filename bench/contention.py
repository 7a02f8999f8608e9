"""Lock contention benchmark: P processes loop acquire -> hold H ms -> release against one local redis-server.

    ./run.sh bench contention [--processes 12] [--hold-ms 2] [--seconds 5] [--designs ours3,ours1,...] [--quick]

Every design gets a fresh redis-server (testing.redis_server.RedisServer) and fresh spawned processes.
Each process builds its lock, does one warm-up acquire/release (loads scripts, opens connections), reports
ready; when all are ready the stats are reset (CONFIG RESETSTAT) and all start together at one moment on
time.monotonic, which is the same clock in every process on one machine. A process stops asking at the end of
the window; its last ask still completes, so load stays on until the window is over.

Measured per design, over the window:
  grants/s       grants whose acquire returned inside the window, per second;
  utilization    grants/s x H / limit (1.0: the slots never idle; H is the nominal hold, time.sleep(H/1000));
  cmds/grant     sum of ``calls`` in INFO commandstats (Redis counts the commands a Lua script runs too; the
                 benchmark's own INFO and CONFIG calls are left out) / grants in the window;
  wait p50/p99   time from asking to getting, of every ask made in the window;
  Jain           Jain's fairness index of the processes' grant counts (1.0: all equal);
  max overlap    most hold intervals (got, done) open at one instant; "cap exceeded" when above the limit;
  PING           a plain round trip (PING, median), measured by the parent process every PING_EVERY s during the
                 window, i.e. under the same load; with one slot the hand-off (a holder's release call starts ->
                 the next grant received) is also given as a multiple of it.
And where a slot's time goes (second table): the real hold (time.sleep overshoots), the release call, the gap
from a holder's release to the next grant, client and redis-server CPU per grant.

Prints Markdown and writes <out>/contention.md, contention.json and contention.png. Nothing is hard-coded:
every figure is measured in this run on this machine.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import math
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import redis

from bench import RESULTS, add_smoke, write_results
from bench.peers import DESIGNS, Options, available, clock_offset, make_locker
from testing.faultproc import jain, max_overlap
from testing.redis_server import RedisServer

READY_TIMEOUT = 90.0  # s for all processes to start, import and warm up
START_DELAY = 0.1  # s between "all ready" and the start of the window
BUSY_WARNING = 0.2  # CPUs of other work during a window that earn a warning
QUIET_CPUS = 0.1  # --wait-quiet: machine-wide busy CPUs below which a design may start
PING_EVERY = 0.01  # s between two PINGs of the parent during the window


def set_timer_slack(ns: int) -> None:
    """Linux PR_SET_TIMERSLACK: how late the kernel may wake a sleeper (default 50 us); a diagnostic
    knob."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(29, ns, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_TIMERSLACK) failed")


def worker(
    key: str,
    url: str,
    index: int,
    options: Options,
    hold: float,
    seconds: float,
    timer_slack_ns: int | None,
    ready: Any,
    go: Any,
    start_at: Any,
    out: Any,
) -> None:
    """One benchmark process: acquire -> hold -> release until the window ends; sends its
    records."""
    if timer_slack_ns is not None:
        set_timer_slack(timer_slack_ns)
    acquire, release = make_locker(key, redis.Redis.from_url(url), index, options)
    out.put(
        {"index": index, **loop_window(acquire, release, hold, seconds, ready, go, start_at, index)}
    )


def loop_window(
    acquire: Any,
    release: Any,
    hold: float,
    seconds: float,
    ready: Any,
    go: Any,
    start_at: Any,
    tag: Any,
) -> dict[str, Any]:
    """Warm up (before the stats are reset), say ``tag`` is ready, then from the common start
    acquire -> hold -> release until the window ends; the records (asked, got, done, released) and
    the CPU time spent."""
    release(acquire())
    ready.put(tag)
    go.wait()
    start = start_at.value
    end = start + seconds
    time.sleep(max(0.0, start - time.monotonic()))
    records: list[tuple[float, float, float, float]] = []
    cpu0 = time.process_time()
    while True:
        asked = time.monotonic()
        if asked >= end:
            break
        token = acquire()
        got = time.monotonic()
        time.sleep(hold)
        done = time.monotonic()
        release(token)
        records.append((asked, got, done, time.monotonic()))
    return {"records": records, "cpu": time.process_time() - cpu0}


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return float("nan")
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def wait_ready(ready: Any, procs: list[Any], deadline: float) -> None:
    pending = len(procs)
    while pending:
        try:
            ready.get(timeout=0.5)
            pending -= 1
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(
                    f"a benchmark process failed before the start (exit codes {dead})"
                ) from None
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{pending} processes were not ready within {READY_TIMEOUT} s"
                ) from None


def machine_cpu() -> tuple[float, float]:
    """(busy, steal) CPU-seconds of the whole machine so far, from /proc/stat; (nan, nan) without
    /proc."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return float("nan"), float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(f) / os.sysconf("SC_CLK_TCK") for f in fields[:8]
    )
    return user + nice + system + irq + softirq, steal


def wait_quiet(limit_s: float) -> float:
    """Wait up to ``limit_s`` for a second in which the machine is idle (< QUIET_CPUS busy); the
    last busy figure."""
    deadline = time.monotonic() + limit_s
    while True:
        before = machine_cpu()[0]
        time.sleep(1.0)
        busy = machine_cpu()[0] - before
        # "not >=": nan (no /proc) counts as quiet
        if not busy >= QUIET_CPUS or time.monotonic() >= deadline:
            return busy


def ping_until(client: redis.Redis, start: float, end: float) -> list[float]:
    """PING round trips (s) every PING_EVERY s from ``start`` to ``end``: a plain round trip under
    the same load.

    PING is left out of cmds/grant, like the benchmark's other own commands."""
    time.sleep(max(0.0, start - time.monotonic()))
    rtts = []
    while time.monotonic() < end:
        sent = time.perf_counter()
        client.ping()
        rtts.append(time.perf_counter() - sent)
        time.sleep(PING_EVERY)
    return rtts


def server_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def run_design(key: str, args: argparse.Namespace, options: Options) -> dict[str, Any]:
    design = DESIGNS[key]
    hold = args.hold_ms / 1000
    seconds = args.seconds
    ctx = mp.get_context("spawn")
    load_before = os.getloadavg()[0]
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
        start_at = ctx.Value("d", 0.0)
        procs = [
            ctx.Process(
                target=worker,
                args=(
                    key,
                    server.url,
                    i,
                    options,
                    hold,
                    seconds,
                    args.timer_slack_ns,
                    ready,
                    go,
                    start_at,
                    out,
                ),
                daemon=True,
            )
            for i in range(args.processes)
        ]
        for proc in procs:
            proc.start()
        try:
            wait_ready(ready, procs, time.monotonic() + READY_TIMEOUT)
            client.config_resetstat()
            cpu_before = server_cpu(client)
            machine_before = machine_cpu()
            start = time.monotonic() + START_DELAY
            end = start + seconds
            start_at.value = start
            go.set()
            pings = ping_until(client, start, end)
            stats = client.info("commandstats")
            cpu_after = server_cpu(client)
            machine_after = machine_cpu()
            results = [out.get(timeout=seconds + 120) for _ in procs]
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
        version = client.info("server")["redis_version"]
        client.close()
    row = summarize(
        key,
        design.label,
        design.limit,
        hold,
        start,
        end,
        results,
        stats,
        cpu_after - cpu_before,
        version,
    )
    row["ping_p50_ms"] = 1000 * percentile(sorted(pings), 0.5)
    if "handoff_p50_ms" in row:
        row["handoff_per_ping"] = row["handoff_p50_ms"] / row["ping_p50_ms"]
    busy, steal = (
        after - before for after, before in zip(machine_after, machine_before, strict=True)
    )
    # CPU the machine spent on anything but this design's processes and its redis-server (other
    # jobs, the kernel).
    row["other_cpus"] = (busy - row["client_cpu_s"] - row["server_cpu_s"]) / seconds
    row["steal_cpus"] = steal / seconds
    row["loadavg_1m_before"] = load_before
    return row


def summarize(
    key: str,
    label: str,
    limit: int,
    hold: float,
    start: float,
    end: float,
    results: list[dict[str, Any]],
    stats: dict[str, Any],
    server_cpu_s: float,
    version: str,
) -> dict[str, Any]:
    seconds = end - start
    records = [r for res in results for r in res["records"]]
    in_window = [r for r in records if start <= r[1] <= end]
    per_process = [sum(1 for r in res["records"] if start <= r[1] <= end) for res in results]
    grants = len(in_window)
    calls = {
        name.removeprefix("cmdstat_"): int(v["calls"])
        for name, v in stats.items()
        if name not in ("cmdstat_info", "cmdstat_ping") and not name.startswith("cmdstat_config")
    }
    waits = sorted(got - asked for asked, got, _, _ in records)
    holds = sorted(done - got for _, got, done, _ in records)
    releases = sorted(released - done for _, _, done, released in records)
    per_grant = grants or 1
    cycle = limit * seconds / per_grant
    row: dict[str, Any] = {
        "key": key,
        "design": label,
        "limit": limit,
        "redis": version,
        "grants": grants,
        "grants_per_s": grants / seconds,
        "utilization": grants / seconds * hold / limit,
        "cmds_per_grant": sum(calls.values()) / per_grant,
        "wait_p50_ms": 1000 * percentile(waits, 0.50),
        "wait_p99_ms": 1000 * percentile(waits, 0.99),
        "wait_max_ms": 1000 * (waits[-1] if waits else float("nan")),
        "jain": jain(per_process),
        "grants_per_process": sorted(per_process),
        "max_overlap": max_overlap([(got, done) for _, got, done, _ in records]),
        # where a slot's time goes
        "hold_mean_ms": 1000 * statistics.fmean(holds),
        "hold_p99_ms": 1000 * percentile(holds, 0.99),
        "release_mean_ms": 1000 * statistics.fmean(releases),
        "slot_cycle_ms": 1000 * cycle,
        "gap_ms": 1000 * (cycle - statistics.fmean(holds)),
        "occupancy": sum(min(done, end) - max(got, start) for _, got, done, _ in in_window)
        / (limit * seconds),
        "client_cpu_s": sum(res["cpu"] for res in results),
        "server_cpu_s": server_cpu_s,
        "client_cpu_us_per_grant": 1e6 * sum(res["cpu"] for res in results) / max(1, len(records)),
        "server_cpu_us_per_grant": 1e6 * server_cpu_s / per_grant,
        "calls_per_grant": {
            name: n / per_grant for name, n in sorted(calls.items(), key=lambda kv: -kv[1])
        },
    }
    row["cap_exceeded"] = row["max_overlap"] > limit
    if limit == 1:
        # With one slot the grants form a chain: the next grant follows the previous holder's
        # release exactly.
        chain = sorted((got, done) for _, got, done, _ in records)
        handoffs = sorted(
            nxt[0] - prev[1] for prev, nxt in itertools.pairwise(chain) if nxt[0] >= prev[1]
        )
        row["handoff_p50_ms"] = 1000 * percentile(handoffs, 0.5)
        row["handoff_mean_ms"] = 1000 * statistics.fmean(handoffs) if handoffs else float("nan")
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| design | limit | grants/s | utilization | cmds/grant | wait p50 ms | wait p99 ms | Jain "
        "| max overlap |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        overlap = (
            f"**{r['max_overlap']} (cap exceeded)**" if r["cap_exceeded"] else str(r["max_overlap"])
        )
        lines.append(
            f"| {r['design']} | {r['limit']} | {r['grants_per_s']:.0f} | {r['utilization']:.2f} | "
            f"{r['cmds_per_grant']:.1f} | {r['wait_p50_ms']:.2f} | {r['wait_p99_ms']:.1f} | "
            f"{r['jain']:.3f} | {overlap} |"
        )
    return "\n".join(lines)


def time_table(rows: list[dict[str, Any]], hold_ms: float) -> str:
    lines = [
        f"| design | limit | slot cycle ms | real hold ms (nominal {hold_ms:g}) | release call ms | "
        "release -> next grant ms | hand-off p50 ms (x PING) | PING p50 ms | occupancy | client "
        "CPU us/grant | "
        "redis CPU us/grant | other load, CPUs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['design']} | {r['limit']} | {r['slot_cycle_ms']:.2f} | {r['hold_mean_ms']:.2f} | "
            f"{r['release_mean_ms']:.3f} | {r['gap_ms']:.2f} | {handoff(r)} | "
            f"{r['ping_p50_ms']:.3f} | "
            f"{r['occupancy']:.2f} | "
            f"{r['client_cpu_us_per_grant']:.0f} | {r['server_cpu_us_per_grant']:.0f} | "
            f"{r['other_cpus']:.2f} |"
        )
    return "\n".join(lines)


def handoff(row: dict[str, Any]) -> str:
    if "handoff_per_ping" not in row:
        return "-"
    return f"{row['handoff_p50_ms']:.3f} ({row['handoff_per_ping']:.2f}x)"


def report(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    skew = meta["zset_skew_s"]
    offsets = sorted({clock_offset(i, skew) for i in range(meta["processes"])})
    return "\n".join(
        [
            f"# Lock contention, {meta['processes']} processes, hold {meta['hold_ms']:g} ms, "
            f"{meta['seconds']:g} s per design",
            "",
            f"redis-server {meta['redis']} on loopback (fresh server per design); {meta['cpus']} "
            "CPUs, "
            f"{meta['platform']}; Python {meta['python']}, redis-py {meta['redis_py']}; timer "
            "slack "
            f"{'default' if meta['timer_slack_ns'] is None else str(meta['timer_slack_ns']) + ' ns'}.",
            f"zset semaphore client clocks: process i is off by ((i mod 3) - 1) x {skew:g} s, "
            f"i.e. offsets {', '.join(f'{o:+g}' for o in offsets)} s.",
            "cmds/grant counts every command Redis ran, including the ones run inside Lua scripts "
            "(EVALSHA "
            "and each redis.call in it count once each).",
            "",
            table(rows),
            "",
            "Where a slot's time goes (slot cycle = limit x window / grants = real hold + release "
            "-> next grant; "
            "occupancy = share of slot-time with a real hold in progress; other load = CPUs busy "
            "during the "
            "window with anything but this design's processes and its redis-server, from "
            "/proc/stat: other jobs "
            "on the machine disturb the figures when it is well above 0):",
            "",
            time_table(rows, meta["hold_ms"]),
            "",
            *floor_line(rows),
        ]
    )


def floor_line(rows: list[dict[str, Any]]) -> list[str]:
    """Our one-slot hand-off beside the bare token list's (Redis waking a blocked BLPOP), when both
    ran."""
    by_key = {r["key"]: r for r in rows}
    ours, floor = by_key.get("ours1"), by_key.get("floor1")
    if not ours or not floor or "handoff_p50_ms" not in ours or "handoff_p50_ms" not in floor:
        return []
    return [
        f"Hand-off, one slot: ours {ours['handoff_p50_ms']:.3f} ms "
        f"({ours['handoff_per_ping']:.2f}x PING), the bare "
        "token list (LPUSH -> a blocked BLPOP, no Lua, no lease: the floor of any blocking "
        "hand-off) "
        f"{floor['handoff_p50_ms']:.3f} ms ({floor['handoff_per_ping']:.2f}x PING); ours / floor "
        f"{ours['handoff_p50_ms'] / floor['handoff_p50_ms']:.2f}.",
        "",
    ]


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [textwrap.fill(f"{r['design']} (limit {r['limit']})", 34) for r in rows]
    colors = [
        "tab:red"
        if r["cap_exceeded"]
        else ("tab:green" if r["key"].startswith("ours") else "tab:gray")
        for r in rows
    ]
    fig, axes = plt.subplots(1, 3, figsize=(16, 0.6 * len(rows) + 2.2), sharey=True)
    panels = (
        ("utilization", "utilization (grants/s x hold / limit)", False),
        ("wait_p99_ms", "wait p99, ms (log)", True),
        ("cmds_per_grant", "Redis commands per grant", False),
    )
    for ax, (field, heading, log) in zip(axes, panels, strict=True):
        values = [r[field] for r in rows]
        ax.barh(names, values, color=colors)
        if log:
            ax.set_xscale("log")
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.2f}" if v < 10 else f" {v:.0f}", va="center", fontsize=7)
        ax.set_title(heading, fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    axes[0].invert_yaxis()
    fig.suptitle(f"{title}\ngreen: scrapy_redislock, red: cap exceeded, gray: peers", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--processes", type=int, default=12, help="competing processes (default 12)"
    )
    parser.add_argument(
        "--hold-ms", type=float, default=2.0, help="hold time per grant, ms (default 2)"
    )
    parser.add_argument(
        "--seconds", type=float, default=5.0, help="measured window per design (default 5)"
    )
    parser.add_argument(
        "--designs", default=",".join(DESIGNS), help=f"comma list of {', '.join(DESIGNS)}"
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 s window per design, for a smoke run"
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="output directory (default bench/results)"
    )
    parser.add_argument(
        "--zset-skew",
        type=float,
        default=2.0,
        help="client-clock skew of the zset semaphore, s (default 2)",
    )
    parser.add_argument(
        "--timer-slack-ns",
        type=int,
        default=None,
        help="diagnostic: set the processes' Linux timer slack (default: leave the system default)",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help=f"before each design wait up to S s for a second with < {QUIET_CPUS} CPUs busy "
        "(shared machines)",
    )
    add_smoke(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.processes, args.seconds = 3, 0.3
    if args.processes < 1 or args.hold_ms < 0 or args.seconds <= 0:
        parser.error("--processes must be >= 1, --hold-ms >= 0 and --seconds > 0")
    args.keys = [d.strip() for d in args.designs.split(",") if d.strip()]
    unknown = [d for d in args.keys if d not in DESIGNS]
    if unknown:
        parser.error(f"unknown designs {unknown}; known: {', '.join(DESIGNS)}")
    if args.quick and not args.smoke:
        args.seconds = 1.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = Options(zset_skew=args.zset_skew)
    missing = [d for d in args.keys if not available(d)]
    if missing:
        print(
            f"skipping {missing}: package not installed (pip install -e '.[bench]')",
            file=sys.stderr,
        )
    keys = [d for d in args.keys if d not in missing]
    if not keys:
        print("no design to run", file=sys.stderr)
        return 1
    rows = []
    began = time.monotonic()
    for key in keys:
        print(
            f"running {key} ({DESIGNS[key].label}, limit {DESIGNS[key].limit}) ...",
            file=sys.stderr,
            flush=True,
        )
        if args.wait_quiet > 0:
            busy = wait_quiet(args.wait_quiet)
            if busy >= QUIET_CPUS:
                print(
                    f"machine still busy ({busy:.2f} CPUs) after --wait-quiet {args.wait_quiet:g} s",
                    file=sys.stderr,
                )
        row = run_design(key, args, options)
        rows.append(row)
        if row["other_cpus"] > BUSY_WARNING:
            print(
                f"warning: the machine was busy with other work during {key}: "
                f"{row['other_cpus']:.2f} CPUs "
                f"(1-min load average before: {row['loadavg_1m_before']:.1f}); its figures are "
                "disturbed",
                file=sys.stderr,
            )
    meta = {
        "processes": args.processes,
        "hold_ms": args.hold_ms,
        "seconds": args.seconds,
        "zset_skew_s": args.zset_skew,
        "zset_clock_offsets_s": [clock_offset(i, args.zset_skew) for i in range(args.processes)],
        "timer_slack_ns": args.timer_slack_ns,
        "redis": rows[0]["redis"],
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "redis_py": redis.__version__ + (" with hiredis" if redis.utils.HIREDIS_AVAILABLE else ""),
        "options": asdict(options),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "runtime_s": round(time.monotonic() - began, 1),
    }
    text = report(rows, meta)
    print(text)
    write_results("contention", text, {"meta": meta, "rows": rows}, args.out)
    title = (
        f"{args.processes} processes, hold {args.hold_ms:g} ms, {args.seconds:g} s per design, "
        f"redis-server {meta['redis']}, {meta['cpus']} CPUs"
    )
    plot(rows, args.out / "contention.png", title)
    print(f"wrote {args.out / 'contention.md'}, contention.json, contention.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
