"""What the dashboard costs Redis: commands per read (one read every --interval, and one per
/metrics scrape).

    ./run.sh bench dashboard                     # or: python bench/dashboard.py
    python bench/dashboard.py --stages 10 --spiders 2 --workers 20

Starts a fresh redis-server, makes STAGES stage locks each with 2 held slots, SPIDERS
StageWorkerMixin spiders each with WORKERS registered workers (one request in flight each) and 3
stage queues, then times READS calls of ``status.read_all`` (what the dashboard and /metrics run)
and counts the Redis commands they cost with ``INFO commandstats`` (commands inside MULTI/EXEC
counted one by one). Prints what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import redis
import redis.asyncio

from bench import add_smoke
from scrapy_redislock import CountingLock
from scrapy_redislock.cli.status import read_all
from scrapy_redislock.workers.queue import StageQueues
from testing.redis_server import RedisServer

STAGES = ["list", "detail", "comments"]


def commandstats(client: redis.Redis) -> dict[str, int]:
    return {
        name.removeprefix("cmdstat_"): int(stats["calls"])
        for name, stats in client.info("commandstats").items()
    }


async def make_spider(url: str, spider: str, workers: int) -> None:
    client = redis.asyncio.Redis.from_url(url)
    for n in range(workers):
        queues = StageQueues(client, spider, STAGES, ttl=30, worker=f"host:{1000 + n}:w{n}")
        await queues.push_many(
            [(stage, f"{n}-{stage}-{k}", b"request") for stage in STAGES for k in range(2)]
        )
        await queues.beat("detail")
        await queues.pop("detail", 1)
    await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--spiders", type=int, default=1)
    parser.add_argument("--workers", type=int, default=5)
    parser.add_argument("--reads", type=int, default=50)
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        args.stages, args.workers, args.reads = 2, 2, 3
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        locks = []
        for n in range(args.stages):
            lock = CountingLock(redis.Redis.from_url(server.url), f"stage{n}", limit=3, ttl=30)
            lock.acquire()
            lock.acquire()
            locks.append(lock)
        for n in range(args.spiders):
            asyncio.run(make_spider(server.url, f"spider{n}", args.workers))
        stages, spiders = read_all(client, "redislock", 30.0)
        assert len(stages) == args.stages and len(spiders) == args.spiders, (stages, spiders)
        client.config_resetstat()
        before = commandstats(client)
        seconds = []
        for _ in range(args.reads):
            started = time.perf_counter()
            read_all(client, "redislock", 30.0)
            seconds.append(time.perf_counter() - started)
        after = commandstats(client)
        calls = {name: after.get(name, 0) - before.get(name, 0) for name in after}
        calls = {
            name: n for name, n in calls.items() if n and name not in ("config|resetstat", "info")
        }
        total = sum(calls.values())
        print(
            f"redis-server {client.info('server')['redis_version']}; {args.stages} stages (2 slots "
            "held each), "
            f"{args.spiders} spiders x {args.workers} workers, {args.reads} reads"
        )
        print(f"Redis commands per read: {total / args.reads:.1f}")
        for name, n in sorted(calls.items(), key=lambda item: -item[1]):
            print(f"  {name:<16} {n / args.reads:6.1f}")
        print(
            f"time per read: median {statistics.median(seconds) * 1000:.2f} ms, "
            f"max {max(seconds) * 1000:.2f} ms (this process and redis-server on one machine)"
        )
        for lock in locks:
            lock.close()


if __name__ == "__main__":
    main()
