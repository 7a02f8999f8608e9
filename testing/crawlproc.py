"""Run :mod:`testing.spiders.crawlspider` as real ``scrapy runspider`` processes, and read what they left behind.

    crawl = Crawl(site.url, "detail:60,comments:30", {"REDISLOCK_URL": url, ...}, tmp_path)
    crawl.start(); ...; crawl.wait()      # or crawl.run()
    crawl.code, crawl.output, crawl.stats  # exit code, stdout+stderr, the stats dict (JSON, written at close)
    crawl.wait_for_output("Spider opened")  # while it runs: its output is read line by line as it comes

``spider=`` runs another spider file (``scrapy runspider`` takes the file's last spider class).

Every setting is passed with ``-s`` (dicts and lists as JSON); ``None`` removes one of BASE_SETTINGS
or HARNESS_SETTINGS.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scrapy_redislock._redis import RedisClient
from testing.lockstate import held_slots

ROOT = Path(__file__).resolve().parent.parent
SPIDER = ROOT / "testing" / "spiders" / "crawlspider.py"

BASE_SETTINGS: dict[str, Any] = {
    "DOWNLOADER_MIDDLEWARES": {"scrapy_redislock.StageLockMiddleware": 950},
    "SCHEDULER": "scrapy_redislock.StageScheduler",
    "EXTENSIONS": {"testing.spiders.crawlspider.StatsFile": 0},
    "LOG_LEVEL": "INFO",
    "TELNETCONSOLE_ENABLED": False,
    "ROBOTSTXT_OBEY": False,
    "REDISLOCK_TTL": 3,
    "CONCURRENT_REQUESTS_PER_DOMAIN": 1000,
    "RETRY_ENABLED": False,
}


# What every crawl process of the harness runs with unless a test says otherwise: the locks' key names
# of no cap group (REDISLOCK_GROUP ''), which the tests that read Redis by key expect; a test of
# the default (the spider's name) passes "REDISLOCK_GROUP": None (left out) or its own group.
HARNESS_SETTINGS: dict[str, Any] = {"REDISLOCK_GROUP": ""}


def settings_args(settings: dict[str, Any]) -> list[str]:
    """``-s NAME=VALUE`` arguments (dicts and lists as JSON; None left out), over
    :data:`HARNESS_SETTINGS`."""
    args: list[str] = []
    for key, value in {**HARNESS_SETTINGS, **settings}.items():
        if value is not None:
            args += [
                "-s",
                f"{key}={json.dumps(value) if isinstance(value, dict | list) else value}",
            ]
    return args


def staged_worker(
    redis_url: str,
    base: str,
    plan: str,
    settings: dict[str, Any],
    args: dict[str, str] | None = None,
    spider: Path = ROOT / "testing" / "spiders" / "workerspider.py",
) -> subprocess.Popen[str]:
    """A ``scrapy runspider testing/spiders/workerspider.py`` worker (a plain scrapy.Spider with the
    worker mixin; ``spider``: another file), with spider arguments ``args`` besides ``base`` and
    ``plan``."""
    merged = {
        "REDIS_URL": redis_url,
        "CONCURRENT_REQUESTS": 2,
        "CONCURRENT_REQUESTS_PER_DOMAIN": 100,
        "REDISLOCK_TTL": 2,
        "REDISLOCK_IDLE_CLOSE": 1,
        "TELNETCONSOLE_ENABLED": False,
        "LOG_LEVEL": "INFO",
        **settings,
    }
    command = [
        sys.executable,
        "-m",
        "scrapy",
        "runspider",
        str(spider),
    ]
    command += ["-a", f"base={base}", "-a", f"plan={plan}"]
    for name, value in (args or {}).items():
        command += ["-a", f"{name}={value}"]
    command += settings_args(merged)
    return subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def crawl_command(
    base: str,
    plan: str,
    settings: dict[str, Any],
    stats_file: Path | None = None,
    args: dict[str, str] | None = None,
    spider: Path = SPIDER,
) -> list[str]:
    merged = {**BASE_SETTINGS, **settings}
    command = [
        sys.executable,
        "-m",
        "scrapy",
        "runspider",
        str(spider),
        "-a",
        f"base={base}",
        "-a",
        f"plan={plan}",
    ]
    for key, value in (args or {}).items():
        command += ["-a", f"{key}={value}"]
    command += settings_args(merged)
    if stats_file is not None:
        command += ["-s", f"STATS_JSON={stats_file}"]
    return command


class Crawl:
    """One crawl process; ``stats`` is read from the JSON the StatsFile extension writes at
    close."""

    counter = 0

    def __init__(
        self,
        base: str,
        plan: str,
        settings: dict[str, Any],
        folder: Path,
        args: dict[str, str] | None = None,
        spider: Path = SPIDER,
    ) -> None:
        Crawl.counter += 1
        self.stats_file = folder / f"stats-{os.getpid()}-{Crawl.counter}.json"
        self.command = crawl_command(base, plan, settings, self.stats_file, args, spider)
        self.process: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self.reader: threading.Thread | None = None

    def start(self) -> Crawl:
        self.process = subprocess.Popen(
            self.command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.reader = threading.Thread(target=self._read, args=(self.process,), daemon=True)
        self.reader.start()
        return self

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        with process.stdout:  # closed at the end of the output (an open pipe is a ResourceWarning)
            for line in process.stdout:
                self.lines.append(line)

    @property
    def output(self) -> str:
        """Everything the process wrote so far (stdout and stderr)."""
        return "".join(self.lines)

    def wait_for_output(
        self,
        text: str,
        timeout: float = 60,
        meanwhile: Callable[[], object] | None = None,
        every: float = 0.5,
    ) -> bool:
        """Wait until the process has written ``text`` (or exited, or ``timeout`` passed); whether
        it did. ``meanwhile`` is called every ``every`` seconds while it waits (e.g. a holder that
        must keep its lease until the crawl has seen it, however slowly the crawl starts)."""
        deadline = time.monotonic() + timeout
        due = time.monotonic()
        while text not in self.output:
            if time.monotonic() > deadline or (
                self.reader is not None and not self.reader.is_alive()
            ):
                return text in self.output
            if meanwhile is not None and time.monotonic() >= due:
                meanwhile()
                due = time.monotonic() + every
            time.sleep(0.01)
        return True

    def signal(self, signum: int = signal.SIGTERM) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def wait(self, timeout: float = 120) -> Crawl:
        assert self.process is not None and self.reader is not None
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            self.reader.join()
            raise AssertionError(
                f"crawl did not end within {timeout} s:\n{self.output[-3000:]}"
            ) from None
        self.reader.join()
        return self

    def run(self, timeout: float = 120) -> Crawl:
        return self.start().wait(timeout)

    @property
    def code(self) -> int | None:
        return None if self.process is None else self.process.returncode

    @property
    def stats(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.stats_file.read_text()))
        except FileNotFoundError:
            return {}

    def tail(self, chars: int = 3000) -> str:
        return self.output[-chars:]


def start_crawl(base: str, plan: str, settings: dict[str, Any]) -> subprocess.Popen[str]:
    """A crawl process whose output is read with ``communicate()`` (for other test modules)."""
    return subprocess.Popen(
        crawl_command(base, plan, settings),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def run_crawl(
    base: str, plan: str, settings: dict[str, Any], timeout: float = 120
) -> tuple[int, str]:
    process = start_crawl(base, plan, settings)
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output


def finish_all(crawls: list[Crawl], timeout: float = 120) -> list[Crawl]:
    """Start the crawls not started yet, wait for every one, and fail (with its log's tail) on one
    that did not finish as ``finished``."""
    for crawl in crawls:
        if crawl.process is None:
            crawl.start()
    for crawl in crawls:
        crawl.wait(timeout=timeout)
        assert crawl.stats.get("finish_reason") == "finished", crawl.tail()
    return crawls


def leftover(client: RedisClient, prefix: str = "redislock") -> int:
    """Grants still held over every lock: the tests' check that a crawl gave every slot back
    (:func:`testing.lockstate.held_slots`)."""
    return held_slots(client, prefix)
