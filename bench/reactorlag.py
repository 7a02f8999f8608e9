"""Reactor-lag benchmark: how late the reactor runs its timers in a crawl over scrapy-redis's shared
queue, with Redis a few milliseconds away.

    ./run.sh bench reactorlag [--delay-ms 1.0] [--pages 300] [--repeat 1]
    ./run.sh bench reactorlag --smoke     # one short crawl: it runs (not its figures)

One ``scrapy runspider`` process (testing/spiders/crawlspider.py) with StageScheduler over
scrapy-redis's scheduler (SCHEDULER_INNER, its dupefilter, SCHEDULER_PERSIST off), caps detail 3 /
comments unlimited, CONCURRENT_REQUESTS 16, 20 ms pages: ``--pages`` detail requests from start,
each of which yields one comments request. Redis (the queue and the locks) is behind a
testing/netproxy.py LatencyProxy adding ``--delay-ms`` each way. The crawl runs
testing/reactorlag.py's probes: a 10 ms timer re-armed on the reactor from spider_opened to
spider_closed (how late each firing came: max, p99, p50, and how many came more than 1 ms late), and
a count of the commands sent with redis-py's blocking client from the reactor thread. Prints one row
per round; results in bench/results/reactorlag.{md,json}.
"""

from __future__ import annotations

import argparse
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

PAGE_S = 0.02
HEADER = (
    "| round | delay each way | pages | seconds | reactor lag max | p99 | p50 | "
    "firings > 1 ms late | blocking Redis commands on the reactor |"
)


def one_round(delay_ms: float, pages: int, folder: Path) -> dict[str, Any]:
    with RedisServer() as server, CrawlSite(delay=PAGE_S) as site:
        with LatencyProxy(server.port, delay=delay_ms / 1000) as proxy:
            settings = {
                "REDISLOCK_URL": proxy.url,
                "REDIS_URL": proxy.url,
                "REDISLOCK_STAGES": {"detail": 3, "comments": None},
                "REDISLOCK_SCHEDULER_INNER": "scrapy_redis.scheduler.Scheduler",
                "DUPEFILTER_CLASS": "scrapy_redis.dupefilter.RFPDupeFilter",
                "CONCURRENT_REQUESTS": 16,
                "EXTENSIONS": {
                    "testing.spiders.crawlspider.StatsFile": 0,
                    "testing.reactorlag.ReactorLagProbe": 0,
                    "testing.reactorlag.BlockingRedisOnReactor": 0,
                },
            }
            started = time.monotonic()
            crawl = Crawl(
                site.url, f"detail:{pages}", settings, folder, args={"follow": "comments"}
            ).run(timeout=600)
            seconds = time.monotonic() - started
        stats = crawl.stats
        if crawl.code != 0 or stats.get("finish_reason") != "finished":
            raise SystemExit(f"the crawl did not finish cleanly:\n{crawl.tail()}")
        return {
            "delay_ms": delay_ms,
            "pages": sum(site.hits.values()),
            "seconds": round(seconds, 2),
            "max_ms": stats.get("test/reactor_lag/max_ms"),
            "p99_ms": stats.get("test/reactor_lag/p99_ms"),
            "p50_ms": stats.get("test/reactor_lag/p50_ms"),
            "over_1ms": stats.get("test/reactor_lag/over_1ms"),
            "samples": stats.get("test/reactor_lag/samples"),
            "blocking_on_reactor": stats.get("test/redis_blocking_on_reactor"),
            "blocking_sample": stats.get("test/redis_blocking_on_reactor_sample", []),
        }


def row(i: int, r: dict[str, Any]) -> str:
    return (
        f"| {i} | {r['delay_ms']} ms | {r['pages']} | {r['seconds']} | {r['max_ms']} ms | "
        f"{r['p99_ms']} ms | {r['p50_ms']} ms | {r['over_1ms']} of {r['samples']} | "
        f"{r['blocking_on_reactor']} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, default=1.0, help="added to Redis each way")
    parser.add_argument(
        "--pages", type=int, default=300, help="detail pages (each yields one more)"
    )
    parser.add_argument("--repeat", type=int, default=1)
    add_smoke(parser)
    args = parser.parse_args(argv)
    pages, repeat = (30, 1) if args.smoke else (args.pages, args.repeat)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeat):
            print(f"round {i + 1}/{repeat} ...", file=sys.stderr, flush=True)
            rounds.append(one_round(args.delay_ms, pages, Path(tmp)))
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    lines += [row(i + 1, r) for i, r in enumerate(rounds)]
    samples = sorted({name for r in rounds for name in r["blocking_sample"]})
    text = "\n".join(lines)
    if samples:
        text += f"\n\nblocking commands seen on the reactor thread (first of each run): {samples}"
    print(text)
    write_results("reactorlag", text, rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
