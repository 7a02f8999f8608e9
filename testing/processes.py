"""Crawl processes started, watched and stopped together: one harness for the benchmarks, the demo
and tests that run several processes, instead of a Popen loop in each.

    with CrawlProcesses(cwd=PROJECT) as crawlers:
        for n in range(3):
            crawlers.start_crawl("shop", settings, log=logs / f"{n}.log")
        crawlers.wait_opened(timeout=120)  # NotOpened names one that exited early or is late
        while crawlers.running: ...        # polls each one, noting when it exited
        codes = crawlers.stop()            # SIGTERM (graceful shutdown), SIGKILL after 60 s

Each process writes to its own log file (``log=``), or to a pipe read as it comes (no ``log``), or,
with ``logs_itself``, its own ``log`` (Scrapy's LOG_FILE) while its stdout and stderr are dropped.
Leaving the ``with`` block SIGKILLs whatever still runs: an error leaves no process behind.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from testing.crawlproc import ROOT, settings_args

# What Scrapy logs once the spider runs: a SIGTERM before it kills the process instead of stopping
# it gracefully.
OPENED = "Spider opened"


def scrapy_crawl(spider: str, settings: dict[str, Any]) -> list[str]:
    """``python -m scrapy crawl SPIDER -s NAME=VALUE ...`` with this interpreter: one project
    crawl."""
    return [sys.executable, "-m", "scrapy", "crawl", spider, *settings_args(settings)]


class NotOpened(RuntimeError):
    """A process exited before it logged that its spider opened, or had not logged it in time."""

    def __init__(self, message: str, process: CrawlProcess) -> None:
        super().__init__(message)
        self.process = process


class CrawlProcess:
    """One started process: its command, where its output goes, when it started and exited."""

    def __init__(
        self, index: int, command: list[str], cwd: Path, log: Path | None, logs_itself: bool
    ) -> None:
        self.index = index
        self.command = command
        self.log = log
        self.lines: list[str] = []  # its output so far, when it goes to a pipe
        self.reader: threading.Thread | None = None
        self.exited_at: float | None = None  # time.time() when a poll first saw it exited
        self._opened: set[str] = set()  # markers seen (a log only grows)
        if log is None:
            self.popen = subprocess.Popen(
                command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            self.reader = threading.Thread(target=self._read, daemon=True)
            self.reader.start()
        elif logs_itself:
            log.unlink(missing_ok=True)  # a previous run's "Spider opened" is not this one's
            self.popen = subprocess.Popen(
                command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        else:
            with log.open("wb") as out:  # the child keeps its own copy of the file
                self.popen = subprocess.Popen(
                    command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT
                )
        self.started_at = time.time()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        # closed at the end of the output (an open pipe is a ResourceWarning)
        with self.popen.stdout:
            for line in self.popen.stdout:
                self.lines.append(line.decode(errors="replace"))

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        """Its exit code, None while it runs; the first poll that sees it exited notes when."""
        code = self.popen.poll()
        if code is not None and self.exited_at is None:
            self.exited_at = time.time()
        return code

    @property
    def running(self) -> bool:
        return self.poll() is None

    @property
    def output(self) -> str:
        """What it wrote so far: its log file, or its pipe's lines."""
        if self.log is None:
            return "".join(self.lines)
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:  # a process that writes its log itself has not opened it yet
            return ""

    def opened(self, marker: str = OPENED) -> bool:
        """Whether it has logged ``marker`` (by default that its spider opened)."""
        if marker not in self._opened and marker in self.output:
            self._opened.add(marker)
        return marker in self._opened

    def logged_count(self, name: str) -> int:
        """A count of the stats Scrapy dumps at close (e.g. ``downloader/response_count``), 0 when
        it did not dump it."""
        found = re.search(rf"'{re.escape(name)}': (\d+)", self.output)
        return int(found.group(1)) if found else 0

    def where(self) -> str:
        """Where to read what it wrote: its log, or the end of its output."""
        return str(self.log) if self.log is not None else f"its output:\n{self.output[-3000:]}"

    def signal(self, signum: int) -> None:
        """Send ``signum`` unless it has exited (its pid may be another process's by then)."""
        if self.running:
            self.popen.send_signal(signum)

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code once it exited; ``subprocess.TimeoutExpired`` if it still runs after
        ``timeout`` s."""
        code = self.popen.wait(timeout)
        self.poll()
        if self.reader is not None:
            self.reader.join()  # all its output read, its pipe closed
        return code

    def kill(self) -> int:
        """SIGKILL it if it still runs; its exit code."""
        self.signal(signal.SIGKILL)
        return self.wait()


class CrawlProcesses:
    """Processes started one by one (in waves if need be) and watched and stopped together."""

    def __init__(self, cwd: Path = ROOT) -> None:
        self.cwd = cwd
        self.processes: list[CrawlProcess] = []

    def start(
        self, command: list[str], log: Path | None = None, *, logs_itself: bool = False
    ) -> CrawlProcess:
        """Start ``command``; its output goes to ``log`` (None: a pipe), or with ``logs_itself``
        the process writes ``log`` itself and its stdout and stderr are dropped."""
        if logs_itself and log is None:
            raise ValueError("logs_itself needs the log the process writes")
        process = CrawlProcess(len(self.processes), command, self.cwd, log, logs_itself)
        self.processes.append(process)
        return process

    def start_crawl(
        self, spider: str, settings: dict[str, Any], log: Path | None = None
    ) -> CrawlProcess:
        """``scrapy crawl SPIDER`` with ``settings`` (through the one ``-s`` encoder,
        :func:`testing.crawlproc.settings_args`)."""
        return self.start(scrapy_crawl(spider, settings), log)

    def __iter__(self) -> Iterator[CrawlProcess]:
        return iter(self.processes)

    def __len__(self) -> int:
        return len(self.processes)

    def __getitem__(self, index: int) -> CrawlProcess:
        return self.processes[index]

    @property
    def running(self) -> list[CrawlProcess]:
        """The processes still running (each one polled: exit times are noted as they are seen)."""
        return [process for process in self.processes if process.running]

    def starting(self, marker: str = OPENED) -> list[CrawlProcess]:
        """Running processes that have not logged ``marker`` yet (a SIGTERM would kill them, not
        stop them gracefully)."""
        return [process for process in self.running if not process.opened(marker)]

    def wait_opened(self, timeout: float, marker: str = OPENED, interval: float = 0.2) -> None:
        """Until every process has logged ``marker``: :class:`NotOpened` names the first that
        exited without it, or one still without it after ``timeout`` s, and where its output is."""
        deadline = time.monotonic() + timeout
        while True:
            pending = [process for process in self.processes if not process.opened(marker)]
            if not pending:
                return
            for process in pending:
                if not process.running and not process.opened(marker):  # its last lines count
                    raise NotOpened(
                        f"process {process.index} exited with {process.returncode} before it "
                        f"logged {marker!r}; see {process.where()}",
                        process,
                    )
            if time.monotonic() > deadline:
                raise NotOpened(
                    f"{len(pending)} of {len(self)} processes had not logged {marker!r} after "
                    f"{timeout:g} s, e.g. process {pending[0].index}; see {pending[0].where()}",
                    pending[0],
                )
            time.sleep(interval)

    def terminate(self) -> None:
        """SIGTERM to every running process (Scrapy's graceful shutdown), without waiting."""
        for process in self.processes:
            process.signal(signal.SIGTERM)

    def stop(self, timeout: float = 60.0) -> list[int]:
        """SIGTERM, then SIGKILL what still runs after ``timeout`` s; the exit codes."""
        self.terminate()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.1, deadline - time.monotonic()))
        return self.kill()

    def kill(self) -> list[int]:
        """SIGKILL what still runs; the exit codes."""
        return [process.kill() for process in self.processes]

    @property
    def codes(self) -> list[int | None]:
        """Exit codes, None for a process still running."""
        return [process.poll() for process in self.processes]

    def __enter__(self) -> CrawlProcesses:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.kill()
