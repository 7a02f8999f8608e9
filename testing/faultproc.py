"""Subprocess workers for the fault-injection tests, and the tests' handles and measures on them.

A worker is ``python -m testing.faultproc MODE URL NAME LIMIT TTL [options]``; it prints one JSON record a line on
stdout. All instants are ``time.monotonic()`` (one clock for every process on one machine), so hold intervals
from different processes can be laid side by side. Every worker prints ``{"ready": ..., "owner": ..., "pid": ...}``
first. Modes:

``loop``    acquire -> hold ``--hold-ms`` -> release, for ``--seconds``; one record per grant:
            ``{"hold": [start, end], "fence": n, "released": bool, "lost": bool}`` where ``end`` is when the worker
            stopped treating the slot as held (it called release, or it noticed the lease was lost mid-hold). Redis
            errors are retried (``{"error": ..., "at": t}``), as a crawler would; a release Redis did not take is
            retried until it is taken or the permit is reported lost. Last ``{"done": grants}``.
``hold``    acquire once (``{"acquired": t, "fence": n}``) and "work" in 5 ms steps, checking ``permit.lost``
            after each step, until the lease is lost (``{"noticed_lost": t, "work": [step instants]}``, then the
            stale release's result) or ``--hold-ms`` passed (then a normal release). Without ``--hold-ms`` it works
            until killed.
``waiters`` ``--threads`` threads sharing one lock object. ``--fifo``: each stdin line ``go ID`` sends the next
            thread into ``acquire()``; it records ``{"granted": ID, "asked": t, "at": t, "fence": n}``, holds
            ``--hold-ms`` and releases. ``--seconds D``: every thread loops acquire/hold/release for D seconds and
            reports ``{"thread": i, "grants": n, "waits": [[asked, granted], ...]}``.

Options: ``--front sync|async`` (CountingLock or AsyncCountingLock, both with auto_renew), ``--skew S`` shifts
this process's wall clock (``time.time``) by S seconds before anything is imported, ``--start-file PATH`` waits,
once ready, until PATH exists and then until the monotonic instant written in it (:class:`StartLine`: many workers
start together, however long each took to start).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from testing.lockproc import Proc, emit

RETRY = 0.05  # seconds between retries while Redis is unreachable
STEP = 0.005  # a hold's unit of work, after which the worker looks at permit.lost


# -- the worker (subprocess side) ------------------------------------------------------------------


def options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m testing.faultproc")
    parser.add_argument("mode", choices=["loop", "hold", "waiters"])
    parser.add_argument("url")
    parser.add_argument("name")
    parser.add_argument("limit", type=int)
    parser.add_argument("ttl", type=float)
    parser.add_argument("--front", choices=["sync", "async"], default="sync")
    parser.add_argument("--hold-ms", type=float, default=None)
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--skew", type=float, default=0.0)
    parser.add_argument("--start-file", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fifo", action="store_true")
    return parser.parse_args(argv)


def main() -> None:
    args = options()
    if args.skew:
        real_time = time.time
        time.time = lambda: real_time() + args.skew  # before redis or the lock is imported
    if args.front == "async":
        asyncio.run(main_async(args))
    else:
        main_sync(args)


def start_instant(path: str | None) -> float | None:
    """The monotonic instant written in ``path`` once it exists (see :class:`StartLine`); None
    without a path."""
    if path is None:
        return None
    # a test that failed before starting its workers: do not wait forever
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit("never told to start")
        time.sleep(0.01)
    with open(path, encoding="utf-8") as file:
        return float(file.read())


def sleep_until(path: str | None) -> None:
    instant = start_instant(path)
    if instant is not None:
        time.sleep(max(0.0, instant - time.monotonic()))


def main_sync(args: argparse.Namespace) -> None:
    import redis

    from scrapy_redislock import CountingLock, LockConnectionError, Permit

    client = redis.Redis.from_url(args.url, socket_timeout=5)
    lock = CountingLock(
        client, args.name, limit=args.limit, ttl=args.ttl, auto_renew=True, on_lost=lambda p: None
    )
    emit({"ready": True, "owner": lock.owner, "pid": os.getpid(), "wall": time.time()})

    def acquire() -> Permit:
        while True:
            try:
                return lock.acquire()
            except LockConnectionError as exc:
                emit({"error": str(exc), "at": time.monotonic()})
                time.sleep(RETRY)

    def release(permit: Permit) -> bool:
        while True:
            try:
                return lock.release(permit)
            except LockConnectionError as exc:
                emit({"error": str(exc), "at": time.monotonic()})
                if permit.lost:
                    return False
                time.sleep(RETRY)

    def hold(permit: Permit, seconds: float | None, work: list[float] | None = None) -> float:
        """Work under the permit for ``seconds`` (None: forever); returns when it stopped."""
        end = None if seconds is None else time.monotonic() + seconds
        while not permit.lost and (end is None or time.monotonic() < end):
            time.sleep(STEP if end is None else max(0.0, min(STEP, end - time.monotonic())))
            if work is not None and not permit.lost:
                work.append(time.monotonic())
        return time.monotonic()

    if args.mode != "waiters":
        sleep_until(args.start_file)
    if args.mode == "loop":
        seconds = (args.hold_ms or 0) / 1000
        grants = 0
        deadline = time.monotonic() + (args.seconds or 0)
        while time.monotonic() < deadline:
            permit = acquire()
            start = time.monotonic()
            end = hold(permit, seconds)
            lost = permit.lost
            released = release(permit) if not lost else False
            emit({"hold": [start, end], "fence": permit.fence, "released": released, "lost": lost})
            grants += 1
        closing(lock.close)
        emit({"done": grants})
    elif args.mode == "hold":
        emit({"waiting": time.monotonic()})
        permit = acquire()
        emit({"acquired": time.monotonic(), "fence": permit.fence})
        work: list[float] = []
        stopped = hold(permit, None if args.hold_ms is None else args.hold_ms / 1000, work)
        if permit.lost:
            emit({"noticed_lost": stopped, "work": work})
        emit({"released": release(permit), "at": stopped})
        closing(lock.close)
        emit({"done": 1})
    else:
        run_waiters(args, lock, acquire, release)


def closing(close: Callable[[], object]) -> None:
    try:
        close()
    except Exception as exc:  # the close of a worker whose Redis is gone: its slots expire
        emit({"error": f"close: {exc}", "at": time.monotonic()})


def run_waiters(
    args: argparse.Namespace, lock: Any, acquire: Callable[[], Any], release: Callable[[Any], bool]
) -> None:
    hold_s = (args.hold_ms or 0) / 1000
    if args.fifo:

        def one(ident: str) -> None:
            asked = time.monotonic()
            permit = acquire()
            at = time.monotonic()
            emit({"granted": ident, "asked": asked, "at": at, "fence": permit.fence})
            time.sleep(hold_s)
            release(permit)

        threads = []
        for line in sys.stdin:
            if line.startswith("go "):
                thread = threading.Thread(target=one, args=(line.split()[1],))
                thread.start()
                threads.append(thread)
            elif line.strip() == "end":
                break
        for thread in threads:
            thread.join()
    else:

        def loop(index: int) -> None:
            waits = []
            while time.monotonic() < deadline:
                asked = time.monotonic()
                permit = acquire()
                waits.append((asked, time.monotonic()))
                time.sleep(hold_s)
                release(permit)
            emit({"thread": index, "grants": len(waits), "waits": waits})

        sleep_until(args.start_file)
        deadline = time.monotonic() + (args.seconds or 0)
        threads = [threading.Thread(target=loop, args=(i,)) for i in range(args.threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    closing(lock.close)
    emit({"done": True})


async def main_async(args: argparse.Namespace) -> None:
    import redis.asyncio

    from scrapy_redislock import AsyncCountingLock, LockConnectionError, Permit

    client = redis.asyncio.Redis.from_url(args.url, socket_timeout=5)
    lock = AsyncCountingLock(
        client, args.name, limit=args.limit, ttl=args.ttl, auto_renew=True, on_lost=lambda p: None
    )
    emit({"ready": True, "owner": lock.owner, "pid": os.getpid(), "wall": time.time()})
    if args.mode != "loop":
        raise SystemExit("the asyncio lock runs the loop mode only")

    async def acquire() -> Permit:
        while True:
            try:
                return await lock.acquire()
            except LockConnectionError as exc:
                emit({"error": str(exc), "at": time.monotonic()})
                await asyncio.sleep(RETRY)

    async def release(permit: Permit) -> bool:
        while True:
            try:
                return await lock.release(permit)
            except LockConnectionError as exc:
                emit({"error": str(exc), "at": time.monotonic()})
                if permit.lost:
                    return False
                await asyncio.sleep(RETRY)

    instant = await asyncio.to_thread(start_instant, args.start_file)
    if instant is not None:
        await asyncio.sleep(max(0.0, instant - time.monotonic()))
    hold_s = (args.hold_ms or 0) / 1000
    grants = 0
    deadline = time.monotonic() + (args.seconds or 0)
    while time.monotonic() < deadline:
        permit = await acquire()
        start = time.monotonic()
        end_at = start + hold_s
        while not permit.lost and time.monotonic() < end_at:
            await asyncio.sleep(max(0.0, min(STEP, end_at - time.monotonic())))
        end = time.monotonic()
        lost = permit.lost
        released = await release(permit) if not lost else False
        emit({"hold": [start, end], "fence": permit.fence, "released": released, "lost": lost})
        grants += 1
    try:
        await lock.aclose()
    except Exception as exc:
        emit({"error": f"close: {exc}", "at": time.monotonic()})
    emit({"done": grants})


# -- the tests' side -------------------------------------------------------------------------------


class StartLine:
    """Starts many workers together: each gets ``--start-file`` and waits, once ready, until
    :meth:`go` writes the instant to start at (so a slow interpreter start-up on a loaded machine
    cannot leave one behind)."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / f"start-{uuid.uuid4().hex}"

    @property
    def args(self) -> tuple[str, str]:
        return ("--start-file", str(self.path))

    def go(self, workers: Iterable[Proc], delay: float = 0.2) -> None:
        """Once every worker has said it is ready, start them all ``delay`` seconds from now."""
        for worker in workers:
            worker.wait_for("ready")
        pending = self.path.with_suffix(".tmp")
        pending.write_text(repr(time.monotonic() + delay), encoding="utf-8")
        pending.replace(self.path)


class Worker(Proc):
    """A running ``python -m testing.faultproc``; a reader thread collects its JSON lines."""

    module = "testing.faultproc"


def max_overlap(intervals: Iterable[tuple[float, float]]) -> int:
    """Most intervals open at one instant (an end sorts before a start at the same instant)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def overlap_seconds(intervals: list[tuple[float, float]], limit: int) -> float:
    """Total time during which more than ``limit`` intervals were open."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    current, total, since = 0, 0.0, 0.0
    for moment, delta in events:
        if current > limit:
            total += moment - since
        current += delta
        since = moment
    return total


def jain(counts: list[int]) -> float:
    """Jain's fairness index: 1.0 when every count is equal."""
    return sum(counts) ** 2 / (len(counts) * sum(c * c for c in counts)) if any(counts) else 0.0


def report(scenario: str, **figures: object) -> None:
    """Print what a scenario measured (shown with ``pytest -s`` or ``-rP``); appended as JSON to the
    file named by REDISLOCK_FAULTS_REPORT when it is set, for the table in docs/failures.md."""
    shown = ", ".join(
        f"{k}={round(v, 3) if isinstance(v, float) else v}" for k, v in figures.items()
    )
    print(f"[faults] {scenario}: {shown}")
    path = os.environ.get("REDISLOCK_FAULTS_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"scenario": scenario, **figures}) + "\n")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


if __name__ == "__main__":
    main()
