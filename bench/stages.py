"""Acceptance benchmark of the worker slots: the shop crawl with and without stage slots, and a kill -9.

    ./run.sh bench stages [--workers 5 --lists 40 --details 15 --comments 3 --delay 0.05 --concurrency 2]

Real ``scrapy crawl`` workers (example_project) against the fake shop site and a fresh redis-server, all on
this machine. Three runs, one after the other, same workers and site:

1. with stage slots (at most 1 worker on list pages, 3 on details, the rest on comments);
2. without: plain scrapy-redis, one FIFO queue (so the stages run in order, as in the use case);
3. with stage slots again, on a shop with a longer detail stage, SIGKILL one detail worker 1 s into the crawl.

Reported (seconds since the first request reached the shop): the time to the first item of each stage and the
total time of runs 1 and 2, with the targets "first comment at least 5x sooner" and "total at most 10% longer";
for run 3 the time until the killed worker's slot is held by a live worker again (target: within TTL + 2 s)
and whether the crawl completed. Caps, exactly-once and leftovers are checked in every run. Prints what it
measured; writes bench/results/stages.json, stages.md and stages.png.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import asdict

from bench import RESULTS, add_smoke, write_results
from example_project.run import STAGES, Phase, arguments, checks, plot, run_phase
from testing.redis_server import RedisServer
from testing.site import ShopSite, add_shop_arguments


def options(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/stages.py", description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=2, help="CONCURRENT_REQUESTS per worker")
    add_shop_arguments(parser, lists=40, details=15, comments=3, delay=0.05)
    parser.add_argument("--ttl", type=float, default=3.0, help="REDISLOCK_TTL")
    parser.add_argument(
        "--kill-after", type=float, default=1.0, help="seconds into run 3 to kill a detail worker"
    )
    parser.add_argument(
        "--url", default=os.environ.get("REDISLOCK_URL"), help="an existing Redis (it is FLUSHED)"
    )
    add_smoke(parser)
    opts = parser.parse_args(argv)
    if opts.smoke:
        opts.workers, opts.lists, opts.details, opts.comments = 2, 3, 3, 1
        opts.kill_after, opts.ttl = 0.5, 1.0  # the killed worker's lease runs out within the run
    return opts


def demo_args(opts: argparse.Namespace, run: int, *extra: str) -> argparse.Namespace:
    output = RESULTS / f"stages-run{run}"  # the workers' items and logs
    return arguments(
        [
            *(
                "--workers",
                str(opts.workers),
                "--concurrency",
                str(opts.concurrency),
                "--ttl",
                str(opts.ttl),
            ),
            *("--idle-close", "1.5", "--quiet", "--timeout", "600", "--output", str(output)),
            *extra,
        ]
    )


def stage_table(phases: list[Phase]) -> list[str]:
    lines = [
        "| run | first list | first detail | first comment | total | pages |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for p in phases:
        firsts = " | ".join(f"{p.first_item[s]:.2f}" for s in STAGES)
        lines.append(f"| {p.name} | {firsts} | {p.seconds:.2f} | {p.pages} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    opts = options(argv)
    RESULTS.mkdir(exist_ok=True)
    server = None
    url = opts.url
    if not url:
        server = RedisServer().start()
        url = server.url
    shop = (opts.lists, opts.details, opts.comments, opts.delay)
    # a detail stage of seconds, so the takeover happens while it has work
    kill_shop = (3, 12, 1, 0.1) if opts.smoke else (10, 40, 1, 0.1)
    print(
        f"{opts.workers} workers x CONCURRENT_REQUESTS {opts.concurrency}; shop {opts.lists} lists x "
        f"{opts.details} products x {opts.comments} comment pages, {opts.delay * 1000:.0f} ms a "
        "page; "
        f"TTL {opts.ttl} s; {os.cpu_count()} CPUs",
        flush=True,
    )
    started = time.time()
    try:
        with ShopSite(*shop) as site:
            slots = run_phase("with stage slots", "shop", url, site, demo_args(opts, 1))
            print(f"  run 1 (slots) done: {slots.seconds:.1f} s", flush=True)
            baseline = run_phase(
                "without (scrapy-redis FIFO)", "shop_baseline", url, site, demo_args(opts, 2)
            )
            print(f"  run 2 (plain scrapy-redis) done: {baseline.seconds:.1f} s", flush=True)
            verdicts = checks(slots, site)
        with ShopSite(*kill_shop) as kill_site:
            kill_args = demo_args(opts, 3, "--kill-one-after", str(opts.kill_after))
            killed = run_phase("kill -9 a detail worker", "shop", url, kill_site, kill_args)
            print("  run 3 (kill -9) done", flush=True)
            kill_verdicts = checks(killed, kill_site)
    finally:
        if server is not None:
            server.stop()

    failed = [p for p in (slots, baseline) if not p.pages or any(c != 0 for c in p.exit_codes)]
    if failed:  # nothing to compare: say what the workers did, not a division by zero
        for phase in failed:
            print(
                f"{phase.name}: {phase.pages} pages, workers exited {phase.exit_codes}: see their logs in {RESULTS}"
            )
        return 1
    sooner = baseline.first_item["comments"] / slots.first_item["comments"]
    longer = slots.seconds / baseline.seconds - 1
    takeover = killed.taken_over_after
    targets = [
        (f"first comment {sooner:.1f}x sooner with stage slots (target >= 5x)", sooner >= 5),
        (f"total time {longer:+.1%} with stage slots (target <= +10%)", longer <= 0.10),
        (
            "killed worker's detail slot held by a live worker again after "
            + ("(never)" if takeover is None else f"{takeover:.2f} s")
            + f" (target <= TTL + 2 = {opts.ttl + 2:.1f} s; "
            f"{killed.taken_over_by or 'not taken over'})",
            takeover is not None
            and takeover <= opts.ttl + 2
            and killed.taken_over_by == "live worker",
        ),
    ]
    lines = ["## Worker slots per stage: `./run.sh bench stages`", ""]
    lines.append(
        f"{opts.workers} workers x {opts.concurrency} concurrent requests, shop {opts.lists} x "
        f"{opts.details} x "
        f"{opts.comments} pages at {opts.delay * 1000:.0f} ms; TTL {opts.ttl} s; {os.cpu_count()} "
        "CPUs; "
        f"seconds since the first request reached the shop."
    )
    lines += ["", *stage_table([slots, baseline]), ""]
    lines += [f"- [{'met' if ok else 'MISSED'}] {text}" for text, ok in targets]
    lines.append(
        "- most workers on a stage at once, seen by the site: with slots "
        f"{slots.max_workers_site}, "
        f"without {baseline.max_workers_site}"
    )
    lines.append(
        f"- run 3 (shop {kill_shop[0]} x {kill_shop[1]} x {kill_shop[2]} at "
        f"{kill_shop[3] * 1000:.0f} ms): killed at "
        f"{killed.killed_at:.2f} s into the crawl, {killed.duplicates} pages fetched twice (the "
        "dead worker's), "
        f"crawl {'completed' if killed.missing == 0 else f'INCOMPLETE ({killed.missing} pages missing)'} in "
        f"{killed.seconds:.2f} s"
        if killed.killed_at is not None
        else "- run 3: no worker held a detail slot to kill"
    )
    lines += [f"- [{'ok' if ok else 'FAILED'}] run 1: {text}" for text, ok in verdicts]
    lines += [f"- [{'ok' if ok else 'FAILED'}] run 3: {text}" for text, ok in kill_verdicts]
    lines.append(f"- benchmark wall time {time.time() - started:.0f} s")
    text = "\n".join(lines)
    print()
    print(text)
    write_results(
        "stages",
        text,
        {
            "options": vars(opts),
            "first_comment_sooner": round(sooner, 2) if math.isfinite(sooner) else None,
            "total_time_change": round(longer, 4),
            "takeover_seconds": takeover,
            "phases": [asdict(p) for p in (slots, baseline, killed)],
        },
    )
    plot([slots, baseline], RESULTS / "stages.png")
    print(f"\nwritten: {RESULTS / 'stages.md'}, stages.json, stages.png")
    correct = all(ok for _, ok in verdicts) and all(ok for _, ok in kill_verdicts)
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
