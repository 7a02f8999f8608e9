"""Redis commands per crawled page, for the middleware and for the worker mixin, at 1, 5 and 20 processes.

    ./run.sh bench scale [--processes 1,5,20] [--pages 600] [--quick]

The same crawl at every process count, on a fresh redis-server each time and the local test site (20 ms pages):

- middleware: ``StageLockMiddleware`` + ``StageScheduler`` (tests/crawlspider.py), stages detail (cap 3) and
  comments (uncapped), half the pages each, split evenly over the processes;
- worker mixin: ``StageWorkerMixin`` on a plain Spider (tests/workerspider.py), worker stages detail (at most 3
  workers) and comments (uncapped); every worker yields every page in ``start()`` and the shared dupefilter lets
  one copy through, so the pages are the same at every count; workers close after 1 s with no work anywhere.

Counted from ``INFO commandstats`` over the whole run, start-up and close included: every command Redis ran
(Redis counts the commands a Lua script runs too, so an EVALSHA whose script makes four calls counts five),
the EVALSHA calls among them (one per script call a process sent), and the three most frequent commands. The
table shows how the cost splits into a part per page and a part per process and second (renewals every ttl/3,
the workers' heartbeats and queue looks); it prints what it measured and writes bench/results/scale.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import redis
import scrapy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scrapy_redislock.redis_server import RedisServer
from tests.crawlproc import staged_worker, start_crawl
from tests.crawlsite import CrawlSite

RESULTS = Path(__file__).resolve().parent / "results"
TTL = 3  # REDISLOCK_TTL: renewals every second


def split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def run(front: str, processes: int, pages: int) -> dict[str, Any]:
    """One crawl with ``processes`` processes; the commands Redis ran for it."""
    half = pages // 2
    with RedisServer() as server, CrawlSite(delay=0.02) as site:
        client = redis.Redis.from_url(server.url)
        client.config_resetstat()
        started = time.monotonic()
        if front == "middleware":
            settings = {
                "REDISLOCK_URL": server.url,
                "REDISLOCK_STAGES": {"detail": 3, "comments": None},
                "REDISLOCK_TTL": TTL,
            }
            shares = zip(split(half, processes), split(pages - half, processes), strict=True)
            crawls = [start_crawl(site.url, f"detail:{d},comments:{c}", settings) for d, c in shares]
        else:
            settings = {"REDISLOCK_WORKER_STAGES": {"detail": 3, "comments": None}, "REDISLOCK_TTL": TTL}
            plan = f"detail:{half},comments:{pages - half}"
            crawls = [staged_worker(server.url, site.url, plan, settings) for _ in range(processes)]
        outputs = [crawl.communicate(timeout=900)[0] for crawl in crawls]
        seconds = time.monotonic() - started
        failed = [out[-1500:] for crawl, out in zip(crawls, outputs, strict=True) if crawl.returncode != 0]
        if failed:
            raise RuntimeError(f"{front} x {processes}: a process failed:\n{failed[0]}")
        stats = client.info("commandstats")
        client.close()
        calls = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
        calls.pop("config|resetstat", None)
        calls.pop("info", None)
        fetched = sum(site.hits.values())
        # Middleware processes crawl their own shares (the same paths in each); workers share one set of pages.
        distinct = pages if front == "middleware" else len(site.hits)
        if fetched != pages or distinct != pages:
            raise RuntimeError(f"{front} x {processes}: {fetched} fetches of {distinct} pages, not {pages}")
        capped = site.max_in_flight["detail"]
        total = sum(calls.values())
        return {
            "front": front,
            "processes": processes,
            "pages": fetched,
            "seconds": seconds,
            "commands": total,
            "evalsha": calls.get("evalsha", 0),
            "per_page": total / fetched,
            "evalsha_per_page": calls.get("evalsha", 0) / fetched,
            "per_process_second": total / (processes * seconds),
            "top": sorted(calls.items(), key=lambda kv: -kv[1])[:3],
            "calls": calls,
            "detail_max_in_flight": capped,
        }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| front | processes | pages | wall s | Redis commands | per page | EVALSHA per page | per process-second "
        "| most frequent |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        top = ", ".join(f"{name} {n}" for name, n in r["top"])
        lines.append(
            f"| {r['front']} | {r['processes']} | {r['pages']} | {r['seconds']:.1f} | {r['commands']} | "
            f"{r['per_page']:.1f} | {r['evalsha_per_page']:.2f} | {r['per_process_second']:.1f} | {top} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--processes", default="1,5,20", help="process counts, comma list (default 1,5,20)")
    parser.add_argument("--pages", type=int, default=600, help="pages per crawl, half detail, half comments")
    parser.add_argument("--fronts", default="middleware,workers")
    parser.add_argument("--quick", action="store_true", help="1 and 5 processes, 200 pages: a smoke run")
    args = parser.parse_args(argv)
    counts = [1, 5] if args.quick else [int(n) for n in args.processes.split(",")]
    pages = 200 if args.quick else args.pages
    rows = []
    for front in args.fronts.split(","):
        for processes in counts:
            print(f"{front} x {processes} processes ...", file=sys.stderr, flush=True)
            row = run(front, processes, pages)
            if row["detail_max_in_flight"] > 3 and front == "middleware":
                raise RuntimeError(f"cap exceeded: {row['detail_max_in_flight']} detail requests in flight")
            rows.append(row)
    with RedisServer() as server:
        version = server.version()
    header = (
        f"# Redis commands per crawled page\n\n{pages} pages (half detail, cap 3; half comments, uncapped), 20 ms a "
        f"page, REDISLOCK_TTL {TTL}; redis-server {version}, {platform.platform()}, Scrapy {scrapy.__version__}, "
        f"redis-py {redis.__version__}. Whole runs, start-up and close included.\n"
    )
    text = header + "\n" + table(rows) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scale.md").write_text(text)
    (RESULTS / "scale.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
