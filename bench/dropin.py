"""StageScheduler as a drop-in: the order a mixed crawl's requests go in against Scrapy's own scheduler, and what a
process holds out of a shared scrapy-redis queue (a process started late, a process killed with SIGKILL).

    ./run.sh bench dropin [--order-requests 200] [--order-concurrency 1,8] [--queued 400] [--concurrency 8]
    ./run.sh bench dropin --only order            # or --only shared

Real ``scrapy runspider`` processes against the local site (:class:`testing.site.CrawlSite`) and a fresh
redis-server. Why: StageScheduler replaces the crawl's scheduler, so it must give the requests in the order Scrapy
would wherever the caps let it, and over scrapy-redis it must leave the shared queue shared.

**Part 1, order** (one process, ``testing/spiders/dropinspider.py``'s MixedSpider: 12 list pages, each yielding 12
detail and 4 comment requests of priorities -5..5, and every third one a request of priority 100 mid-crawl,
alternately of stage detail and of the uncapped stage comments; 208 requests, ``--order-delay`` s a page). At each
CONCURRENT_REQUESTS of ``--order-concurrency``, the crawl runs with Scrapy's own scheduler and no middleware (the
reference), once more the same way (how far Scrapy differs from itself: the noise floor), with StageScheduler and
caps that never bind (list, detail 64), and, where the concurrency exceeds the caps, with binding caps (list 1,
detail 3). :class:`~testing.spiders.dropinspider.OrderLog` records the order requests reach the downloader
(``request_reached_downloader``, after the wait for a slot), when each was queued and when it left the scheduler.
Against the reference, for the first ``--order-requests``: the identical prefix, Kendall's tau (over the
reference's first N requests, their positions in both orders; 1 = same order), and where each priority-100
request went (its position in both orders, and how many requests left the scheduler between its queueing and its
own departure). For every run, the **priority inversions** at the scheduler: departures of a request while a
request of strictly higher priority was queued (queued before it left, left after it), split by what was passed
over: one of the same stage (expected 0: within a stage the inner queue's order holds), an uncapped one (expected
0: uncapped requests can always go), one of another capped stage (expected only with binding caps: a full stage
waits while the others go; that is the point of the scheduler).

**Part 2, the shared queue** (``testing/spiders/crawlspider.py``'s PlanSpider with no start requests, consuming
``--queued`` detail requests seeded in Redis in scrapy-redis's own format and queue, SCHEDULER_PERSIST on,
CONCURRENT_REQUESTS ``--concurrency``). Three setups: plain scrapy-redis (its scheduler, no caps), scrapy-redis with
StageLockMiddleware alone (detail capped at 3: what one had before StageScheduler worked over scrapy-redis),
StageScheduler over scrapy-redis (detail 3). The uncapped setup's pages take ``--delay`` x concurrency s, the capped
ones' ``--delay``, so that all three go at the same pages/s with three processes and the late start and the kill
fall at the same point of the crawl. Two processes start at once; once both are ready and ``--late-after`` pages
were fetched, a third starts; once it has fetched a page, the first is killed with SIGKILL; the other two drain the
queue and close by themselves. Measured:

- **held**: per process, requests taken from the Redis queue and not finished, from inside the process
  (:class:`~testing.spiders.dropinspider.HeldProbe`): the scheduler's ``scheduler/dequeued/redis`` stat (counted by
  scrapy-redis's scheduler at every request it hands out, so exactly what was taken from Redis) less
  ``request_left_downloader`` signals (downloads done), sampled right after every pop (the peaks) and every 50 ms;
  most and median (median over the samples between its first and last pop), and the most waiting for a slot
  (taken, not yet past the middlewares: popped less ``request_reached_downloader``). StageScheduler's bound: its
  requests in flight plus the one fetched ahead of the engine (a capped request waits for its slot in the queue).
  From outside, the same for all processes together: seeded - queued in Redis (one MULTI/EXEC over the queue's
  keys) - answered by the site, sampled every
  50 ms (a sample during which the site answered a request is dropped: it would count that request twice);
- **late start**: the third process's start-up (process start to ``spider_opened``) and the time from
  ``spider_opened`` to its first request reaching the site; the requests still queued in Redis then;
- **SIGKILL**: the killed process's requests in flight at the site at the kill (answered after it: their responses
  are lost), the requests it had taken from Redis that never reached the site, their sum (the loss), what its
  last probe sample said it held; then pages fetched twice and left in Redis after the others drained the queue.

Prints what it measured; writes bench/results/dropin.md and dropin.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
import scrapy
from scrapy_redis.queue import PriorityQueue

from bench import RESULTS, add_smoke, write_results
from testing.crawlproc import ROOT, Crawl
from testing.redis_server import RedisServer
from testing.site import CrawlSite
from testing.spiders.crawlspider import PlanSpider
from testing.spiders.dropinspider import held_samples

MIXED = ROOT / "testing" / "spiders" / "dropinspider.py"
ORDER_LOG = "testing.spiders.dropinspider.OrderLog"
HELD_PROBE = "testing.spiders.dropinspider.HeldProbe"
STATS_FILE = "testing.spiders.crawlspider.StatsFile"
MIDDLEWARE = "scrapy_redislock.StageLockMiddleware"
SCRAPY_REDIS = {
    "SCHEDULER": "scrapy_redis.scheduler.Scheduler",
    "DUPEFILTER_CLASS": "scrapy_redis.dupefilter.RFPDupeFilter",
    "SCHEDULER_PERSIST": True,
}
CAP = 3  # detail's cap in part 2


def options(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/dropin.py", description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="order,shared", help="comma list of parts: order, shared")
    parser.add_argument(
        "--order-requests", type=int, default=200, help="requests compared (first N reached)"
    )
    parser.add_argument(
        "--order-concurrency", default="1,8", help="comma list of CONCURRENT_REQUESTS for part 1"
    )
    parser.add_argument(
        "--order-delay", type=float, default=0.02, help="seconds a page takes in part 1"
    )
    parser.add_argument(
        "--queued", type=int, default=400, help="detail requests seeded in Redis in part 2"
    )
    parser.add_argument(
        "--concurrency", type=int, default=8, help="CONCURRENT_REQUESTS per process in part 2"
    )
    parser.add_argument(
        "--delay", type=float, default=0.1, help="seconds a capped page takes in part 2"
    )
    parser.add_argument(
        "--late-after", type=int, default=20, help="pages fetched before the third process starts"
    )
    add_smoke(parser)
    opts = parser.parse_args(argv)
    if opts.smoke:
        opts.order_requests, opts.order_concurrency, opts.queued = 20, "1", 100
        # the queue must last until the late process starts (a few seconds on a busy machine)
        opts.delay, opts.concurrency, opts.late_after = 0.3, 4, 5
    return opts


# -- part 1: order ---------------------------------------------------------------------------------


def kendall_tau(xs: list[int], ys: list[int]) -> float:
    """Kendall's tau-a of two rankings of the same items (no ties): (concordant - discordant) /
    pairs; O(n^2)."""
    n = len(xs)
    if n < 2:
        return 1.0
    score = 0
    for i, j in itertools.combinations(range(n), 2):
        product = (xs[i] - xs[j]) * (ys[i] - ys[j])
        score += (product > 0) - (product < 0)
    return score / (n * (n - 1) / 2)


def order_crawl(
    site: CrawlSite, redis_url: str, concurrency: int, caps: dict[str, int] | None, tmp: Path
) -> list:
    """One crawl of the mixed spider; its OrderLog records."""
    out = tmp / f"order-{time.monotonic_ns()}.json"
    settings: dict[str, Any] = {
        "CONCURRENT_REQUESTS": concurrency,
        "EXTENSIONS": {STATS_FILE: 0, ORDER_LOG: 0},
        "ORDER_JSON": str(out),
    }
    if caps is None:
        settings.update(SCHEDULER="scrapy.core.scheduler.Scheduler", DOWNLOADER_MIDDLEWARES={})
    else:
        settings.update(
            REDISLOCK_URL=redis_url,
            REDISLOCK_STAGES={**caps, "comments": None},
            DOWNLOADER_MIDDLEWARES={MIDDLEWARE: 950},
        )
    crawl = Crawl(site.url, "", settings, tmp, spider=MIXED).run(timeout=300)
    if crawl.code != 0 or crawl.stats.get("finish_reason") != "finished":
        raise RuntimeError(f"crawl failed: {crawl.tail()}")
    records = json.loads(out.read_text())["records"]
    if any("reached" not in record for record in records):
        raise RuntimeError("a request never reached the downloader")
    return records


def path(record: dict[str, Any]) -> str:
    return "/" + record["url"].split("/", 3)[3]


def inversions(records: list[dict[str, Any]], capped: set[str]) -> dict[str, int]:
    """Departures from the scheduler while a queued request of strictly higher priority stayed, by
    what stayed."""
    found = {"same stage": 0, "uncapped": 0, "other capped stage": 0}
    for r in records:
        passed = [
            q
            for q in records
            if q["priority"] > r["priority"]
            and q["queued_at"] < r["left_at"]
            and q["left"] > r["left"]
        ]
        kinds = set()
        for q in passed:
            if q["stage"] == r["stage"]:
                kinds.add("same stage")
            elif q["stage"] not in capped:
                kinds.add("uncapped")
            else:
                kinds.add("other capped stage")
        for kind in kinds:
            found[kind] += 1
    return found


def passed_by(records: list[dict[str, Any]], record: dict[str, Any]) -> int:
    """Requests that left the scheduler between this one's queueing and its own departure."""
    return sum(
        1 for q in records if record["queued_at"] < q["left_at"] and q["left"] < record["left"]
    )


def compare(reference: list[dict[str, Any]], run: list[dict[str, Any]], n: int) -> dict[str, Any]:
    ref_order = [path(r) for r in sorted(reference, key=lambda r: r["reached"])]
    run_order = [path(r) for r in sorted(run, key=lambda r: r["reached"])]
    prefix = next(
        (i for i, (a, b) in enumerate(zip(ref_order[:n], run_order[:n], strict=False)) if a != b), n
    )
    where = {p: i for i, p in enumerate(run_order)}
    firsts = ref_order[:n]
    tau = kendall_tau(list(range(len(firsts))), [where[p] for p in firsts])
    ref_by_path = {path(r): r for r in reference}
    run_by_path = {path(r): r for r in run}
    urgent = []
    for p in sorted(
        (p for p, r in ref_by_path.items() if r["priority"] == 100), key=ref_order.index
    ):
        urgent.append(
            {
                "path": p,
                "stage": ref_by_path[p]["stage"],
                "reference position": ref_order.index(p),
                "position": where[p],
                "reference passed by": passed_by(reference, ref_by_path[p]),
                "passed by": passed_by(run, run_by_path[p]),
            }
        )
    return {"prefix": prefix, "tau": tau, "urgent": urgent}


def part_order(
    opts: argparse.Namespace, server: RedisServer, tmp: Path
) -> tuple[list[str], dict[str, Any]]:
    lines = [
        "### Part 1: the order of a mixed crawl against Scrapy's scheduler",
        "",
        "One process, MixedSpider (208 requests: 12 list, 144 detail, 48 comments, 4 of priority "
        "100), "
        f"{opts.order_delay * 1000:.0f} ms a page; order of `request_reached_downloader`, first "
        f"{opts.order_requests} "
        "against Scrapy's scheduler at the same concurrency. Priority-100 requests: position in "
        "Scrapy's order -> "
        "ours (requests that left the scheduler between its queueing and its departure: Scrapy's "
        "-> ours). "
        "Inversions: departures while a queued request of higher priority stayed, of the same "
        "stage / uncapped / "
        "another capped stage.",
        "",
        "| CONCURRENT_REQUESTS | run | identical prefix | Kendall tau | priority-100 requests | "
        "inversions |",
        "|---:|---|---:|---:|---|---|",
    ]
    data: dict[str, Any] = {}
    n = opts.order_requests
    with CrawlSite(delay=opts.order_delay) as site:
        for concurrency in [int(c) for c in opts.order_concurrency.split(",") if c]:
            runs: list[tuple[str, dict[str, int] | None]] = [
                ("Scrapy's scheduler, again", None),
                ("StageScheduler, caps never bind (64)", {"list": 64, "detail": 64}),
            ]
            if concurrency > 1:
                runs.append(
                    ("StageScheduler, binding caps (list 1, detail 3)", {"list": 1, "detail": 3})
                )
            reference = order_crawl(site, server.url, concurrency, None, tmp)
            inv = inversions(reference, set())
            lines.append(
                f"| {concurrency} | Scrapy's scheduler (reference) | - | - | - | "
                f"{inv['same stage']} / {inv['uncapped']} / {inv['other capped stage']} |"
            )
            data[str(concurrency)] = {"reference": reference}
            for label, caps in runs:
                records = order_crawl(site, server.url, concurrency, caps, tmp)
                found = compare(reference, records, n)
                inv = inversions(records, set(caps or {}))
                urgent = ", ".join(
                    f"{u['path']} ({u['stage']}) {u['reference position']}->{u['position']} "
                    f"({u['reference passed by']}->{u['passed by']})"
                    for u in found["urgent"]
                )
                lines.append(
                    f"| {concurrency} | {label} | {found['prefix']} | {found['tau']:.3f} | "
                    f"{urgent} | "
                    f"{inv['same stage']} / {inv['uncapped']} / {inv['other capped stage']} |"
                )
                data[str(concurrency)][label] = {**found, "inversions": inv, "records": records}
                print(f"  order, CONCURRENT_REQUESTS {concurrency}, {label}: done", flush=True)
    return lines, data


# -- part 2: the shared queue ----------------------------------------------------------------------


def seed(client: redis.Redis, base: str, count: int) -> None:
    """``count`` detail requests in the spider's scrapy-redis queue (``plan:requests``), as a
    producer pushes them: scrapy-redis's PriorityQueue and serializer; priority -n, so that they are
    taken in page order."""
    spider = PlanSpider(base=base)
    queue = PriorityQueue(client, spider, "%(spider)s:requests")
    for n in range(count):
        queue.push(
            scrapy.Request(
                f"{base}/detail/{n}",
                meta={"redislock_stage": "detail"},
                priority=-n,
                callback=spider.parse,
                errback=spider.failed,
                dont_filter=True,
            )
        )


def queued(client: redis.Redis) -> int:
    """Requests in the spider's queue and its stages' queues (``plan:requests``,
    ``plan:requests:<stage>``), read in one MULTI/EXEC (a request moving from one to the other is
    counted once)."""
    keys = sorted(client.scan_iter("plan:requests*"))
    pipe = client.pipeline(transaction=True)
    for key in keys:
        pipe.zcard(key)
    return sum(int(n) for n in pipe.execute()) if keys else 0


def answered(site: CrawlSite) -> int:
    with site.lock:
        return len(site.served)


def arrived_from(site: CrawlSite, worker: str) -> int:
    """Requests of ``worker`` (its User-Agent) that reached the site so far: answered or in
    flight."""
    with site.lock:
        return (
            sum(1 for r in site.served if r.worker == worker)
            + site.workers_in_flight["detail"][worker]
        )


def held_figures(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Most and median held (median over the samples from its first pop to its last), most waiting
    for a slot."""
    if not samples:
        return {"most": None, "median": None, "most waiting": None, "samples": 0}
    held = [s["popped"] - s["left"] for s in samples]
    waiting = [s["popped"] - s["reached"] for s in samples]
    last = samples[-1]["popped"]
    first_pop = next((i for i, s in enumerate(samples) if s["popped"] > 0), 0)
    last_pop = next((i for i, s in enumerate(samples) if s["popped"] == last), len(samples) - 1)
    window = held[first_pop : last_pop + 1] or held
    return {
        "most": max(held),
        "median": statistics.median(window),
        "most waiting": max(waiting),
        "samples": len(held),
    }


SETUPS: list[tuple[str, dict[str, Any], bool]] = [
    ("plain scrapy-redis, no caps", {**SCRAPY_REDIS, "DOWNLOADER_MIDDLEWARES": {}}, False),
    (
        "scrapy-redis + StageLockMiddleware alone, detail 3",
        {**SCRAPY_REDIS, "DOWNLOADER_MIDDLEWARES": {MIDDLEWARE: 950}},
        True,
    ),
    (
        "StageScheduler over scrapy-redis, detail 3",
        {
            **SCRAPY_REDIS,
            "SCHEDULER": "scrapy_redislock.StageScheduler",
            "REDISLOCK_SCHEDULER_INNER": "scrapy_redis.scheduler.Scheduler",
            "DOWNLOADER_MIDDLEWARES": {MIDDLEWARE: 950},
        },
        True,
    ),
]


class SharedRun:
    """One setup of part 2: three processes over one seeded queue, a late start, a SIGKILL."""

    def __init__(
        self,
        label: str,
        extra: dict[str, Any],
        capped: bool,
        opts: argparse.Namespace,
        url: str,
        tmp: Path,
    ) -> None:
        self.label, self.extra, self.capped, self.opts, self.url, self.tmp = (
            label,
            extra,
            capped,
            opts,
            url,
            tmp,
        )
        self.client = redis.Redis.from_url(url)
        self.crawls: dict[str, Crawl] = {}
        self.probes: dict[str, Path] = {}
        self.started: dict[str, float] = {}
        self.outside: list[int] = []  # seeded - queued - answered, every 50 ms
        self.site: CrawlSite | None = None

    def start(self, name: str) -> None:
        assert self.site is not None
        self.probes[name] = self.tmp / f"held-{name}-{time.monotonic_ns()}.jsonl"
        settings = {
            "REDIS_URL": self.url,
            "CONCURRENT_REQUESTS": self.opts.concurrency,
            "USER_AGENT": name,
            "EXTENSIONS": {STATS_FILE: 0, HELD_PROBE: 0},
            "HELD_PROBE_FILE": str(self.probes[name]),
            **self.extra,
        }
        if self.capped:
            settings.update(REDISLOCK_URL=self.url, REDISLOCK_STAGES={"detail": CAP})
        self.started[name] = time.monotonic()
        self.crawls[name] = Crawl(self.site.url, "", settings, self.tmp).start()

    def opened(self, name: str) -> float | None:
        return held_samples(self.probes[name])[0]

    def wait(self, condition: Any, what: str, timeout: float = 180) -> None:
        """Wait for ``condition``, sampling the outside view every 50 ms; a crawl that fails stops
        the run."""
        assert self.site is not None
        deadline = time.monotonic() + timeout
        while not condition():
            for name, crawl in self.crawls.items():
                code = crawl.process.poll() if crawl.process is not None else None
                if code not in (None, 0, -signal.SIGKILL):
                    raise RuntimeError(f"{self.label}: {name} exited with {code}: {crawl.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.label}: timed out waiting for {what}")
            before = answered(self.site)
            in_redis = queued(self.client)
            # no answer while Redis was read: one instant's figures
            if answered(self.site) == before:
                self.outside.append(self.opts.queued - in_redis - before)
            time.sleep(0.05)

    def run(self) -> dict[str, Any]:
        opts = self.opts
        self.client.flushdb()
        delay = opts.delay if self.capped else opts.delay * opts.concurrency
        with CrawlSite(delay=delay) as site:
            self.site = site
            seed(self.client, site.url, opts.queued)
            self.start("p1")
            self.start("p2")
            self.wait(
                lambda: (
                    bool(self.opened("p1") and self.opened("p2"))
                    and answered(site) >= opts.late_after
                ),
                "p1 and p2 to open and crawl",
            )
            if opts.smoke:
                # A busy machine may take longer to start p3 than the short queue lasts: slow pages
                # until it has opened, so that there is work left for it (the smoke run's figures
                # are not the benchmark's).
                site.delay = 3.0
            self.start("p3")
            self.wait(lambda: self.opened("p3") is not None, "p3 to open")
            site.delay = delay
            queued_at_p3 = queued(self.client)
            self.wait(lambda: arrived_from(site, "p3") > 0, "p3's first request")
            self.wait(lambda: arrived_from(site, "p1") > 0, "p1's first request")
            killed_at = time.monotonic()
            self.crawls["p1"].signal(signal.SIGKILL)
            queued_after_kill = queued(self.client)
            self.wait(
                lambda: all(
                    c.process is not None and c.process.poll() is not None
                    for c in self.crawls.values()
                ),
                "p2 and p3 to drain the queue and exit",
                600,
            )
            for name, crawl in self.crawls.items():
                crawl.wait()
                if name != "p1" and (
                    crawl.code != 0 or crawl.stats.get("finish_reason") != "finished"
                ):
                    raise RuntimeError(f"{self.label}: {name} failed: {crawl.tail()}")
            # the killed process's last pages, answered
            site.wait_for(lambda: not site.in_flight, timeout=30)
            with site.lock:
                records = list(site.served)
                hits = dict(site.hits)
        p3_opened = self.opened("p3")
        p3_first = min(r.arrived for r in records if r.worker == "p3")
        in_flight_at_kill = sum(1 for r in records if r.worker == "p1" and r.answered >= killed_at)
        never_fetched = opts.queued - len(hits)
        victim = held_samples(self.probes["p1"])[1]
        return {
            "setup": self.label,
            "delay": delay,
            "held": {
                name: held_figures(held_samples(self.probes[name])[1]) for name in self.crawls
            },
            "most held, all processes (outside)": max(self.outside, default=None),
            "late start-up": p3_opened - self.started["p3"] if p3_opened is not None else None,
            "late ready to first request": p3_first - p3_opened if p3_opened is not None else None,
            "queued when the late process was ready": queued_at_p3,
            "killed after": killed_at - self.started["p1"],
            "queued after the kill": queued_after_kill,
            "killed: in flight at the site": in_flight_at_kill,
            "killed: never reached the site": never_fetched,
            "killed: lost": in_flight_at_kill + never_fetched,
            "killed: held at its last sample": victim[-1]["popped"] - victim[-1]["left"]
            if victim
            else None,
            "killed: fetched before the kill": sum(
                1 for r in records if r.worker == "p1" and r.answered < killed_at
            ),
            "fetched twice": sum(1 for n in hits.values() if n > 1),
            "left in Redis": queued(self.client),
            "codes": {name: crawl.code for name, crawl in self.crawls.items()},
        }


def part_shared(
    opts: argparse.Namespace, server: RedisServer, tmp: Path
) -> tuple[list[str], list[dict[str, Any]]]:
    results = []
    for label, extra, capped in SETUPS:
        results.append(SharedRun(label, extra, capped, opts, server.url, tmp).run())
        print(f"  shared queue, {label}: done", flush=True)

    def fmt(value: Any) -> str:
        if isinstance(value, float):
            return str(int(value)) if value.is_integer() else f"{value:.2f}"
        return "-" if value is None else str(value)

    lines = [
        "### Part 2: what a process holds out of a shared scrapy-redis queue",
        "",
        f"{opts.queued} detail requests seeded in Redis (scrapy-redis's PriorityQueue), 3 "
        "processes, "
        f"CONCURRENT_REQUESTS {opts.concurrency}, SCHEDULER_PERSIST; capped setups: detail {CAP}, "
        f"{opts.delay * 1000:.0f} ms a page; uncapped: {opts.delay * opts.concurrency * 1000:.0f} "
        "ms a page "
        "(the same pages/s). Held = taken from Redis (`scheduler/dequeued/redis`) and not done "
        "(`request_left_downloader`), per process p1 / p2 / p3 (p3 started late, p1 killed); all = "
        "seeded - queued "
        "- answered, sampled from outside.",
        "",
        "| setup | most held | median held | most waiting for a slot | most held, all (outside) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        held = r["held"]
        cols = [
            " / ".join(fmt(held[p][key]) for p in ("p1", "p2", "p3"))
            for key in ("most", "median", "most waiting")
        ]
        lines.append(
            f"| {r['setup']} | {' | '.join(cols)} | {fmt(r['most held, all processes (outside)'])} |"
        )
    lines += [
        "",
        "Late start and SIGKILL: p3's start-up (process start -> `spider_opened`) and its first "
        "request "
        "(`spider_opened` -> first arrival at the site); p1 killed once p3 had a request at the "
        "site. Lost = the "
        "killed process's requests in flight at the site (responses lost) + requests it had taken "
        "from Redis that "
        "never reached the site; the rest was drained by p2 and p3.",
        "",
        "| setup | late: start-up s | late: ready -> first request s | queued then | killed after "
        "s | "
        "held at kill (last sample) | in flight at the site | never reached the site | lost | "
        "fetched twice | "
        "left in Redis |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        cols = [
            r["late start-up"],
            r["late ready to first request"],
            r["queued when the late process was ready"],
            r["killed after"],
            r["killed: held at its last sample"],
            r["killed: in flight at the site"],
            r["killed: never reached the site"],
            r["killed: lost"],
            r["fetched twice"],
            r["left in Redis"],
        ]
        lines.append(f"| {r['setup']} | " + " | ".join(fmt(c) for c in cols) + " |")
    return lines, results


def main(argv: list[str] | None = None) -> int:
    opts = options(argv)
    parts = {part.strip() for part in opts.only.split(",") if part.strip()}
    RESULTS.mkdir(exist_ok=True)
    began = time.monotonic()
    lines = [
        "## StageScheduler as a drop-in: `./run.sh bench dropin`",
        "",
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start; "
        f"Scrapy {scrapy.__version__}, scrapy-redis "
        f"{getattr(__import__('scrapy_redis'), '__version__', '?')}.",
        "",
    ]
    data: dict[str, Any] = {"options": vars(opts)}
    with RedisServer() as server, tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        if "order" in parts:
            found, data["order"] = part_order(opts, server, tmp)
            lines += [*found, ""]
        if "shared" in parts:
            found, data["shared"] = part_shared(opts, server, tmp)
            lines += [*found, ""]
    lines.append(
        f"Benchmark wall time {time.monotonic() - began:.0f} s; load average "
        f"{os.getloadavg()[0]:.1f} at the end."
    )
    text = "\n".join(lines)
    print()
    print(text)
    write_results("dropin", text, data)
    print(f"\nwritten: {RESULTS / 'dropin.md'}, dropin.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
