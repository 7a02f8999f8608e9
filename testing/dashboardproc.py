"""A real ``python -m scrapy_redislock dashboard`` process for the tests: started on a free port,
ready once it printed its address, stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CLEAN_ENV = {
    k: v
    for k, v in os.environ.items()
    if k not in {"REDISLOCK_URL", "REDIS_URL", "REDISLOCK_KEY_PREFIX"}
}


class DashboardProcess:
    """``dashboard --port 0`` as a child process; ``url`` and ``token`` come from what it prints."""

    def __init__(
        self, redis_url: str, *args: str, command: list[str] | None = None, cwd: Path = ROOT
    ) -> None:
        base = command or [sys.executable, "-m", "scrapy_redislock"]
        self.process = subprocess.Popen(
            [*base, "dashboard", "--url", redis_url, "--port", "0", *args],
            cwd=cwd,
            env=CLEAN_ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = ""
        self.token: str | None = None
        self.stderr: str | None = None

    def _read(self) -> None:
        assert self.process.stdout is not None
        # closed at the end of the output (an open pipe is a ResourceWarning)
        with self.process.stdout:
            for line in self.process.stdout:
                self.output.append(line)
                self.lines.put(line)

    def wait_ready(self, timeout: float = 30) -> DashboardProcess:
        """Wait until it printed its address and whether control is on (it serves from then on)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            if line.startswith("dashboard: http://"):
                self.url = line.split()[1].rstrip("/")
            elif line.startswith("control: on; token "):
                self.token = line.split()[-1]
            elif line.startswith("control: off") or (line.startswith("  open ") and self.token):
                return self
        raise AssertionError(f"the dashboard did not start: {''.join(self.output)}{self.stop()[1]}")

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
        request = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def post(
        self,
        path: str,
        body: Any,
        token: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        headers = {"Content-Type": "application/json", **(headers or {})}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def stop(self) -> tuple[int, str]:
        """SIGTERM; (exit status, stderr)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        assert self.process.stderr is not None
        if self.stderr is None:  # (stopped once: what it said then)
            with self.process.stderr:
                self.stderr = self.process.stderr.read()
        return self.process.returncode, self.stderr

    def __enter__(self) -> DashboardProcess:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()
