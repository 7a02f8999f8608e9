"""Adaptive limits against a site of capacity K: the cluster-wide controller, the best fixed cap,
Scrapy's AutoThrottle, and no control.

    ./run.sh bench adaptive [--processes 3,10] [--capacity 8] [--drop 4] [--phase 30] [--base 0.1]
                            [--fixed 4,6,8,9,12] [--ceiling 32] [--refuse 2.0]

Real ``scrapy runspider`` processes (testing/spiders/crawlspider.py) against testing/capacity.py's
site on one host name: it serves K requests at once, each in ``--base`` seconds, queues the rest
first come first served (the latency grows past K) and answers 503 at once with ``--refuse`` x K
in flight (2K by default; ``--refuse 1.5``: a site with a short queue). The
clock starts when every process has opened its spider; after ``--phase`` seconds the capacity
drops from ``--capacity`` to ``--drop``; after two phases the crawls are stopped. For each number of
processes P, the same crawl under:

- **adaptive**: REDISLOCK_STAGE_KEY = "domain", REDISLOCK_KEY_LIMIT = ``--ceiling``,
  REDISLOCK_ADAPTIVE = ["keys"] (window 1 s, minimum 1): one controller for the cluster;
- **fixed N**: the key capped at N across every process (each of ``--fixed``: the best is the one
  with the most pages/s);
- **AutoThrottle**: Scrapy's AutoThrottle in every process, with its documented defaults (target
  concurrency 1.0 per process, start delay 5 s), Scrapy's default CONCURRENT_REQUESTS_PER_DOMAIN (8);
- **none**: plain Scrapy, CONCURRENT_REQUESTS_PER_DOMAIN 8 in every process.

Measured at the site: pages/s (200 answers per second over both phases), the share of all answers
refused (503) over the whole run, from the first process's first request (the slow start, which
may begin before the last process has opened its spider, included) to the end, the 503 rate of each
phase after it converged, the time-weighted mean requests in flight per second, when it converged
(the first second from which every second of the phase has its mean in flight within [K-2, K+1])
and the most in flight after that; for the adaptive runs the controller's limit over time (its
history in Redis). Prints what it measured; writes bench/results/adaptive.md, adaptive.json and
adaptive.png (in flight over time beside the adaptive limit).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import redis

from bench import RESULTS, add_smoke, write_results
from scrapy_redislock.lock.base import CommandRunner
from scrapy_redislock.lock.permit import LockKeys
from scrapy_redislock.lock.protocol import drive
from testing.adaptivelog import history
from testing.capacity import CapacitySite
from testing.crawlproc import Crawl
from testing.redis_server import RedisServer

HOST = "127.0.0.1"


def options(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/adaptive.py", description=__doc__.split("\n")[0])
    parser.add_argument("--processes", default="3,10", help="comma-separated numbers of processes")
    parser.add_argument("--capacity", type=int, default=8, help="K: requests served at once")
    parser.add_argument("--drop", type=int, default=4, help="the capacity after the first phase")
    parser.add_argument("--phase", type=float, default=30.0, help="seconds of each phase")
    parser.add_argument("--base", type=float, default=0.1, help="seconds a page takes to serve")
    parser.add_argument("--fixed", default="4,6,8,9,12", help="fixed caps to sweep")
    parser.add_argument("--ceiling", type=int, default=32, help="the adaptive limit's ceiling")
    parser.add_argument("--concurrency", type=int, default=16, help="CONCURRENT_REQUESTS")
    parser.add_argument(
        "--refuse", type=float, default=2.0, help="503 with this many times K in flight (>= 1)"
    )
    parser.add_argument("--only", help="comma-separated modes: adaptive, fixed, autothrottle, none")
    add_smoke(parser)
    opts = parser.parse_args(argv)
    if not opts.refuse >= 1.0:
        parser.error(f"--refuse must be at least 1.0, got {opts.refuse!r}")
    if opts.smoke:
        opts.processes, opts.phase, opts.fixed = "2", 2.0, "4"
    return opts


def mode_settings(mode: str, cap: int, redis_url: str, opts: argparse.Namespace) -> dict[str, Any]:
    base: dict[str, Any] = {
        "CONCURRENT_REQUESTS": opts.concurrency,
        "LOG_LEVEL": "INFO",
        "RETRY_ENABLED": False,
    }
    if mode in ("adaptive", "fixed"):
        base.update(
            {
                "REDISLOCK_URL": redis_url,
                "REDISLOCK_STAGES": {"detail": None},
                "REDISLOCK_STAGE_KEY": "domain",
                "REDISLOCK_KEY_LIMIT": cap,
            }
        )
        if mode == "adaptive":
            base["REDISLOCK_ADAPTIVE"] = ["keys"]
        return base
    base.update(
        {
            "DOWNLOADER_MIDDLEWARES": {},
            "SCHEDULER": None,
            "CONCURRENT_REQUESTS_PER_DOMAIN": 8,
            "AUTOTHROTTLE_ENABLED": mode == "autothrottle",
        }
    )
    return base


def seconds_in_flight(samples: list[tuple[float, int]], t0: float, end: float) -> list[float]:
    """Time-weighted mean in flight of each second from ``t0`` to ``end``."""
    means = []
    at, value = t0, 0
    earlier = [v for t, v in samples if t <= t0]
    if earlier:
        value = earlier[-1]
    later = [(t, v) for t, v in samples if t0 < t <= end]
    index = 0
    for second in range(int(end - t0)):
        start, stop = t0 + second, t0 + second + 1
        area, at = 0.0, start
        while index < len(later) and later[index][0] <= stop:
            t, v = later[index]
            area += value * (t - at)
            at, value = t, v
            index += 1
        area += value * (stop - at)
        means.append(area)
    return means


def most_in_flight(samples: list[tuple[float, int]], start: float, stop: float) -> int:
    return max((v for t, v in samples if start <= t <= stop), default=0)


def converged(means: list[float], low: float, high: float) -> int | None:
    """The first second from which every second's mean lies in [low, high]."""
    for first in range(len(means)):
        if all(low <= m <= high for m in means[first:]):
            return first
    return None


def run(
    mode: str, cap: int, processes: int, opts: argparse.Namespace, folder: Path
) -> dict[str, Any]:
    plan = f"detail:{100_000}"
    with (
        RedisServer() as server,
        CapacitySite(capacity=opts.capacity, base=opts.base, refuse=opts.refuse) as site,
    ):
        settings = mode_settings(mode, cap, server.url, opts)
        crawls = [
            Crawl(site.url_of(1), plan, settings, folder, args={"first": str(1_000_000 * i)})
            for i in range(processes)
        ]
        for crawl in crawls:
            crawl.start()
        for crawl in crawls:
            assert crawl.wait_for_output("Spider opened", timeout=120), crawl.tail()
        t0 = time.monotonic()
        wall0 = time.time()
        time.sleep(opts.phase)
        site.set_capacity(opts.drop)
        time.sleep(opts.phase)
        end = time.monotonic()
        for crawl in crawls:
            assert crawl.process is not None
            crawl.process.send_signal(signal.SIGKILL)
        for crawl in crawls:
            assert crawl.process is not None
            crawl.process.wait()
        limits: list[tuple[float, int]] = []
        if mode == "adaptive":
            client = redis.Redis.from_url(server.url)
            keys = LockKeys.of("redislock", f"key:{HOST}")
            limits = [
                (record.at_ms / 1000 - wall0, record.limit)
                for record in reversed(drive(history(keys), CommandRunner(client), "bench"))
            ]
            client.close()
        with site.condition:
            host = site.hosts[HOST]
            samples = list(host.samples)
            ok = [e for _a, _s, e in host.served if t0 <= e <= end]
            rejected = [t for t in host.rejected if t0 <= t <= end]
            # the whole run: every answer since the first request, the start included
            whole_ok = len([e for _a, _s, e in host.served if e <= end])
            whole_rejected = len([t for t in host.rejected if t <= end])
            before = len([t for t in host.rejected if t < t0])
    mid = t0 + opts.phase
    means = seconds_in_flight(samples, t0, end)
    first, second = means[: int(opts.phase)], means[int(opts.phase) :]
    row: dict[str, Any] = {
        "mode": mode if mode != "fixed" else f"fixed {cap}",
        "processes": processes,
        "pages_per_s": round(len(ok) / (end - t0), 1),
        "rate_503": round(len(rejected) / max(1, len(rejected) + len(ok)), 4),
        "rate_503_whole": round(whole_rejected / max(1, whole_rejected + whole_ok), 4),
        "503_whole": whole_rejected,
        "answers_whole": whole_rejected + whole_ok,
        "503_before_t0": before,
    }
    for name, phase_means, k, start, stop in (
        ("k1", first, opts.capacity, t0, mid),
        ("k2", second, opts.drop, mid, end),
    ):
        settled = converged(phase_means, k - 2, k + 1)
        since = start + (settled if settled is not None else len(phase_means))
        answered = [e for e in ok if since <= e <= stop]
        refused = [t for t in rejected if since <= t <= stop]
        row[f"{name}_converged_s"] = settled
        row[f"{name}_mean_in_flight"] = round(sum(phase_means) / max(1, len(phase_means)), 2)
        row[f"{name}_most_after"] = (
            most_in_flight(samples, since, stop) if settled is not None else None
        )
        row[f"{name}_503_after"] = (
            round(len(refused) / max(1, len(refused) + len(answered)), 4)
            if settled is not None
            else None
        )
        row[f"{name}_503_all"] = len([t for t in rejected if start <= t <= stop])
    row["series"] = {
        "in_flight": [round(m, 2) for m in means],
        "limit": [(round(t, 2), limit) for t, limit in limits],
    }
    return row


def table(rows: list[dict[str, Any]], opts: argparse.Namespace) -> list[str]:
    k, drop = opts.capacity, opts.drop
    lines = [
        "## Adaptive limits: `./run.sh bench adaptive`",
        "",
        f"One host of capacity K = {k} (then {drop}), {opts.base * 1000:.0f} ms a page, 503 with "
        f"{opts.refuse:g}K in flight; {opts.phase:.0f} s per phase. Converged: the first second "
        "from which every second's mean in flight at the site is within [K-2, K+1]. 503 rate: of "
        "the answers over both phases; whole run: of every answer, the start before the last "
        "process opened its spider included.",
        "",
        f"| processes | control | pages/s | vs best fixed (any, 503s < 1 %) | 503 rate | "
        f"503 rate, whole run (503s / answers) | "
        f"K={k}: converged after | mean in flight | most after | 503 after | "
        f"K={drop}: converged after | mean in flight | most after | 503 after | 503s in all |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for processes in sorted({r["processes"] for r in rows}):
        mine = [r for r in rows if r["processes"] == processes]
        fixed = [r for r in mine if r["mode"].startswith("fixed")]
        best = max((r["pages_per_s"] for r in fixed), default=None)
        # the best cap a site would agree to: the most pages/s with under 1 % of 503s (whole run)
        polite = max((r["pages_per_s"] for r in fixed if r["rate_503_whole"] < 0.01), default=None)
        for r in mine:
            ratio = " / ".join(f"{r['pages_per_s'] / b:.2f}" if b else "-" for b in (best, polite))

            def show(value: Any, unit: str = "") -> str:
                return "never" if value is None else f"{value}{unit}"

            lines.append(
                f"| {processes} | {r['mode']} | {r['pages_per_s']} | {ratio} | "
                f"{_pct(r['rate_503'])} | "
                f"{_pct(r['rate_503_whole'])} ({r['503_whole']} / {r['answers_whole']}) | "
                f"{show(r['k1_converged_s'], ' s')} | "
                f"{r['k1_mean_in_flight']} | "
                f"{show(r['k1_most_after'])} | {show(_pct(r['k1_503_after']))} | "
                f"{show(r['k2_converged_s'], ' s')} | {r['k2_mean_in_flight']} | "
                f"{show(r['k2_most_after'])} | {show(_pct(r['k2_503_after']))} | "
                f"{r['k1_503_all'] + r['k2_503_all']} |"
            )
    return lines


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{value * 100:.2f} %"


def plot(rows: list[dict[str, Any]], opts: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({r["processes"] for r in rows})
    fig, axes = plt.subplots(len(counts), 1, figsize=(9, 3.2 * len(counts)), squeeze=False)
    for ax, processes in zip(axes[:, 0], counts, strict=True):
        mine = {r["mode"]: r for r in rows if r["processes"] == processes}
        # the best fixed cap a site would agree to (503s under 1 %)
        fixed = [r for m, r in mine.items() if m.startswith("fixed") and r["rate_503_whole"] < 0.01]
        best = max(fixed, key=lambda r: r["pages_per_s"], default=None)
        shown = [m for m in ("adaptive", "autothrottle", "none") if m in mine]
        if best is not None:
            shown.append(best["mode"])
        for mode in shown:
            series = mine[mode]["series"]["in_flight"]
            ax.plot([s + 0.5 for s in range(len(series))], series, label=f"{mode}: in flight")
        if "adaptive" in mine:
            limits = mine["adaptive"]["series"]["limit"]
            if limits:
                ax.step(
                    [t for t, _ in limits],
                    [v for _, v in limits],
                    where="post",
                    color="black",
                    linestyle="--",
                    label="adaptive limit",
                )
        phase = opts.phase
        ax.fill_between([0, phase], opts.capacity - 2, opts.capacity + 1, alpha=0.12, color="green")
        ax.fill_between([phase, 2 * phase], opts.drop - 2, opts.drop + 1, alpha=0.12, color="green")
        ax.set_title(f"{processes} processes; band: [K-2, K+1]")
        ax.set_xlabel("seconds")
        ax.set_ylabel("requests in flight at the site")
        ax.set_xlim(0, 2 * phase)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    opts = options(argv)
    RESULTS.mkdir(exist_ok=True)
    folder = RESULTS / "adaptive-run"
    folder.mkdir(exist_ok=True)
    only = set(opts.only.split(",")) if opts.only else {"adaptive", "fixed", "autothrottle", "none"}
    print(
        f"capacity {opts.capacity} then {opts.drop}, {opts.phase:.0f} s phases; {os.cpu_count()} CPUs"
    )
    started = time.time()
    rows = []
    for processes in (int(p) for p in opts.processes.split(",")):
        runs: list[tuple[str, int]] = []
        if "adaptive" in only:
            runs.append(("adaptive", opts.ceiling))
        if "fixed" in only:
            runs += [("fixed", int(cap)) for cap in opts.fixed.split(",")]
        runs += [(mode, 0) for mode in ("autothrottle", "none") if mode in only]
        for mode, cap in runs:
            row = run(mode, cap, processes, opts, folder)
            print(json.dumps({k: v for k, v in row.items() if k != "series"}), flush=True)
            if row["series"]["limit"]:
                # the controller's limit per window (adapt_log): the start, the probes
                history = " ".join(f"{t:.1f}:{limit}" for t, limit in row["series"]["limit"])
                print(f"limit by window (s since every spider opened: limit): {history}")
            rows.append(row)
    text = "\n".join([*table(rows, opts), f"\nbenchmark wall time {time.time() - started:.0f} s"])
    print()
    print(text)
    write_results("adaptive", text, {"options": vars(opts), "runs": rows})
    plot(rows, opts, RESULTS / "adaptive.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
