"""A fully cached crawl while another process holds every slot of its stage: grants, wall time,
Redis commands.

    ./run.sh bench cache_hits [--pages 15]

Starts its own redis-server and local site. A first crawl (StageScheduler, HTTPCACHE_ENABLED,
``detail`` capped at 3) fills the cache. Then an outsider lock holds the 3 ``detail`` slots, and the
same crawl runs again from the cache, with StageScheduler and with the middleware alone: for each,
the grants it made (``redislock/detail/acquired``), the cache hits, its wall time (process start to
exit, Scrapy's own start-up included), and the Redis commands it sent (INFO commandstats, calls,
outsider's renewals subtracted by running the same interval with no crawl first).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import redis

from bench import add_smoke
from scrapy_redislock import CountingLock
from testing.crawlproc import Crawl
from testing.redis_server import RedisServer
from testing.site import CrawlSite


def calls(client: redis.Redis) -> dict[str, int]:
    return {name: int(stat["calls"]) for name, stat in client.info("commandstats").items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=15)
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        args.pages = 3
    plan = f"detail:{args.pages}"
    with (
        RedisServer() as server,
        CrawlSite(delay=0.05) as site,
        tempfile.TemporaryDirectory() as folder,
    ):
        tmp = Path(folder)
        client = redis.Redis.from_url(server.url)
        base = {
            "REDISLOCK_URL": server.url,
            "REDISLOCK_STAGES": {"detail": 3},
            "HTTPCACHE_ENABLED": True,
            "HTTPCACHE_DIR": str(tmp / "cache"),
        }
        first = Crawl(site.url, plan, base, tmp).run()
        print(
            f"first crawl: {first.stats.get('httpcache/miss')} cache misses, "
            f"{site.count('detail')} pages fetched"
        )
        outsider = CountingLock(client, "detail", limit=3, ttl=3, auto_renew=True)
        for _ in range(3):
            outsider.acquire()
        try:
            for label, scheduler in (
                ("StageScheduler", "scrapy_redislock.StageScheduler"),
                ("middleware alone", None),
            ):
                client.config_resetstat()
                started = time.monotonic()
                crawl = Crawl(site.url, plan, {**base, "SCHEDULER": scheduler}, tmp).run()
                took = time.monotonic() - started
                sent = calls(client)
                # the same interval with the outsider alone, to subtract its renewals
                time.sleep(took)
                idle = calls(client)
                crawl_calls = sum(sent.values()) - (sum(idle.values()) - sum(sent.values()))
                stats = crawl.stats
                print(
                    f"cached crawl, {label}, every slot held by another process: "
                    f"finish_reason={stats.get('finish_reason')} "
                    f"grants={stats.get('redislock/detail/acquired', 0)} "
                    f"cache hits={stats.get('httpcache/hit')} wall time={took:.2f} s "
                    f"Redis commands sent by the crawl={crawl_calls} (start-up and close; none per "
                    "cached page)"
                )
        finally:
            outsider.close()
        print(f"pages fetched from the site in all: {site.count('detail')}")


if __name__ == "__main__":
    main()
