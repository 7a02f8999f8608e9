"""Caps per domain across processes: REDISLOCK_STAGE_KEY against Scrapy's per-process setting.

    ./run.sh bench keys [--processes 3,10] [--domains 100,10000] [--pages 2000] [--cap-per-process 1] [--rounds 3]

Real ``scrapy runspider`` processes (testing/spiders/keyspider.py) against the local site and a fresh
redis-server per run. Page ``n`` belongs to domain ``d<n % domains>`` (``meta["download_slot"]``, so Scrapy's
per-domain settings and REDISLOCK_STAGE_KEY = "download_slot" both see each as a domain); process ``i`` fetches
pages ``i, i + P, ...``. For each number of processes P and of domains D, two crawls of the same pages:

- **redislock**: REDISLOCK_STAGE_KEY = "download_slot", REDISLOCK_KEY_LIMIT = cap (= P x --cap-per-process),
  held across every process, Scrapy's own per-domain limit out of the way;
- **scrapy**: no redislock; CONCURRENT_REQUESTS_PER_DOMAIN = cap / P per process (what one sets today to keep P
  processes under the cap).

Measured: pages/s (pages over the time from the first request's arrival at the site to the last answer), the most
requests of one domain in flight at once (seen by the site), Redis commands per page (INFO commandstats: every
command, those run inside scripts included), the crawl processes' CPU seconds per 1,000 pages (their rusage: a
cost the machine's load does not change, where pages/s on a shared machine moves with it) and Redis memory at the
end: the keys left and their bytes (MEMORY USAGE summed), and INFO memory used_memory less the empty server's
(that includes the Lua scripts loaded and the Lua VM, which are not per key).

Then the delay as the site sees it (``--gap-*``): 3 processes, 8 host names x 90 pages, REDISLOCK_KEY_LIMIT = 3,
REDISLOCK_DELAY = 0.1 s, once on a quiet machine and once beside two CPU burners (``python -c "while True:
pass"``): the smallest and the 1st-percentile gap between two request starts of one host as the site saw them, the
gaps under 95 % of the delay, and what a start cost in Redis (EVALSHA per start: 1 when its key was free, 2 when it
waited; "held back" counts the confirmations that had to wait behind a late start).

Slow domains among fast ones (``--slow-*``): 5 slow domains queued first (8 pages each), then the fast domains'
pages, with StageScheduler and with the middleware alone; slow by the site (``--slow-delay`` a page, cap 1) or,
with ``--slow-kind delay``, by a delay of ``--slow-delay`` between their starts (REDISLOCK_DELAYS, no cap; the site
answers them at once), or with ``--slow-kind rate`` by a rate window of one start per ``--slow-delay`` seconds
(REDISLOCK_SCOPES, no cap): the fast domains' pages/s against the same crawl without the slow ones.

Prints what it measured; writes bench/results/keys.md and keys.json. ``--only caps`` or ``--only gaps`` runs one
part.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis

from bench import RESULTS, add_smoke, write_results
from bench.dashboard import commandstats
from testing.crawlproc import ROOT, Crawl, finish_all
from testing.redis_server import RedisServer
from testing.site import CrawlSite

SPIDER = ROOT / "testing" / "spiders" / "keyspider.py"


def options(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/keys.py", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--processes", default="3,10", help="comma-separated numbers of crawl processes"
    )
    parser.add_argument("--domains", default="100,10000", help="comma-separated numbers of domains")
    parser.add_argument(
        "--pages", type=int, default=2000, help="pages per crawl (at least one per domain)"
    )
    parser.add_argument(
        "--cap-per-process", type=int, default=1, help="cap per domain = processes x this"
    )
    parser.add_argument(
        "--concurrency", type=int, default=16, help="CONCURRENT_REQUESTS per process"
    )
    parser.add_argument("--delay", type=float, default=0.02, help="seconds the site takes per page")
    parser.add_argument(
        "--only", choices=("caps", "slow", "gaps"), help="run one part of the benchmark"
    )
    parser.add_argument(
        "--stage",
        action="store_true",
        help="every request also names a stage (REDISLOCK_STAGES = {'page': None}) and goes "
        "through StageScheduler: a stage and a domain scope per request",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of the caps part (the two modes take turns; medians are reported)",
    )
    parser.add_argument("--slow-processes", default="3", help="processes of the slow-domain runs")
    parser.add_argument("--slow-domains", type=int, default=5, help="slow domains (cap 1 each)")
    parser.add_argument("--slow-delay", type=float, default=1.0, help="seconds a slow page takes")
    parser.add_argument("--slow-pages", type=int, default=8, help="pages per slow domain")
    parser.add_argument(
        "--slow-kind",
        choices=("site", "delay", "rate"),
        default="site",
        help="what makes a slow domain slow: the site (--slow-delay a page, cap 1), a delay "
        "between its starts (REDISLOCK_DELAYS, --slow-delay, no cap) or a rate window "
        "of one start per --slow-delay seconds (REDISLOCK_SCOPES, no cap)",
    )
    parser.add_argument("--fast-domains", type=int, default=1000, help="fast domains beside them")
    parser.add_argument("--fast-pages", type=int, default=6000, help="pages of the fast domains")
    parser.add_argument("--gap-processes", type=int, default=3, help="processes of the gap runs")
    parser.add_argument("--gap-hosts", type=int, default=8, help="host names of the gap runs")
    parser.add_argument("--gap-pages", type=int, default=90, help="pages per host of the gap runs")
    parser.add_argument(
        "--gap-delay", type=float, default=0.1, help="REDISLOCK_DELAY of the gap runs"
    )
    parser.add_argument(
        "--gap-cap", type=int, default=3, help="REDISLOCK_KEY_LIMIT of the gap runs"
    )
    add_smoke(parser)
    opts = parser.parse_args(argv)
    if opts.smoke:
        opts.processes, opts.domains, opts.pages, opts.rounds = "1", "10", 40, 1
        opts.slow_processes, opts.slow_domains, opts.slow_delay, opts.slow_pages = "1", 2, 0.2, 2
        opts.fast_domains, opts.fast_pages = 10, 40
        opts.gap_processes, opts.gap_hosts, opts.gap_pages = 1, 2, 5
    return opts


def run(
    mode: str, processes: int, domains: int, opts: argparse.Namespace, folder: Path
) -> dict[str, Any]:
    pages = max(opts.pages, domains)
    cap = processes * opts.cap_per_process
    with RedisServer() as server, CrawlSite(delay=opts.delay) as site:
        client = redis.Redis.from_url(server.url)
        memory_before = int(client.info("memory")["used_memory"])
        if mode == "redislock":
            settings: dict[str, Any] = {
                "REDISLOCK_URL": server.url,
                "REDISLOCK_STAGE_KEY": "download_slot",
                "REDISLOCK_KEY_LIMIT": cap,
                "CONCURRENT_REQUESTS_PER_DOMAIN": 1000,
                "SCHEDULER": None,
            }
            if opts.stage:
                settings["REDISLOCK_STAGES"] = {"page": None}
                settings["SCHEDULER"] = "scrapy_redislock.StageScheduler"
        else:
            settings = {
                "DOWNLOADER_MIDDLEWARES": {},
                "SCHEDULER": None,
                "CONCURRENT_REQUESTS_PER_DOMAIN": max(1, cap // processes),
            }
        settings.update(
            {"CONCURRENT_REQUESTS": opts.concurrency, "DOWNLOAD_DELAY": 0, "LOG_LEVEL": "WARNING"}
        )
        before = commandstats(client)
        cpu_before = _children_cpu()
        crawls = [
            Crawl(
                site.url,
                "",
                settings,
                folder,
                args={
                    "pages": str(pages),
                    "domains": str(domains),
                    "part": str(i),
                    "parts": str(processes),
                    **({"stage": "page"} if opts.stage else {}),
                },
                spider=SPIDER,
            ).start()
            for i in range(processes)
        ]
        finish_all(crawls, timeout=1800)
        cpu = _children_cpu() - cpu_before  # the crawl processes', reaped by finish_all
        after = commandstats(client)
        commands = sum(after.values()) - sum(before.values()) - 1  # less our INFO
        delta = {name: after[name] - before.get(name, 0) for name in after}
        delta["info"] = delta.get("info", 1) - 1
        top = dict(sorted(((n, v) for n, v in delta.items() if v), key=lambda item: -item[1])[:8])
        with site.lock:
            first = min(r.arrived for r in site.served)
            last = max(r.answered for r in site.served)
            fetched = len(site.served)
        memory = int(client.info("memory")["used_memory"]) - memory_before
        keys = int(client.dbsize())
        key_bytes = sum(int(client.memory_usage(key) or 0) for key in client.scan_iter(count=1000))
        client.close()
    assert fetched == pages and set(site.hits.values()) == {1}, (fetched, pages)
    return {
        "mode": mode,
        "processes": processes,
        "domains": domains,
        "pages": pages,
        "cap": cap,
        "pages_per_s": round(pages / (last - first), 1),
        "max_in_flight_per_domain": max(site.max_in_flight.values()),
        "commands_per_page": round(commands / pages, 2),
        "crawl_cpu_s_per_1000_pages": round(1000 * cpu / pages, 2),
        "redis_used_memory_change_bytes": memory,
        "redis_keys_end": keys,
        "redis_key_bytes_end": key_bytes,
        "commands_per_page_by_name": {name: round(count / pages, 2) for name, count in top.items()},
    }


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's reaped children: the crawl processes' own CPU,
    a cost the machine's load does not change (pages/s on a shared machine it does)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def caps_table(rows: list[dict[str, Any]], rounds: int) -> list[str]:
    """One line per processes, domains and mode: medians over the rounds; the ratio is the median
    of each round's key cap pages/s over Scrapy's in the same round; the rest is the worst round
    (most in flight, commands, keys left)."""
    lines = [
        "## Caps per domain across processes: `./run.sh bench keys`",
        "",
        f"Medians of {rounds} rounds (the two modes take turns in each).",
        "",
        "| processes | domains | pages | cap | how | pages/s (median) | ratio (median of rounds) | "
        "most in flight per domain | commands/page | crawl CPU s per 1000 pages | keys left (bytes) | "
        "used_memory change |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    groups = sorted({(r["processes"], r["domains"]) for r in rows})
    for processes, domains in groups:
        mine = [r for r in rows if (r["processes"], r["domains"]) == (processes, domains)]
        ours = [r for r in mine if r["mode"] == "redislock"]
        theirs = {r["round"]: r for r in mine if r["mode"] == "scrapy"}
        ratios = [
            r["pages_per_s"] / theirs[r["round"]]["pages_per_s"]
            for r in ours
            if r["round"] in theirs
        ]
        for mode, group in (("redislock", ours), ("scrapy", list(theirs.values()))):
            if not group:
                continue
            first = group[0]
            how = (
                "redislock key cap"
                if mode == "redislock"
                else f"Scrapy per process {max(1, first['cap'] // processes)}"
            )
            ratio = f"{statistics.median(ratios):.2f}" if mode == "redislock" and ratios else ""
            lines.append(
                f"| {processes} | {domains} | {first['pages']} | {first['cap']} | {how} | "
                f"{statistics.median(r['pages_per_s'] for r in group):.1f} | {ratio} | "
                f"{max(r['max_in_flight_per_domain'] for r in group)} | "
                f"{max(r['commands_per_page'] for r in group)} | "
                f"{statistics.median(r.get('crawl_cpu_s_per_1000_pages', 0) for r in group):.2f} | "
                f"{max(r['redis_keys_end'] for r in group)} "
                f"({max(r['redis_key_bytes_end'] for r in group)} B) | "
                f"{max(r['redis_used_memory_change_bytes'] for r in group) / 1024:+.0f} KiB |"
            )
    return lines


def slow_run(
    processes: int, slow: bool, scheduler: str | None, opts: argparse.Namespace, folder: Path
) -> dict[str, Any]:
    """One crawl of the fast domains (cap P each), with or without the slow domains (cap 1,
    ``--slow-delay`` a page) queued first: the fast domains' pages/s over their own span."""
    slow_domains = opts.slow_domains if slow else 0
    delays = {f"s{k}": opts.slow_delay for k in range(slow_domains)}
    # slow by REDISLOCK_DELAYS or a rate window, the site answering at once; or by the site
    by_delay = opts.slow_kind in ("delay", "rate")
    rated = opts.slow_kind == "rate"
    with (
        RedisServer() as server,
        CrawlSite(delay=opts.delay, delays={} if by_delay else delays) as site,
    ):
        settings = {
            "REDISLOCK_URL": server.url,
            "REDISLOCK_STAGE_KEY": "download_slot",
            "REDISLOCK_KEY_LIMIT": processes,
            # a delayed or rate-limited slow domain has no cap (its requests would wait for it)
            "REDISLOCK_KEY_LIMITS": dict.fromkeys(delays, None if by_delay else 1),
            "REDISLOCK_DELAYS": delays if by_delay and not rated else {},
            "REDISLOCK_SCOPES": {name: {"rate": [1, gap]} for name, gap in delays.items()}
            if rated
            else {},
            "CONCURRENT_REQUESTS_PER_DOMAIN": 1000,
            "CONCURRENT_REQUESTS": opts.concurrency,
            "SCHEDULER": scheduler,
            "DOWNLOAD_DELAY": 0,
            "LOG_LEVEL": "WARNING",
        }
        args = {
            "pages": str(opts.fast_pages),
            "domains": str(opts.fast_domains),
            "slow": str(slow_domains),
            "slow_pages": str(opts.slow_pages),
            "parts": str(processes),
        }
        crawls = [
            Crawl(site.url, "", settings, folder, args={**args, "part": str(i)}, spider=SPIDER)
            for i in range(processes)
        ]
        for crawl in crawls:
            crawl.start()
        finish_all(crawls, timeout=1800)
        with site.lock:
            fast = [r for r in site.served if r.stage.startswith("d")]
            slowest = [r for r in site.served if r.stage.startswith("s")]
        taken_in_downloader = sum(
            crawl.stats.get("redislock/keys/taken_in_downloader", 0) for crawl in crawls
        )
    span = max(r.answered for r in fast) - min(r.arrived for r in fast)
    return {
        "processes": processes,
        "scheduler": "StageScheduler" if scheduler else "middleware alone",
        "slow_kind": opts.slow_kind,
        "slow_delay": opts.slow_delay,
        "slow_domains": slow_domains,
        "slow_pages": len(slowest),
        "fast_pages": len(fast),
        "fast_pages_per_s": round(len(fast) / span, 1),
        "max_in_flight_slow": max((site.max_in_flight[d] for d in delays), default=0),
        "taken_in_downloader": taken_in_downloader,
    }


def slow_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "## Slow domains among fast ones",
        "",
        "| processes | scheduler | slow domains (cap 1; or a delay) | slow pages | fast pages | fast pages/s | "
        "ratio to no slow domains | most in flight of a slow domain | key slots taken in the "
        "downloader |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    alone = {
        (r["processes"], r["scheduler"]): r["fast_pages_per_s"]
        for r in rows
        if not r["slow_domains"]
    }
    for r in rows:
        base = alone.get((r["processes"], r["scheduler"]))
        ratio = f"{r['fast_pages_per_s'] / base:.2f}" if base else ""
        kind = {
            "delay": f" (delay {r['slow_delay']} s)",
            "rate": f" (rate 1/{r['slow_delay']} s)",
        }.get(r.get("slow_kind", "site"), "")
        lines.append(
            f"| {r['processes']} | {r['scheduler']} | {r['slow_domains']}{kind} | {r['slow_pages']} | "
            f"{r['fast_pages']} | {r['fast_pages_per_s']} | {ratio} | {r['max_in_flight_slow']} | "
            f"{r['taken_in_downloader']} |"
        )
    return lines


def gap_run(burners: int, opts: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One crawl with the delay, beside ``burners`` CPU burners: the gaps between request starts
    of one host as the site saw them."""
    processes, hosts = opts.gap_processes, opts.gap_hosts
    per_process = opts.gap_pages * hosts // processes
    burning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    try:
        with RedisServer() as server, CrawlSite(delay=0.01, hosts=hosts) as site:
            client = redis.Redis.from_url(server.url)
            settings = {
                "REDISLOCK_URL": server.url,
                "REDISLOCK_STAGE_KEY": "domain",
                "REDISLOCK_KEY_LIMIT": opts.gap_cap,
                "REDISLOCK_DELAY": opts.gap_delay,
                "REDISLOCK_STAGES": {"detail": None},  # the test spider's stage, uncapped
                "SCHEDULER": None,
                "CONCURRENT_REQUESTS": 16,
                "DOWNLOAD_DELAY": 0,
                "LOG_LEVEL": "WARNING",
            }
            before = commandstats(client)
            crawls = [
                Crawl(
                    site.url,
                    f"detail:{per_process}",
                    settings,
                    folder,
                    args={"hosts": str(hosts), "first": str(100_000 * i)},
                ).start()
                for i in range(processes)
            ]
            finish_all(crawls, timeout=1800)
            after = commandstats(client)
            gaps = sorted(gap for host in list(site.host_arrivals) for gap in site.gaps(host))
            wire = sorted(
                gap for host in list(site.host_arrivals) for gap in site.gaps(host, kernel=True)
            )
            client.close()
    finally:
        for burner in burning:
            burner.kill()
            burner.wait()
    starts = processes * per_process
    held_back = sum(crawl.stats.get("redislock/delay/held_back", 0) for crawl in crawls)
    return {
        "burners": burners,
        "processes": processes,
        "hosts": hosts,
        "starts": starts,
        "delay": opts.gap_delay,
        "gaps": len(gaps),
        "smallest_gap_ms": round(gaps[0] * 1000, 1),
        "p1_gap_ms": round(gaps[len(gaps) // 100] * 1000, 1),
        "median_gap_ms": round(gaps[len(gaps) // 2] * 1000, 1),
        "gaps_under_95pct": sum(1 for gap in gaps if gap < 0.95 * opts.gap_delay),
        "wire_gaps": len(wire),
        "wire_smallest_gap_ms": round(wire[0] * 1000, 1) if wire else None,
        "wire_p1_gap_ms": round(wire[len(wire) // 100] * 1000, 1) if wire else None,
        "wire_gaps_under_95pct": sum(1 for gap in wire if gap < 0.95 * opts.gap_delay),
        "evalsha_per_start": round(
            (after.get("evalsha", 0) - before.get("evalsha", 0)) / starts, 2
        ),
        "held_back": held_back,
    }


def gap_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "## The delay as the site sees it",
        "",
        "| CPU burners | processes | hosts | starts | delay | smallest gap | 1st percentile | median | "
        "gaps < 95 % of the delay | EVALSHA per start (keys and delays) | held back |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['burners']} | {r['processes']} | {r['hosts']} | {r['starts']} | "
            f"{r['delay'] * 1000:.0f} ms | {r['smallest_gap_ms']} ms | {r['p1_gap_ms']} ms | "
            f"{r['median_gap_ms']} ms | {r['gaps_under_95pct']} of {r['gaps']} | "
            f"{r['evalsha_per_start']} | {r['held_back']} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    opts = options(argv)
    RESULTS.mkdir(exist_ok=True)
    folder = RESULTS / "keys-run"
    folder.mkdir(exist_ok=True)
    print(
        f"pages per crawl {opts.pages} (at least one per domain), site {opts.delay * 1000:.0f} ms "
        "a page, "
        f"CONCURRENT_REQUESTS {opts.concurrency}, cap per domain = processes x "
        f"{opts.cap_per_process}; "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    started = time.time()
    rows = []
    for processes in (
        (int(p) for p in opts.processes.split(","))
        if opts.only
        in (
            None,
            "caps",
        )
        else ()
    ):
        for domains in (int(d) for d in opts.domains.split(",")):
            for round_ in range(opts.rounds):
                for mode in ("redislock", "scrapy"):
                    row = {**run(mode, processes, domains, opts, folder), "round": round_}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    slow_rows = []
    for processes in (
        (int(p) for p in opts.slow_processes.split(","))
        if opts.only
        in (
            None,
            "slow",
        )
        else ()
    ):
        for scheduler in ("scrapy_redislock.StageScheduler", None):
            for slow in (False, True):
                slow_rows.append(slow_run(processes, slow, scheduler, opts, folder))
                print(json.dumps(slow_rows[-1]), flush=True)
    gap_rows = []
    for burners in ((0,) if opts.smoke else (0, 2)) if opts.only in (None, "gaps") else ():
        gap_rows.append(gap_run(burners, opts, folder))
        print(json.dumps(gap_rows[-1]), flush=True)
    lines = caps_table(rows, opts.rounds) if rows else []
    if slow_rows:
        lines += slow_table(slow_rows)
    if gap_rows:
        lines += gap_table(gap_rows)
    lines.append(f"\nbenchmark wall time {time.time() - started:.0f} s")
    text = "\n".join(lines)
    print()
    print(text)
    write_results(
        "keys", text, {"options": vars(opts), "runs": rows, "slow": slow_rows, "gaps": gap_rows}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
