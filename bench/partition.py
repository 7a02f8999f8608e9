"""A crawler cut off from Redis: what the other crawlers keep of a capped stage.

    ./run.sh bench partition [--ttl 30] [--cut 20] [--repeat 1] [--smoke]

Three ``scrapy runspider`` processes share one capped stage (detail, cap 3, 100 ms pages) on a fresh
redis-server, each through its own ``testing/netproxy.py`` LatencyProxy (no delay). Once every
process has had detail pages answered, one process's proxy is blackholed for ``--cut`` seconds (its
connections stay open and silent, as in a partition or a VM pause, while Redis and the others go
on), then healed. Printed, from the pages' arrivals at the site: the healthy processes' detail
pages/s before the cut, from one renewal interval after the cut to the heal, and their ratio (the
issue's target: >= 2/3); the most detail requests in flight at the site (the cap: 3); and whether
every process fetched all its pages, each once, and exited 0 (nothing lost, the cut-off one rejoined
without an error).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import add_smoke, write_results
from testing.crawlproc import Crawl
from testing.netproxy import LatencyProxy
from testing.redis_server import RedisServer
from testing.site import CrawlSite

PROCESSES = 3
CAP = 3
PAGE_S = 0.1


def renew_interval(ttl: float) -> float:
    """The renewal loop's interval for ``ttl`` (``LockCore.renew_interval``: a third, at most 1 s)."""
    return min(ttl, 3.0) / 3


def rate(arrivals: list[float], start: float, end: float) -> float:
    """Pages per second that arrived in [start, end)."""
    return sum(start <= t < end for t in arrivals) / (end - start) if end > start else 0.0


def one_round(ttl: float, cut: float, pages: int, folder: Path) -> dict[str, Any]:
    with RedisServer() as server, CrawlSite(delay=PAGE_S) as site:
        proxies = [LatencyProxy(server.port) for _ in range(PROCESSES)]
        try:
            crawls = [
                Crawl(
                    site.url,
                    f"detail:{pages}",
                    {
                        "REDISLOCK_URL": proxy.url,
                        "REDISLOCK_STAGES": {"detail": CAP},
                        "REDISLOCK_TTL": ttl,
                        "CONCURRENT_REQUESTS": 16,
                        "USER_AGENT": f"p{i}",
                    },
                    folder,
                )
                for i, proxy in enumerate(proxies)
            ]
            for crawl in crawls:
                crawl.start()
            deadline = time.monotonic() + 300
            while not all(
                any(s.worker == f"p{i}" and s.stage == "detail" for s in list(site.served))
                for i in range(PROCESSES)
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError("the three crawls did not all start within 300 s")
                time.sleep(0.05)
            warm = time.monotonic()
            # a steady state before the cut, as long as the cut itself at most
            while time.monotonic() < warm + min(cut, 10):
                time.sleep(0.05)
            cut_at = time.monotonic()
            proxies[0].blackhole()
            while time.monotonic() < cut_at + cut:
                time.sleep(0.05)
            healed_at = time.monotonic()
            proxies[0].heal()
            for crawl in crawls:
                crawl.wait(timeout=600)
        finally:
            for proxy in proxies:
                proxy.close()
        healthy = sorted(s.arrived for s in site.served if s.stage == "detail" and s.worker != "p0")
        before = rate(healthy, warm, cut_at)
        during = rate(healthy, cut_at + renew_interval(ttl), healed_at)
        paths = [(s.worker, s.path) for s in site.served if s.stage == "detail"]
        return {
            "before": before,
            "during": during,
            "ratio": during / before if before else 0.0,
            "max_in_flight": site.max_in_flight["detail"],
            "codes": [c.code for c in crawls],
            "finish_reasons": [c.stats.get("finish_reason") for c in crawls],
            "pages": len(paths),
            "distinct": len(set(paths)),
            "expected": pages * PROCESSES,
            "tracebacks": sum("Traceback" in c.output for c in crawls),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--ttl", type=float, default=30.0, help="REDISLOCK_TTL, s")
    parser.add_argument(
        "--cut", type=float, default=20.0, help="how long one process is cut off, s"
    )
    parser.add_argument("--repeat", type=int, default=1)
    add_smoke(parser)
    args = parser.parse_args(argv)
    if args.ttl <= 0 or args.cut <= 0:
        parser.error(f"--ttl and --cut must be > 0, got {args.ttl} and {args.cut}")
    # enough pages that every process still has a backlog when the cut ends
    pages = int((min(args.cut, 10) + args.cut + 10) * CAP / PAGE_S / PROCESSES * 1.5)
    if args.smoke:
        args.ttl, args.cut, args.repeat, pages = 3.0, 2.0, 1, 40
    rounds = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.repeat):
            print(f"round {i + 1}/{args.repeat} ...", file=sys.stderr, flush=True)
            rounds.append(one_round(args.ttl, args.cut, pages, Path(folder)))

    def med(name: str) -> float:
        return statistics.median(r[name] for r in rounds)

    lines = [
        f"3 processes, detail capped at {CAP}, {PAGE_S * 1000:g} ms pages, {pages} each; one cut off "
        f"for {args.cut:g} s at REDISLOCK_TTL {args.ttl:g} s:",
        "| | per round | median |",
        "|---|---|---:|",
        f"| healthy processes' detail pages/s before the cut | "
        f"{[round(r['before'], 1) for r in rounds]} | {med('before'):.1f} |",
        f"| the same, from {renew_interval(args.ttl):g} s after the cut to the heal | "
        f"{[round(r['during'], 1) for r in rounds]} | {med('during'):.1f} |",
        f"| ratio (target >= 0.67) | {[round(r['ratio'], 2) for r in rounds]} | "
        f"{med('ratio'):.2f} |",
        f"| most detail requests in flight at the site (cap {CAP}) | "
        f"{[r['max_in_flight'] for r in rounds]} | {max(r['max_in_flight'] for r in rounds)} |",
        f"| pages fetched / distinct / expected | "
        f"{[(r['pages'], r['distinct'], r['expected']) for r in rounds]} | |",
        f"| exit codes; finish reasons | {[(r['codes'], r['finish_reasons']) for r in rounds]} | |",
        f"| processes that printed a traceback | {[r['tracebacks'] for r in rounds]} | |",
    ]
    text = "\n".join(lines)
    print(text)
    write_results("partition", text, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
