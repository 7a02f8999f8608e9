"""Subprocess worker for multi-process lock tests: loops acquire -> hold -> release and prints JSON lines.

Usage: python -m tests.lockproc URL NAME LIMIT TTL HOLD_MS SECONDS [--skew SECONDS] [--once] [--renew]
Prints {"ready": true} once connected, then one {"hold": [start, end], "fence": n} per grant
(time.monotonic, comparable across processes on one machine), then {"done": count}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import redis

from scrapy_redislock import CountingLock


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("name")
    parser.add_argument("limit", type=int)
    parser.add_argument("ttl", type=float)
    parser.add_argument("hold_ms", type=float)
    parser.add_argument("seconds", type=float)
    parser.add_argument("--skew", type=float, default=0.0, help="shift this process's wall clock")
    parser.add_argument("--once", action="store_true", help="acquire once, report, hold until killed")
    parser.add_argument("--renew", action="store_true", help="run maintain() between grants (reaper)")
    args = parser.parse_args()
    if args.skew:
        real_time = time.time
        time.time = lambda: real_time() + args.skew  # the lock must not care

    lock = CountingLock(redis.Redis.from_url(args.url), args.name, limit=args.limit, ttl=args.ttl)
    emit({"ready": True, "owner": lock.owner})
    if args.once:
        permit = lock.acquire()
        emit({"acquired": time.monotonic(), "fence": permit.fence})
        time.sleep(3600)
    count = 0
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        permit = lock.acquire()
        start = time.monotonic()
        time.sleep(args.hold_ms / 1000)
        end = time.monotonic()
        lock.release(permit)
        emit({"hold": [start, end], "fence": permit.fence})
        count += 1
        if args.renew:
            lock.maintain()
    emit({"done": count})


def emit(record: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
