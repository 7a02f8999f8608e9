"""Middleware benchmark: overhead on an uncapped stage, how fully a capped stage's slots are used,
and how fairly.

    ./run.sh bench middleware [--repeat 5] [--only overhead,capped,mixed] [--baseline] [--delay-ms 1,5,20]
    ./run.sh bench middleware --smoke     # one short round of each part: it runs (not its figures)

1. Overhead: the same crawl of an uncapped stage (20 ms pages, CONCURRENT_REQUESTS 32) with and
   without StageLockMiddleware + StageScheduler; pages/s measured at the server. The two run back to
   back in each round, in alternating order (so a machine that gets busier or quieter during a round
   favours neither); reported: the median of the per-round ratios (with / without) and the ratio of
   the medians.
2. Capped stage alone: 3 crawler processes on one capped stage (cap 3, 50 ms pages, a backlog in
   each process); the server's time-weighted mean of requests in flight while the stage has work (1
   s trimmed at each end); fairness over the window where all three have a backlog: Jain's index of
   the processes' requests, and the longest time a process with a backlog went without a request
   reaching the site (its starvation).
3. Mixed crawl, as a user's: 3 processes crawl the test shop (list pages -> detail pages -> comment
   pages, 50 ms pages, CONCURRENT_REQUESTS 16 each), caps list 1 / detail 3 / comments unlimited,
   the list pages shared out; the mean of detail requests in flight while detail has work, with
   StageScheduler and with the middleware alone.
Real `scrapy runspider` processes against a local HTTP server and a fresh redis-server; prints what
it measured. With --baseline, parts 2 and 3 also run with REDISLOCK_LOCAL_REUSE = 0 (every slot back
to Redis) in the same rounds, in alternating order. With --delay-ms, parts 2 and 3 also run
StageScheduler with that round trip added to Redis (a testing/netproxy.py LatencyProxy per process);
the ceiling stays on loopback. Every figure is the median over the rounds of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis

from bench import write_results
from bench.ceiling import LocalCap
from bench.handoff_probe import breakdown
from testing.crawlproc import ROOT, Crawl, finish_all, run_crawl
from testing.faultproc import jain
from testing.netproxy import LatencyProxy
from testing.redis_server import RedisServer
from testing.site import CrawlSite, ShopSite

SHOP_SPIDER = ROOT / "testing" / "spiders" / "shopspider.py"
PROCESSES = 3
# s trimmed at each end of a crawl's window (the processes' start-up and last requests); --smoke: less
TRIM = {"full": 1.0, "smoke": 0.25}
# a variant's added round trip to Redis, ms (not a setting: each process gets a LatencyProxy)
DELAY_MS = "delay_ms"
CEILING = "Scrapy alone, no lock (1 in flight per process: its ceiling)"
# The stage held at 1 in flight per process by an in-process semaphore: what Scrapy gives with no
# Redis at all.
CEILING_SETTINGS: dict[str, Any] = {
    "DOWNLOADER_MIDDLEWARES": {
        "scrapy_redislock.StageLockMiddleware": 950,  # for the mixed crawl's list stage (cap 1)
        f"{LocalCap.__module__}.{LocalCap.__name__}": 951,
    },
    "SCHEDULER": "scrapy.core.scheduler.Scheduler",
    "CEILING_STAGE": "detail",
    "CEILING_PER_PROCESS": 1,
}


def pages_per_second(site: CrawlSite, stage: str) -> float:
    arrivals = sorted(site.arrivals[stage])
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def overhead_run(redis_url: str, pages: int, with_middleware: bool) -> float:
    with CrawlSite(delay=0.02) as site:
        settings: dict[str, Any] = {"CONCURRENT_REQUESTS": 32, "REDISLOCK_URL": redis_url}
        if with_middleware:
            settings["REDISLOCK_STAGES"] = {"detail": None, "comments": None}
        else:
            settings.update(DOWNLOADER_MIDDLEWARES={}, SCHEDULER="scrapy.core.scheduler.Scheduler")
        code, output = run_crawl(site.url, f"comments:{pages}", settings, timeout=300)
        if code != 0 or len(site.arrivals["comments"]) != pages:
            raise RuntimeError(f"crawl failed: {output[-2000:]}")
        return pages_per_second(site, "comments")


def fairness(site: CrawlSite, stage: str) -> tuple[float, float]:
    """(Jain's index of the processes' requests while all had a backlog, longest gap in s between
    two requests of one process while it had a backlog). Each process sends its name as
    User-Agent."""
    arrivals: dict[str, list[float]] = defaultdict(list)
    for record in site.served:
        if record.stage == stage:
            arrivals[record.worker].append(record.arrived)
    times = [sorted(found) for found in arrivals.values()]
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    counts = [sum(1 for t in found if start <= t <= end) for found in times]
    longest = max(b - a for found in times for a, b in itertools.pairwise(found))
    return jain(counts), longest


def check_cap(site: CrawlSite, stage: str, cap: int) -> None:
    if site.max_in_flight[stage] > cap:
        raise RuntimeError(f"cap of {stage} exceeded: {site.max_in_flight[stage]} > {cap}")


@contextlib.contextmanager
def redis_urls(redis_url: str, extra: dict[str, Any]) -> Iterator[tuple[list[str], dict[str, Any]]]:
    """Each process's REDISLOCK_URL (Redis itself, or with a variant's DELAY_MS a LatencyProxy of
    its own adding that round trip, half each way), and the variant's settings without DELAY_MS."""
    extra = dict(extra)
    delay_ms = extra.pop(DELAY_MS, 0)
    if not delay_ms:
        yield [redis_url] * PROCESSES, extra
        return
    port = urlsplit(redis_url).port
    assert port is not None
    with contextlib.ExitStack() as stack:
        proxies = [
            stack.enter_context(LatencyProxy(port, delay=delay_ms / 2000)) for _ in range(PROCESSES)
        ]
        yield [proxy.url for proxy in proxies], extra


def utilization_run(
    redis_url: str, per_process: int, folder: Path, variant: dict[str, Any], trim: float
) -> tuple[float, float, float, dict[str, float], dict[str, int]]:
    """Mean in flight at the site, Jain, longest starvation, the median of each step of a hand-off
    (see bench/handoff_probe.py), and the slots passed on locally / granted by Redis."""
    with (
        CrawlSite(delay=0.05) as site,
        tempfile.TemporaryDirectory() as probe_dir,
        redis_urls(redis_url, variant) as (urls, extra),
    ):
        settings = {
            "CONCURRENT_REQUESTS": 16,
            "REDISLOCK_URL": redis_url,
            "REDISLOCK_STAGES": {"detail": 3},
            "EXTENSIONS": {
                "bench.handoff_probe.HandoffProbe": 0,
                "testing.spiders.crawlspider.StatsFile": 0,
            },
            "HANDOFF_PROBE_DIR": probe_dir,
            **extra,
        }
        if "CEILING_STAGE" in extra:
            settings["REDISLOCK_STAGES"] = {"detail": None}
        crawls = [
            Crawl(
                site.url,
                f"detail:{per_process}",
                {**settings, "USER_AGENT": f"p{i}", "REDISLOCK_URL": urls[i]},
                folder,
            )
            for i in range(PROCESSES)
        ]
        client = redis.Redis.from_url(redis_url)
        client.config_resetstat()
        finish_all(crawls, timeout=600)
        calls = sum(
            int(v["calls"]) for k, v in client.info("commandstats").items() if k != "cmdstat_info"
        )
        client.close()
        check_cap(site, "detail", 3)
        arrivals = sorted(site.arrivals["detail"])
        start, end = arrivals[0] + trim, arrivals[-1] - trim
        jain_index, starved = fairness(site, "detail")
        passed = {
            "reused": sum(c.stats.get("redislock/detail/reused", 0) for c in crawls),
            "acquired": sum(c.stats.get("redislock/detail/acquired", 0) for c in crawls),
            "redis_commands": calls,
        }
        steps = (
            {} if "CEILING_STAGE" in extra else breakdown(Path(probe_dir), site.served, start, end)
        )
        return site.mean_in_flight("detail", start, end), jain_index, starved, steps, passed


def mixed_run(
    redis_url: str,
    lists: int,
    with_scheduler: bool,
    folder: Path,
    variant: dict[str, Any],
    trim: float,
) -> tuple[float, float]:
    """Mean detail requests in flight at the shop while detail has work (``trim`` s trimmed at each
    end), and the share of detail slots passed on locally."""
    with (
        ShopSite(lists=lists, details=20, comments=5, delay=0.05) as site,
        redis_urls(redis_url, variant) as (urls, extra),
    ):
        settings: dict[str, Any] = {
            "CONCURRENT_REQUESTS": 16,
            "REDISLOCK_URL": redis_url,
            "REDISLOCK_STAGES": {"list": 1, "detail": 3, "comments": None},
            "EXTENSIONS": {"testing.spiders.crawlspider.StatsFile": 0},
            **extra,
        }
        if not with_scheduler:
            settings["SCHEDULER"] = "scrapy.core.scheduler.Scheduler"
        if "CEILING_STAGE" in extra:
            settings["REDISLOCK_STAGES"] = {"list": 1, "detail": None, "comments": None}
        crawls = [
            Crawl(
                site.url,
                ",".join(map(str, range(i, lists, PROCESSES))),
                {**settings, "REDISLOCK_URL": urls[i]},
                folder,
                spider=SHOP_SPIDER,
            )
            for i in range(PROCESSES)
        ]
        finish_all(crawls, timeout=600)
        for stage, cap in (("list", 1), ("detail", 3)):
            check_cap(site, stage, cap)
        if len(site.arrivals["comments"]) != site.totals["comments"]:
            raise RuntimeError(
                f"comments: {len(site.arrivals['comments'])} of {site.totals['comments']}"
            )
        arrivals = sorted(site.arrivals["detail"])
        reused = sum(c.stats.get("redislock/detail/reused", 0) for c in crawls)
        acquired = sum(c.stats.get("redislock/detail/acquired", 0) for c in crawls)
        mean = site.mean_in_flight("detail", arrivals[0] + trim, arrivals[-1] - trim)
        return mean, reused / max(1, acquired)


def spread(values: list[float], digits: int = 2) -> str:
    return f"median {statistics.median(values):.{digits}f}  {[round(v, digits) for v in values]}"


CAPPED_FIGURES = ("mean", "jain", "starved", "reused", "per_request")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--pages", type=int, default=1500, help="pages per overhead crawl")
    parser.add_argument("--per-process", type=int, default=150, help="capped requests per process")
    parser.add_argument(
        "--lists",
        type=int,
        default=30,
        help="list pages of the mixed crawl's shop (20 details each)",
    )
    parser.add_argument(
        "--only", default="overhead,capped,mixed", help="comma list of parts to run"
    )
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="also run the capped and mixed parts with REDISLOCK_LOCAL_REUSE = 0, in the same "
        "rounds",
    )
    parser.add_argument(
        "--delay-ms",
        default="0",
        help="comma list of round trips added to Redis, ms (each crawl process through a "
        "LatencyProxy of its own, half each way): the capped and mixed parts run StageScheduler at "
        "each (Scrapy's ceiling and the middleware alone on loopback)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one short round of every part (seconds, not minutes): it runs and prints its tables; "
        "its figures are not the benchmark's",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeat, args.pages, args.per_process, args.lists = 1, 300, 40, 3
    trim = TRIM["smoke" if args.smoke else "full"]
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    try:
        delays = sorted({0.0, *(float(d) for d in args.delay_ms.split(",") if d.strip())})
    except ValueError:
        delays = [-1.0]
    if delays[0] < 0:
        parser.error(f"--delay-ms: a comma list of numbers >= 0, got {args.delay_ms!r}")
    variants: dict[str, dict[str, Any]] = {
        ("StageScheduler" if not d else f"StageScheduler, +{d:g} ms a round trip"): {DELAY_MS: d}
        for d in delays
    }
    schedulers = list(variants)
    if args.baseline:
        variants["StageScheduler, REDISLOCK_LOCAL_REUSE 0"] = {"REDISLOCK_LOCAL_REUSE": 0}
    variants[CEILING] = CEILING_SETTINGS
    plain: list[float] = []
    capped: list[float] = []
    figures: dict[str, dict[str, list[float]]] = {
        name: {f: [] for f in CAPPED_FIGURES} for name in variants
    }
    mixed: dict[str, list[float]] = {name: [] for name in [*variants, "middleware alone"]}
    mixed_reused: dict[str, list[float]] = {name: [] for name in mixed}
    # each StageScheduler variant / the ceiling, per round
    ratios: dict[str, dict[str, list[float]]] = {
        part: {name: [] for name in schedulers} for part in ("capped", "mixed")
    }
    steps: dict[str, list[float]] = {}
    with RedisServer() as server, tempfile.TemporaryDirectory() as folder:
        for i in range(args.repeat):
            print(f"round {i + 1}/{args.repeat} ...", file=sys.stderr, flush=True)
            if "overhead" in parts:
                for with_middleware in (False, True) if i % 2 == 0 else (True, False):
                    pages_per_s = overhead_run(
                        server.url, args.pages, with_middleware=with_middleware
                    )
                    (capped if with_middleware else plain).append(pages_per_s)
            order = list(variants) if i % 2 == 0 else list(reversed(variants))
            if "capped" in parts:
                for name in order:
                    mean, jain_index, longest, medians, passed = utilization_run(
                        server.url, args.per_process, Path(folder), variants[name], trim
                    )
                    got = figures[name]
                    got["mean"].append(mean)
                    got["jain"].append(jain_index)
                    got["starved"].append(longest)
                    got["reused"].append(passed["reused"] / max(1, passed["acquired"]))
                    got["per_request"].append(
                        passed["redis_commands"] / (PROCESSES * args.per_process)
                    )
                    if name == "StageScheduler":
                        for step, ms in medians.items():
                            steps.setdefault(step, []).append(ms)
                for name in schedulers:
                    ratios["capped"][name].append(
                        figures[name]["mean"][-1] / figures[CEILING]["mean"][-1]
                    )
            if "mixed" in parts:
                for name in (
                    [*order, "middleware alone"] if i % 2 == 0 else ["middleware alone", *order]
                ):
                    scheduler = name != "middleware alone"
                    extra = variants.get(name, {})
                    mean, reused = mixed_run(
                        server.url, args.lists, scheduler, Path(folder), extra, trim
                    )
                    mixed[name].append(mean)
                    mixed_reused[name].append(reused)
                for name in schedulers:
                    ratios["mixed"][name].append(mixed[name][-1] / mixed[CEILING][-1])
    result: dict[str, Any] = {"rounds": args.repeat}
    text = ""
    if plain:
        ratio = statistics.median(capped) / statistics.median(plain)
        paired = [c / p for c, p in zip(capped, plain, strict=True)]
        result.update(
            pages_per_s_without=plain,
            pages_per_s_with=capped,
            overhead_ratio_of_medians=ratio,
            overhead_ratios_per_round=paired,
            overhead_median_ratio=statistics.median(paired),
        )
        text += (
            f"Overhead (uncapped stage, 20 ms pages, CONCURRENT_REQUESTS 32, {args.pages} pages, "
            f"{args.repeat} rounds):\n"
            f"  pages/s without the middleware: {spread(plain, 0)}\n"
            f"  pages/s with it:                {spread(capped, 0)}\n"
            f"  ratio per round (with / without): {spread(paired, 3)}; ratio of medians: "
            f"{ratio:.3f}\n"
        )
    if "capped" in parts:
        result["capped"] = figures
        result["capped_over_ceiling"] = ratios["capped"]
        result["handoff_steps_ms"] = steps
        text += f"Capped stage alone ({PROCESSES} processes, cap 3, 50 ms pages, {args.per_process} requests each):\n"
        for name, got in figures.items():
            text += (
                f"  {name}:\n"
                f"    mean requests in flight at the server: {spread(got['mean'])}\n"
                "    Jain over the processes' requests (all with a backlog): "
                f"{spread(got['jain'], 3)}\n"
                f"    longest a process with a backlog went without a request at the site, s: "
                f"{spread(got['starved'])}\n"
            )
            if name == CEILING:
                continue
            text += (
                "    share of slots passed on locally (of requests that got one): "
                f"{spread(got['reused'])}\n"
                "    Redis commands per capped request (INFO commandstats, Lua's own included; "
                "start-up, renewals "
                f"and close included): {spread(got['per_request'], 1)}\n"
            )
        text += "".join(
            f"  {name} / Scrapy's ceiling, per round: {spread(values, 3)}\n"
            for name, values in ratios["capped"].items()
        )
        text += "  where a slot idles between two requests (StageScheduler; median ms per step, one value per round):\n"
        text += "".join(
            f"    {step:<48} {[round(x, 2) for x in values]}\n" for step, values in steps.items()
        )
    if "mixed" in parts:
        result["mixed_mean_detail_in_flight"] = mixed
        text += (
            f"Mixed crawl ({PROCESSES} processes, shop of {args.lists} list pages x 20 details x 5 "
            "comments, caps "
            "list 1 / detail 3 / comments unlimited, 50 ms pages, CONCURRENT_REQUESTS 16):\n"
            + "".join(
                f"  mean detail requests in flight, {name}: {spread(v)}\n"
                for name, v in mixed.items()
            )
            + "".join(
                f"  share of detail slots passed on locally, {name}: {spread(v)}\n"
                for name, v in mixed_reused.items()
                if name != CEILING
            )
            + "".join(
                f"  {name} / Scrapy's ceiling, per round: {spread(values, 3)}\n"
                for name, values in ratios["mixed"].items()
            )
        )
        result["mixed_share_reused"] = mixed_reused
        result["mixed_over_ceiling"] = ratios["mixed"]
    text += f"Load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n"
    print(text)
    write_results("middleware", text, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
