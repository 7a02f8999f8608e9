"""Start-up: how many round trips to Redis a crawl process waits for before its first capped request.

    ./run.sh bench startup [--delay-ms 50] [--repeat 3]

One `scrapy runspider` process, one capped stage (detail, cap 3), one detail request, on a fresh
redis-server reached through a `testing/netproxy.py` LatencyProxy: once on loopback (+0 ms), once
with `--delay-ms` added to every round trip (half each way). The path is timed from the process's
first connection to Redis (accepted by the proxy) to its first capped request reaching the site;
the difference between the two, divided by the added delay, is the round trips on that path (Scrapy's
own work cancels out; TCP's handshakes are not delayed by the proxy, so each new connection's own round
trip is not counted). Beside it, MONITOR's count of the commands the process sent up to its first look
for a slot, a take or a blocking read (client commands: a pipeline's count one each; those scripts run
inside Redis left out), by command. Medians over `--repeat` rounds; prints what it measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import redis

from bench import write_results
from scrapy_redislock._redis import FUNCTION_PREFIX, function_name
from scrapy_redislock.lock.core import lock_scripts
from testing.crawlproc import Crawl
from testing.monitor import Monitor, commands
from testing.netproxy import LatencyProxy
from testing.redis_server import RedisServer
from testing.site import CrawlSite


def one_start(delay_ms: float, folder: Path) -> dict[str, Any]:
    """The path (s) from the first connection to the first capped request, and the commands the
    process sent up to its first look for a slot."""
    with RedisServer() as server, CrawlSite(delay=0.05) as site:
        admin = redis.Redis.from_url(server.url)
        monitor = Monitor(server.port)
        with LatencyProxy(server.port, delay=delay_ms / 2000) as proxy:
            settings = {"REDISLOCK_URL": proxy.url, "REDISLOCK_STAGES": {"detail": 3}}
            crawl = Crawl(site.url, "detail:1", settings, folder).run()
            if crawl.code != 0 or not site.arrivals["detail"]:
                raise RuntimeError(f"crawl failed: {crawl.tail()}")
            path = site.arrivals["detail"][0] - proxy.accepted[0]
        raw = monitor.stop(admin)
        admin.close()
    # the take script as FCALL names it (redislock_<sha1>) and as EVALSHA does (its sha1)
    function = function_name(lock_scripts()["take"])
    take = {function.encode(), function.removeprefix(FUNCTION_PREFIX).encode()}
    sent: Counter[str] = Counter()
    for _, source, args in commands(raw):
        if source == "lua":
            continue
        name = args[0].decode().lower()
        if name in ("echo", "monitor"):
            continue  # the benchmark's own
        sent[name] += 1
        if name == "xreadgroup" or (name in ("evalsha", "fcall") and args[1] in take):
            break  # the first wait for a slot, or the first take
    return {"path_s": path, "commands": dict(sent)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--delay-ms", type=float, default=50.0, help="round trip added, ms")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one round (seconds): it runs and prints its table; its figures are not the "
        "benchmark's",
    )
    args = parser.parse_args(argv)
    if args.delay_ms <= 0:
        parser.error(f"--delay-ms must be > 0, got {args.delay_ms}")
    if args.smoke:
        args.repeat = 1
    rows: dict[float, list[dict[str, Any]]] = {0.0: [], args.delay_ms: []}
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.repeat):
            print(f"round {i + 1}/{args.repeat} ...", file=sys.stderr, flush=True)
            for delay in rows:
                rows[delay].append(one_start(delay, Path(folder)))
    paths = {d: statistics.median(r["path_s"] for r in found) for d, found in rows.items()}
    trips = [
        (slow["path_s"] - fast["path_s"]) * 1000 / args.delay_ms
        for fast, slow in zip(rows[0.0], rows[args.delay_ms], strict=True)
    ]
    sent = rows[args.delay_ms][0]["commands"]
    lines = [
        "| round trip added | first connection -> first capped request at the site, s (median) |",
        "|---:|---:|",
        *(f"| +{d:g} ms | {paths[d]:.3f} |" for d in rows),
        "",
        f"Round trips on the path (difference / {args.delay_ms:g} ms), per round: "
        f"{[round(t, 1) for t in trips]}, median {statistics.median(trips):.1f}",
        f"Commands sent up to the first take or wait for a slot: {sum(sent.values())} "
        f"({', '.join(f'{n} {name}' for name, n in sorted(sent.items(), key=lambda x: -x[1]))})",
    ]
    text = "\n".join(lines)
    print(text)
    write_results("startup", text, {str(d): r for d, r in rows.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
