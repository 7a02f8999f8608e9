"""Where a capped slot's idle time goes between two requests: a Scrapy extension for
bench/middleware.py.

Enabled with ``EXTENSIONS = {"bench.handoff_probe.HandoffProbe": 0}`` and ``HANDOFF_PROBE_DIR``. It
records, on ``time.monotonic`` (one clock for every process on the machine), when each request
leaves the downloader (the download is over), when a release of a slot returns, when a wait in Redis
gets a slot, when a slot passes on locally, when a request gets its slot (the scheduler hands it out
with one, or it got one waiting in the middleware), and when a request reaches the downloader; at
spider close it writes them as JSON.
:func:`breakdown` lays them beside the test site's own arrival and answer instants. A diagnostic: it
wraps methods of the classes it measures, in the crawler process only.
"""

from __future__ import annotations

import bisect
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from scrapy import signals

# s: a local pass this close after a request left the downloader was that request's slot
PASSED_WITHIN = 0.002
RECORDS: dict[str, list[Any]] = {
    "left": [],
    "reached": [],
    "released": [],
    "granted": [],
    "handed": [],
    "passed": [],
}


def _wrap_classes() -> None:
    """Wrap, once per process, where a slot changes hands (requests/requestslots.py holds the
    hand-off, requests/lines.py the local pass, crawl/stagelocks.py the waits in Redis and the
    releases)."""
    from scrapy_redislock.crawl.stagelocks import StageLocks
    from scrapy_redislock.requests.lines import SlotLines
    from scrapy_redislock.requests.requestslots import RequestSlots

    if getattr(RequestSlots, "_probed", False):
        return
    release, acquire, look = StageLocks.release, StageLocks.acquire, StageLocks.look
    hand, hold, pass_on = RequestSlots.hand, RequestSlots.hold, SlotLines.pass_on

    def timed_pass_on(self: SlotLines, permit: Any, now: float) -> str | None:
        passed = pass_on(self, permit, now)  # a finished request's slot, to a request here
        if passed is not None and self.kind == "stage":
            RECORDS["passed"].append(time.monotonic())
        return passed

    async def timed_release(self: StageLocks, permit: Any) -> None:
        await release(self, permit)
        RECORDS["released"].append(time.monotonic())

    async def timed_acquire(self: StageLocks, stage: str, timeout: float | None) -> Any:
        permit = await acquire(self, stage, timeout)
        RECORDS["granted"].append(time.monotonic())
        return permit

    async def timed_look(self: StageLocks, stage: str) -> Any:
        permit = await look(self, stage)  # a line's take before its wait (None: it waits)
        if permit is not None:
            RECORDS["granted"].append(time.monotonic())
        return permit

    def timed_hand(self: RequestSlots, request: Any, outcome: Any) -> None:
        hand(self, request, outcome)
        if not isinstance(outcome, BaseException):  # the scheduler lets it go with its slot
            RECORDS["handed"].append((time.monotonic(), request.url))

    def timed_hold(self: RequestSlots, request: Any, permit: Any) -> None:
        hold(self, request, permit)  # a request that waited in the middleware got its slot
        RECORDS["handed"].append((time.monotonic(), request.url))

    StageLocks.release = timed_release  # type: ignore[method-assign]
    RequestSlots.hand = timed_hand  # type: ignore[method-assign]
    RequestSlots.hold = timed_hold  # type: ignore[method-assign]
    SlotLines.pass_on = timed_pass_on  # type: ignore[method-assign]
    StageLocks.acquire = timed_acquire  # type: ignore[method-assign]
    StageLocks.look = timed_look  # type: ignore[method-assign]
    RequestSlots._probed = True  # type: ignore[attr-defined]


class HandoffProbe:
    def __init__(self, crawler: Any) -> None:
        self.folder = Path(crawler.settings["HANDOFF_PROBE_DIR"])
        _wrap_classes()
        crawler.signals.connect(self.left, signal=signals.request_left_downloader)
        crawler.signals.connect(self.reached, signal=signals.request_reached_downloader)
        crawler.signals.connect(self.closed, signal=signals.spider_closed)

    @classmethod
    def from_crawler(cls, crawler: Any) -> HandoffProbe:
        return cls(crawler)

    def left(self, request: Any, spider: Any) -> None:
        RECORDS["left"].append((time.monotonic(), request.url))

    def reached(self, request: Any, spider: Any) -> None:
        RECORDS["reached"].append((time.monotonic(), request.url))

    def closed(self, spider: Any) -> None:
        (self.folder / f"probe-{os.getpid()}.json").write_text(json.dumps(RECORDS))


def breakdown(folder: Path, served: list[Any], start: float, end: float) -> dict[str, float]:
    """Median milliseconds of each step of a hand-off, over the window [start, end]: the site
    answers, the download is over (the slot is released), a waiter (often in another process) is
    granted the slot, its scheduler hands a parked request out, the request reaches the downloader,
    then the site. Plus the release's own round trip.

    ``served``: the site's records (path, arrived, answered). Paths repeat across processes, so a
    request is matched to the site's nearest record of its path.
    """
    processes = [json.loads(path.read_text()) for path in sorted(folder.glob("probe-*.json"))]
    by_path: dict[str, list[Any]] = defaultdict(list)
    for record in served:
        by_path[record.path].append(record)

    def path_of(url: str) -> str:
        return "/" + url.split("/", 3)[3].split("?")[0]

    steps: dict[str, list[float]] = defaultdict(list)
    all_left = sorted(t for p in processes for t, _ in p["left"])
    for p in processes:
        released, granted = sorted(p["released"]), sorted(p["granted"])
        passed = sorted(p.get("passed", []))
        slots = sorted(granted + passed)  # a request is handed out after a grant or a local pass
        reached = {url: t for t, url in p["reached"]}
        for t, url in p["left"]:
            if start < t < end:
                answered = [r.answered for r in by_path[path_of(url)] if r.answered <= t]
                if answered:
                    steps["site answered -> download over"].append(t - max(answered))
                k = bisect.bisect_left(passed, t)
                if k < len(passed) and passed[k] - t < PASSED_WITHIN:
                    continue  # its slot was passed on locally: no release
                i = bisect.bisect_left(released, t)
                if i < len(released):
                    steps["download over -> its release returned"].append(released[i] - t)
        for t in granted:
            i = bisect.bisect_right(all_left, t) - 1
            if start < t < end and i >= 0:
                steps["download over (any process) -> slot granted"].append(t - all_left[i])
        own_left = sorted(t for t, _ in p["left"])
        for t in p.get("passed", []):
            i = bisect.bisect_right(own_left, t) - 1
            if start < t < end and i >= 0:
                steps["download over -> slot passed on locally"].append(t - own_left[i])
        for t, url in p["handed"]:
            if not start < t < end:
                continue
            i = bisect.bisect_right(slots, t) - 1
            if i >= 0:
                steps["slot granted or passed on -> request handed out"].append(t - slots[i])
            if url in reached:
                steps["handed out -> reached the downloader"].append(reached[url] - t)
                arrived = [r.arrived for r in by_path[path_of(url)] if r.arrived >= reached[url]]
                if arrived:
                    steps["reached the downloader -> arrived at the site"].append(
                        min(arrived) - reached[url]
                    )
    return {step: 1000 * statistics.median(values) for step, values in steps.items() if values}
