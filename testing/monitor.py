"""Read Redis's MONITOR stream: every command clients send, and (Redis 7) the commands Lua scripts run.

    monitor = Monitor(port)                      # a raw MONITOR connection, read by a thread into memory
    raw = monitor.stop(client)                   # after a marker sent by ``client`` has shown up
    for stamp, source, args in commands(raw):    # source "127.0.0.1:53776", or "lua" for a script's commands
        ...

Used by the scale benchmark and by the tests that count what an idle worker costs.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator

import redis

from testing.waiting import wait_until

LINE = re.compile(rb"^\+(\d+\.\d+) \[\d+ ([^\]]+)\] (.*)$")
ARG = re.compile(rb'"((?:[^"\\]|\\.)*)"')


class Monitor:
    """A raw MONITOR connection read by a thread into memory; parsed after the run."""

    def __init__(
        self, port: int, host: str = "127.0.0.1", auth: tuple[str, str] | None = None
    ) -> None:
        self.sock = socket.create_connection((host, port))
        if auth is not None:
            user, password = auth
            self.sock.sendall(f"AUTH {user} {password}\r\n".encode())
        self.sock.sendall(b"MONITOR\r\n")
        self.data = bytearray()
        self.thread = threading.Thread(target=self._read, name="monitor", daemon=True)
        self.thread.start()
        # Redis says +OK once MONITOR is on (after AUTH's own): a command sent before would be missed
        answers = 2 if auth is not None else 1
        wait_until(
            lambda: self.data.count(b"+OK\r\n") >= answers, 10.0, "MONITOR to be on", step=0.005
        )

    def _read(self) -> None:
        while True:
            try:
                chunk = self.sock.recv(1 << 18)
            except OSError:
                return
            if not chunk:
                return
            self.data += chunk

    def stop(self, client: redis.Redis, timeout: float = 10.0) -> bytes:
        """Send a marker from ``client``, wait until MONITOR has shown it (so every earlier line is
        in), stop."""
        marker = f"monitor-end-{time.monotonic_ns()}".encode()
        client.echo(marker)
        deadline = time.monotonic() + timeout
        while marker not in self.data and time.monotonic() < deadline:
            time.sleep(0.02)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)
        return bytes(self.data)


def commands(raw: bytes) -> Iterator[tuple[float, str, list[bytes]]]:
    """(time, source, arguments) of each command MONITOR showed; source is the client's address or
    "lua"."""
    for line in raw.split(b"\r\n"):
        match = LINE.match(line)
        if match is None:
            continue
        args = ARG.findall(match.group(3))
        if args:
            yield float(match.group(1)), match.group(2).decode(), args
