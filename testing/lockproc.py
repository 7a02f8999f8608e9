"""Subprocess worker for the multi-process lock tests, and ``Proc``, the tests' handle on one.

Usage: python -m testing.lockproc URL NAME LIMIT TTL [--skew S] [--auto-renew] [--hold-ms MS]
       (--loop SECONDS [--reap] | --once)

--loop: acquire -> hold MS -> release, for SECONDS; one {"hold": [start, end], "fence": n, "released": bool}
        per grant (time.monotonic, comparable across processes on one machine), then {"done": count}.
        --reap runs maintain() after every grant, so this process reaps expired leases too.
--once: acquire once and print {"acquired": t, "fence": n}; with --hold-ms hold that long, release, print
        {"released": bool, "at": t} and exit; without it hold until killed.
Always prints {"ready": true, "owner": ...} first and {"waiting": t} right before acquiring; with
--auto-renew a lost lease is printed as {"lost": fence, "release": bool} (the stale release's result).
--skew shifts this process's wall clock (time.time) by SECONDS: the lock must not care.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("name")
    parser.add_argument("limit", type=int)
    parser.add_argument("ttl", type=float)
    parser.add_argument("--skew", type=float, default=0.0)
    parser.add_argument("--auto-renew", action="store_true")
    parser.add_argument("--hold-ms", type=float, default=None)
    parser.add_argument("--reap", action="store_true")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--loop", type=float, metavar="SECONDS")
    mode.add_argument("--once", action="store_true")
    args = parser.parse_args()
    if args.skew:
        real_time = time.time
        time.time = lambda: real_time() + args.skew  # before the lock is imported or used

    import redis

    from scrapy_redislock import CountingLock, Permit

    def on_lost(permit: Permit) -> None:
        emit({"lost": permit.fence, "release": lock.release(permit)})

    lock = CountingLock(
        redis.Redis.from_url(args.url),
        args.name,
        limit=args.limit,
        ttl=args.ttl,
        auto_renew=args.auto_renew,
        on_lost=on_lost,
    )
    emit({"ready": True, "owner": lock.owner, "wall": time.time()})
    if args.once:
        emit({"waiting": time.monotonic()})
        permit = lock.acquire()
        emit({"acquired": time.monotonic(), "fence": permit.fence})
        if args.hold_ms is None:
            while True:
                time.sleep(3600)
        time.sleep(args.hold_ms / 1000)
        at = time.monotonic()
        emit({"released": lock.release(permit), "at": at})
        lock.close()
        return
    hold = (args.hold_ms or 0) / 1000
    count = 0
    deadline = time.monotonic() + args.loop
    while time.monotonic() < deadline:
        permit = lock.acquire()
        start = time.monotonic()
        time.sleep(hold)
        end = time.monotonic()
        released = lock.release(permit)
        emit({"hold": [start, end], "fence": permit.fence, "released": released})
        count += 1
        if args.reap:
            lock.maintain()
    lock.close()
    emit({"done": count})


_emit_lock = threading.Lock()


def emit(record: dict[str, object]) -> None:
    with _emit_lock:
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()


class Proc:
    """A running ``python -m <module>`` (this one by default) whose JSON lines a reader thread
    collects."""

    module = "testing.lockproc"

    def __init__(self, *args: object, stdin: bool = False) -> None:
        self.args = [str(a) for a in args]
        self.process = subprocess.Popen(
            [sys.executable, "-m", self.module, *self.args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            text=True,
        )
        self.records: list[dict[str, Any]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self) -> None:
        assert self.process.stdout is not None
        # closed at the end of the output (an open pipe is a ResourceWarning)
        with self.process.stdout:
            for line in self.process.stdout:
                self.records.append(json.loads(line))

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def all(self, key: str) -> list[dict[str, Any]]:
        return [r for r in list(self.records) if key in r]

    def first(self, key: str) -> dict[str, Any] | None:
        return next((r for r in list(self.records) if key in r), None)

    def wait_for(self, key: str, timeout: float = 20.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            record = self.first(key)
            if record is not None:
                return record
            if self.process.poll() is not None:
                self.reader.join(1)
                record = self.first(key)
                if record is not None:
                    return record
                raise AssertionError(
                    f"process exited ({self.process.returncode}) without {key!r}: {self.records}"
                )
            time.sleep(0.002)
        raise AssertionError(f"no {key!r} from the process within {timeout} s: {self.records[-5:]}")

    def holds(self) -> list[tuple[float, float]]:
        return [(r["hold"][0], r["hold"][1]) for r in self.all("hold")]

    def finish(self, timeout: float = 60.0) -> None:
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        code = self.process.wait(timeout)
        self.reader.join(5)
        assert code == 0, f"process exited with {code}: {self.records[-5:]}"

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def kill(self) -> float:
        """kill -9 and reap; returns the instant of the kill."""
        at = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        if self.process.stdin is not None:
            self.process.stdin.close()
        return at

    def stop(self) -> None:
        """Cleanup: continue a stopped process, then kill it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
        self.kill()
        self.reader.join(5)


if __name__ == "__main__":
    main()
