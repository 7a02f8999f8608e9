"""Lock contention benchmark: P processes loop acquire -> hold H ms -> release on one local redis-server.

    ./run.sh bench contention [--processes 12] [--hold-ms 2] [--seconds 5] [--designs ours3,ours1,...]

Reports per design: grants/s, utilization (grants/s x H / limit; 1.0 = the slots never idle), Redis commands per
grant (INFO commandstats, which counts the commands a Lua script runs too), wait p50/p99, Jain's fairness index
over the processes' grant counts, and the most holders seen at once (hold intervals recorded with
time.monotonic, comparable across processes on one machine). Each design gets a fresh redis-server. Prints a
Markdown table and writes bench/results/contention.{md,json,png}. Everything printed is measured in this run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.peers import DESIGNS, available, make_locker
from scrapy_redislock.redis_server import RedisServer

RESULTS = Path(__file__).resolve().parent / "results"


def worker(design: str, url: str, index: int, start_at: float, seconds: float, hold: float, out: Any) -> None:
    acquire, release = make_locker(design, redis.Redis.from_url(url), index)
    waits: list[float] = []
    holds: list[tuple[float, float]] = []
    while time.time() < start_at:
        time.sleep(0.0005)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        asked = time.monotonic()
        token = acquire()
        got = time.monotonic()
        time.sleep(hold)
        done = time.monotonic()
        release(token)
        waits.append(got - asked)
        holds.append((got, done))
    out.put((index, waits, holds))


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda ev: (ev[0], ev[1]))
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def run_design(design: str, processes: int, hold_ms: float, seconds: float) -> dict[str, Any]:
    limit = DESIGNS[design]["limit"]
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        DESIGNS[design]["prepare"](client)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        start_at = time.time() + 2.5  # every process is up and connected by then
        procs = [
            ctx.Process(target=worker, args=(design, server.url, i, start_at, seconds, hold_ms / 1000, out))
            for i in range(processes)
        ]
        for proc in procs:
            proc.start()
        time.sleep(max(0.0, start_at - time.time() - 0.05))
        client.config_resetstat()
        results = [out.get(timeout=seconds + 60) for _ in procs]
        stats = client.info("commandstats")
        for proc in procs:
            proc.join(10)
        version = client.info("server")["redis_version"]
    calls = sum(v["calls"] for k, v in stats.items() if k != "cmdstat_info" and not k.startswith("cmdstat_config"))
    counts = [len(waits) for _, waits, _ in results]
    grants = sum(counts)
    waits = sorted(w for _, ws, _ in results for w in ws)
    overlap = max_overlap([iv for _, _, ivs in results for iv in ivs])
    return {
        "design": DESIGNS[design]["label"],
        "key": design,
        "limit": limit,
        "grants_per_s": grants / seconds,
        "utilization": grants / seconds * hold_ms / 1000 / limit,
        "cmds_per_grant": calls / grants if grants else float("nan"),
        "wait_p50_ms": 1000 * waits[len(waits) // 2],
        "wait_p99_ms": 1000 * waits[min(len(waits) - 1, int(len(waits) * 0.99))],
        "jain": grants**2 / (len(counts) * sum(c * c for c in counts)) if grants else 0.0,
        "max_overlap": overlap,
        "cap_exceeded": overlap > limit,
        "redis": version,
        "hold_median_ms": 1000 * statistics.median(e - s for _, _, ivs in results for s, e in ivs),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| design | limit | grants/s | utilization | cmds/grant | wait p50 ms | wait p99 ms | Jain | max overlap |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        overlap = f"**{r['max_overlap']} (cap exceeded)**" if r["cap_exceeded"] else str(r["max_overlap"])
        lines.append(
            f"| {r['design']} | {r['limit']} | {r['grants_per_s']:.0f} | {r['utilization']:.2f} | "
            f"{r['cmds_per_grant']:.1f} | {r['wait_p50_ms']:.2f} | {r['wait_p99_ms']:.1f} | "
            f"{r['jain']:.3f} | {overlap} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{r['design']}\n(limit {r['limit']})" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, title in zip(
        axes,
        ("utilization", "wait_p99_ms", "cmds_per_grant"),
        ("utilization", "wait p99 (ms)", "commands per grant"),
        strict=True,
    ):
        colors = [
            "tab:red" if r["cap_exceeded"] else ("tab:green" if r["key"].startswith("ours") else "tab:gray")
            for r in rows
        ]
        ax.barh(names, [r[key] for r in rows], color=colors)
        ax.set_title(title)
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle("red: cap exceeded; green: scrapy_redislock")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=12)
    parser.add_argument("--hold-ms", type=float, default=2.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--designs", default=",".join(DESIGNS))
    parser.add_argument("--quick", action="store_true", help="1 s per design, for a smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    designs = [d for d in args.designs.split(",") if d]
    unknown = [d for d in designs if d not in DESIGNS]
    if unknown:
        parser.error(f"unknown designs {unknown}; known: {list(DESIGNS)}")
    missing = [d for d in designs if not available(d)]
    if missing:
        print(f"skipping {missing}: package not installed (pip install -e '.[bench]')", file=sys.stderr)
        designs = [d for d in designs if d not in missing]
    seconds = 1.0 if args.quick else args.seconds
    rows = []
    for design in designs:
        print(f"running {design} ...", file=sys.stderr, flush=True)
        rows.append(run_design(design, args.processes, args.hold_ms, seconds))
    args.out.mkdir(parents=True, exist_ok=True)
    header = (
        f"{args.processes} processes, hold {args.hold_ms:g} ms, {seconds:g} s per design, "
        f"redis-server {rows[0]['redis']} on loopback"
    )
    text = f"{header}\n\n{table(rows)}\n"
    print(text)
    (args.out / "contention.md").write_text(text)
    (args.out / "contention.json").write_text(json.dumps(rows, indent=2))
    plot(rows, args.out / "contention.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
