"""Path: the package's modules one capped request passes through, counted in a real crawl.

    ./run.sh bench path [--repeat 3]
    ./run.sh bench path --smoke     # one run: it runs (not its figures)

One `scrapy runspider` process, one request with three scopes (its stage detail capped at 3, its
domain capped at 2 with a 0.2 s delay, a proxy scope with a rate window of 10 per second), on a fresh
redis-server and a local site: once with every slot free (the path of a first take), once with every
slot of its stage held by another owner until the crawl waits for one in Redis (the path of a wait).
:class:`PathProbe`, a Scrapy extension of this module, profiles the crawler's reactor thread
(``sys.setprofile``) from the request's ``request_scheduled`` signal to its ``response_received``
and records every call into a module of ``scrapy_redislock``: a call from another module of the
package is a *crossing*, a call from outside it (Scrapy, Twisted, asyncio resuming a coroutine) an
*entry*. Calls run by the process's background tasks (the renewal loop, the report of why stages
wait at start, the close watch) are left out: they serve every request, not this one. The tasks
they start (a release sent from a tick, a wait opened by a line's upkeep) are counted.

Printed: the modules entered (in the order first entered), how many, the crossings between them
and the distinct (caller, callee) pairs; the same in every run (a median is printed when they
differ). A diagnostic of the package's shape, not of its speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import redis
from scrapy import signals

from bench import add_smoke, write_results
from scrapy_redislock import CountingLock

# the coroutines of the process's background tasks: the renewal loop, the close watch (both run
# ``every``) and the start's report of why stages wait
BACKGROUND = ("Renewer._run", "every", "StageLocks._say_why_at_start")
SETTINGS: dict[str, Any] = {
    "REDISLOCK_STAGES": {"detail": 3},
    "REDISLOCK_STAGE_KEY": "domain",
    "REDISLOCK_KEY_LIMIT": 2,
    "REDISLOCK_DELAY": 0.2,
    "REDISLOCK_SCOPES": {"proxy:*": {"rate": "10/s"}},
}


class PathProbe:
    """Records the calls into the package while the first scheduled request is under way (see the
    module docstring); enabled with ``EXTENSIONS`` and ``PATH_PROBE_FILE``."""

    def __init__(self, crawler: Any) -> None:
        import scrapy_redislock

        self.out = Path(crawler.settings["PATH_PROBE_FILE"])
        self.root = str(Path(scrapy_redislock.__file__).resolve().parent) + "/"
        self.calls: Counter[tuple[str | None, str]] = Counter()  # (caller module, callee module)
        self.order: list[str] = []  # modules, as first entered
        self.request: Any = None
        self.answered = False  # the request's response came (the record is whole)
        crawler.signals.connect(self.scheduled, signal=signals.request_scheduled)
        crawler.signals.connect(self.received, signal=signals.response_received)
        crawler.signals.connect(self.closed, signal=signals.spider_closed)

    @classmethod
    def from_crawler(cls, crawler: Any) -> PathProbe:
        return cls(crawler)

    def module(self, frame: FrameType | None) -> str | None:
        if frame is None:
            return None
        name = frame.f_code.co_filename
        return name[len(self.root) :] if name.startswith(self.root) else None

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = self.module(frame)
        if callee is None:
            return
        try:
            task = asyncio.current_task()
        except RuntimeError:
            task = None
        coro = getattr(task, "get_coro", lambda: None)() if task is not None else None
        if getattr(coro, "__qualname__", "") in BACKGROUND:
            return
        if callee not in self.order:
            self.order.append(callee)
        self.calls[(self.module(frame.f_back), callee)] += 1

    def scheduled(self, request: Any, spider: Any) -> None:
        if self.request is None:
            self.request = request
            sys.setprofile(self.profile)

    def received(self, response: Any, request: Any, spider: Any) -> None:
        if request is self.request:
            sys.setprofile(None)
            self.answered = True

    def closed(self, spider: Any) -> None:
        sys.setprofile(None)
        calls = [[caller, callee, n] for (caller, callee), n in self.calls.items()]
        found = {"order": self.order, "calls": calls, "answered": self.answered}
        self.out.write_text(json.dumps(found))


def one_path(folder: Path, waits: bool) -> dict[str, Any]:
    """One crawl of one request; what its probe recorded, counted. ``waits``: every slot of its stage
    is held by another owner until the crawl waits for one in Redis (a blocking read), then freed."""
    from testing.crawlproc import Crawl
    from testing.redis_server import RedisServer
    from testing.site import CrawlSite
    from testing.waiting import wait_until

    probe = folder / "path.json"
    probe.unlink(missing_ok=True)
    with RedisServer() as server, CrawlSite(delay=0.02) as site:
        client = redis.Redis.from_url(server.url)
        cap = SETTINGS["REDISLOCK_STAGES"]["detail"]
        holder = CountingLock(client, "detail", limit=cap, ttl=30)
        held = [holder.acquire(timeout=5) for _ in range(cap)] if waits else []
        settings = {
            **SETTINGS,
            "REDISLOCK_URL": server.url,
            "EXTENSIONS": {
                "bench.path.PathProbe": 0,
                "testing.spiders.crawlspider.StatsFile": 0,
            },
            "PATH_PROBE_FILE": str(probe),
        }
        ours = {c["id"] for c in client.client_list()}  # the holder's (its waits read too)
        crawl = Crawl(site.url, "detail:1", settings, folder, args={"scopes": "proxy:p1"}).start()
        if held:
            wait_until(  # a connection of the crawl blocked in a read of the stage's line
                lambda: any(
                    c["id"] not in ours and c.get("cmd") == "xreadgroup" and "b" in c["flags"]
                    for c in client.client_list()
                ),
                60,
                "the crawl waiting for a slot in Redis",
                ended=lambda: None if crawl.code is None else crawl.tail(),
            )
            for permit in held:
                holder.release(permit)
        crawl.wait()
        holder.close()
        client.close()
        if crawl.code != 0 or len(site.arrivals["detail"]) != 1:
            raise RuntimeError(f"crawl failed: {crawl.tail()}")
    found = json.loads(probe.read_text())
    if not found["answered"]:
        raise RuntimeError("the probe saw no response to the request: its record is not whole")
    crossings = [(a, b, n) for a, b, n in found["calls"] if a is not None and a != b]
    return {
        "modules": found["order"],
        "crossings": sum(n for _, _, n in crossings),
        "pairs": len({(a, b) for a, b, _ in crossings}),
        "entries": sum(n for a, _, n in found["calls"] if a is None),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    add_smoke(parser)
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    runs: dict[str, list[dict[str, Any]]] = {"every slot free": [], "its stage full": []}
    with tempfile.TemporaryDirectory() as folder:
        for i in range(1 if args.smoke else args.repeat):
            print(f"run {i + 1} ...", file=sys.stderr, flush=True)
            for case, found in runs.items():
                found.append(one_path(Path(folder), waits=case == "its stage full"))
    lines = [
        "| the request | modules entered | crossings between them | distinct (caller, callee) pairs | entries from outside |",  # noqa: E501
        "|---|---:|---:|---:|---:|",
    ]
    for case, found in runs.items():
        figures = [
            statistics.median(len(r["modules"]) for r in found),
            *(
                statistics.median(r[what] for r in found)
                for what in ("crossings", "pairs", "entries")
            ),
        ]
        lines.append(f"| {case} | " + " | ".join(f"{f:g}" for f in figures) + " |")
    lines.append("")
    for case, found in runs.items():
        lines.append(f"Modules, as first entered ({case}, run 1): {', '.join(found[0]['modules'])}")
    text = "\n".join(lines)
    print(text)
    write_results("path", text, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
