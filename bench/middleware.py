"""Middleware benchmark: overhead on an uncapped stage, and how fully a capped stage's slots are used.

    ./run.sh bench middleware [--repeat 5]

1. Overhead: the same crawl of an uncapped stage (20 ms pages, CONCURRENT_REQUESTS 32) with and without
   StageLockMiddleware + StageScheduler; pages/s measured at the server. The two run back to back in each
   round, in alternating order (so a machine that gets busier or quieter during a round favours neither);
   reported: the median of the per-round ratios (with / without) and the ratio of the medians.
2. Utilization: 3 crawler processes on one capped stage (cap 3, 50 ms pages, plenty of queued work); the
   server's time-weighted mean of requests in flight while the stage has work (1 s trimmed at each end).
Real `scrapy runspider` processes against a local HTTP server and a fresh redis-server; prints what it measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.handoff_probe import breakdown
from testing.crawlproc import run_crawl, start_crawl
from testing.redis_server import RedisServer
from testing.site import CrawlSite

RESULTS = Path(__file__).resolve().parent / "results"


def pages_per_second(site: CrawlSite, stage: str) -> float:
    arrivals = sorted(site.arrivals[stage])
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def overhead_run(redis_url: str, pages: int, with_middleware: bool) -> float:
    with CrawlSite(delay=0.02) as site:
        settings: dict[str, Any] = {"CONCURRENT_REQUESTS": 32, "REDISLOCK_URL": redis_url}
        if with_middleware:
            settings["REDISLOCK_STAGES"] = {"comments": None}
        else:
            settings.update(DOWNLOADER_MIDDLEWARES={}, SCHEDULER="scrapy.core.scheduler.Scheduler")
        code, output = run_crawl(site.url, f"comments:{pages}", settings, timeout=300)
        if code != 0 or len(site.arrivals["comments"]) != pages:
            raise RuntimeError(f"crawl failed: {output[-2000:]}")
        return pages_per_second(site, "comments")


def utilization_run(redis_url: str, per_process: int) -> tuple[float, dict[str, float]]:
    """Mean in flight at the site, and the median of each step of a hand-off (see bench/handoff_probe.py)."""
    with CrawlSite(delay=0.05) as site, tempfile.TemporaryDirectory() as probe_dir:
        settings = {
            "CONCURRENT_REQUESTS": 16,
            "REDISLOCK_URL": redis_url,
            "REDISLOCK_STAGES": {"detail": 3},
            "EXTENSIONS": {"bench.handoff_probe.HandoffProbe": 0},
            "HANDOFF_PROBE_DIR": probe_dir,
        }
        crawls = [start_crawl(site.url, f"detail:{per_process}", settings) for _ in range(3)]
        for crawl in crawls:
            crawl.communicate(timeout=600)
        arrivals = sorted(site.arrivals["detail"])
        if site.max_in_flight["detail"] > 3:
            raise RuntimeError(f"cap exceeded: {site.max_in_flight['detail']}")
        start, end = arrivals[0] + 1.0, arrivals[-1] - 1.0
        return site.mean_in_flight("detail", start, end), breakdown(Path(probe_dir), site.served, start, end)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--pages", type=int, default=1500, help="pages per overhead crawl")
    parser.add_argument("--per-process", type=int, default=150, help="capped requests per process")
    args = parser.parse_args(argv)
    with RedisServer() as server:
        plain, capped, means = [], [], []
        steps: dict[str, list[float]] = {}
        for i in range(args.repeat):
            print(f"round {i + 1}/{args.repeat} ...", file=sys.stderr, flush=True)
            for with_middleware in (False, True) if i % 2 == 0 else (True, False):
                pages_per_s = overhead_run(server.url, args.pages, with_middleware=with_middleware)
                (capped if with_middleware else plain).append(pages_per_s)
            mean, medians = utilization_run(server.url, args.per_process)
            means.append(mean)
            for step, ms in medians.items():
                steps.setdefault(step, []).append(ms)
    ratio = statistics.median(capped) / statistics.median(plain)
    paired = [c / p for c, p in zip(capped, plain, strict=True)]
    result = {
        "pages_per_s_without": plain,
        "pages_per_s_with": capped,
        "overhead_ratio_of_medians": ratio,
        "overhead_ratios_per_round": paired,
        "overhead_median_ratio": statistics.median(paired),
        "mean_in_flight_cap3": means,
        "mean_in_flight_median": statistics.median(means),
        "handoff_steps_ms": steps,
    }
    text = (
        f"Overhead (uncapped stage, 20 ms pages, CONCURRENT_REQUESTS 32, {args.pages} pages, {args.repeat} rounds):\n"
        f"  pages/s without the middleware: median {statistics.median(plain):.0f}  {[round(x) for x in plain]}\n"
        f"  pages/s with it:                median {statistics.median(capped):.0f}  {[round(x) for x in capped]}\n"
        f"  ratio per round (with / without): median {statistics.median(paired):.3f}  "
        f"{[round(x, 3) for x in paired]}; ratio of medians: {ratio:.3f}\n"
        f"Utilization (3 processes, cap 3, 50 ms pages, {args.per_process} requests each):\n"
        f"  mean requests in flight at the server: median {statistics.median(means):.2f}  "
        f"{[round(x, 2) for x in means]}\n"
        "  where a slot idles between two requests (median ms per step, one value per round):\n"
        + "".join(f"    {step:<48} {[round(x, 2) for x in values]}\n" for step, values in steps.items())
    )
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "middleware.md").write_text(text)
    (RESULTS / "middleware.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
