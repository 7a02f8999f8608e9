"""A local site with a capacity per host, for the adaptive limit's benchmark and crawl tests.

Each host name (127.0.0.1 to 127.0.0.N, one port: Linux routes all of 127/8 to the loopback) serves
at most ``capacity`` requests at once, each in ``base`` seconds; the next ones wait their turn,
first come first served, so past the capacity the latency grows like ``base * in_flight /
capacity``. With ``refuse`` times the capacity in flight at a host (served plus waiting; twice by
default), the next request is answered 503 at once. :meth:`CapacitySite.set_capacity` changes the capacity live;
:meth:`CapacitySite.too_many` answers one chosen request of a host ``429`` with ``Retry-After``.

What it saw, per host: arrivals (``time.monotonic()``), requests in flight at every change
(``samples``), answers by status, the most in flight and the most served at once, and the
connections opened. A request counts as in flight from the moment its request has been read until
just before its answer is written (then the client cannot have it yet).

    with CapacitySite(hosts=2, capacity=4, base=0.05) as site:
        ... site.url_of(2) ..., site.hosts["127.0.0.2"].answers[503]
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType


@dataclass
class Host:
    """One host name's queue and what it saw; guarded by the site's condition."""

    name: str
    capacity: int
    arrivals: list[float] = field(default_factory=list)
    samples: list[tuple[float, int]] = field(default_factory=list)  # (instant, in flight)
    answers: Counter[int] = field(default_factory=Counter)
    most_in_flight: int = 0
    most_served: int = 0
    connections: int = 0
    # (arrival, start of service, end of service) of each request served
    served: list[tuple[float, float, float]] = field(default_factory=list)
    waiting: deque[object] = field(default_factory=deque)  # tickets, first come first served
    serving: int = 0
    refuse: dict[int, float] = field(default_factory=dict)  # arrival number -> Retry-After (s)
    refused: list[float] = field(default_factory=list)  # arrivals answered 429
    rejected: list[float] = field(default_factory=list)  # arrivals answered 503

    @property
    def in_flight(self) -> int:
        return self.serving + len(self.waiting)

    def note(self, now: float) -> None:
        self.samples.append((now, self.in_flight))
        self.most_in_flight = max(self.most_in_flight, self.in_flight)

    def mean_in_flight(self, start: float, stop: float) -> float:
        """The time-weighted mean of requests in flight from ``start`` to ``stop`` (monotonic)."""
        area, at, value = 0.0, start, 0
        for instant, count in self.samples:
            if instant <= start:
                value = count
                continue
            if instant >= stop:
                break
            area += value * (instant - at)
            at, value = instant, count
        area += value * (stop - at)
        return area / (stop - start)

    @property
    def refused_share(self) -> float:
        """503 answers over every answer so far (0 before the first)."""
        total = sum(self.answers.values())
        return self.answers[503] / total if total else 0.0


class CapacitySite:
    """The server and what it saw; times are ``time.monotonic()``."""

    def __init__(
        self,
        hosts: int = 1,
        capacity: int = 4,
        base: float = 0.05,
        port: int = 0,
        refuse: float = 2.0,
    ) -> None:
        if not refuse >= 1.0:
            raise ValueError(f"CapacitySite refuse must be at least 1.0, got {refuse!r}")
        self.base = base
        self.refuse = refuse  # 503 once this many times the capacity is in flight
        self.condition = threading.Condition()
        self.closed = False
        names = [f"127.0.0.{i}" for i in range(1, hosts + 1)]
        self.hosts = {name: Host(name, capacity) for name in names}
        self.servers: list[ThreadingHTTPServer] = []
        for name in names:
            server = _Server((name, port), self._handler(self.hosts[name]))
            server.daemon_threads = True
            port = server.server_address[1]  # the others bind the first one's port
            self.servers.append(server)
        self.threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in self.servers]

    @property
    def port(self) -> int:
        return int(self.servers[0].server_address[1])

    def url_of(self, host: int = 1) -> str:
        """The site's URL on host name number ``host`` (1 is 127.0.0.1)."""
        return f"http://127.0.0.{host}:{self.port}"

    def set_capacity(self, capacity: int, host: str | None = None) -> None:
        """Serve ``capacity`` requests at once from now on (at ``host``, or every host); those
        already served go on, waiting ones start at once when there is room."""
        with self.condition:
            for h in self.hosts.values() if host is None else [self.hosts[host]]:
                h.capacity = capacity
            self.condition.notify_all()

    def too_many(self, host: str, retry_after: float, nth: int = 1) -> None:
        """Answer the ``nth`` request to arrive at ``host`` from now ``429 Too Many Requests`` with
        ``Retry-After: <retry_after>``, at once."""
        with self.condition:
            h = self.hosts[host]
            h.refuse[len(h.arrivals) + nth] = retry_after

    def wait_for(self, check: Callable[[], bool], timeout: float = 10.0) -> bool:
        """Wait until ``check()`` (called under the site's lock, at every change) is true; False
        on timeout."""
        deadline = time.monotonic() + timeout
        with self.condition:
            while not check():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.condition.wait(min(left, 0.05))
        return True

    def _answer(self, host: Host) -> tuple[int, dict[str, str]]:
        """Wait for a turn at ``host`` and serve (or refuse); the status and extra headers."""
        ticket = object()
        with self.condition:
            now = time.monotonic()
            host.arrivals.append(now)
            retry_after = host.refuse.pop(len(host.arrivals), None)
            if retry_after is not None:
                host.answers[429] += 1
                host.refused.append(now)
                return 429, {"Retry-After": f"{retry_after:g}"}
            if host.in_flight >= self.refuse * host.capacity or self.closed:
                host.answers[503] += 1
                host.rejected.append(now)
                return 503, {}
            host.waiting.append(ticket)
            host.note(now)
            while not self.closed and (
                host.waiting[0] is not ticket or host.serving >= host.capacity
            ):
                self.condition.wait()
            host.waiting.remove(ticket)
            if self.closed:
                host.note(time.monotonic())
                host.answers[503] += 1
                return 503, {}
            host.serving += 1
            host.most_served = max(host.most_served, host.serving)
            self.condition.notify_all()  # the next in line may have room too
            started = time.monotonic()
        time.sleep(self.base)
        with self.condition:
            ended = time.monotonic()
            host.serving -= 1
            host.note(ended)
            host.served.append((now, started, ended))
            host.answers[200] += 1
            self.condition.notify_all()
        return 200, {}

    def _handler(self, host: Host) -> type[BaseHTTPRequestHandler]:
        """The request handler of one host name."""
        site = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive
            disable_nagle_algorithm = True  # else delayed ACKs add 40 ms to kept-alive answers

            def setup(self) -> None:
                super().setup()
                with site.condition:
                    host.connections += 1

            def do_GET(self) -> None:
                status, headers = site._answer(host)
                body = f"{host.name} {self.path} {status}\n".encode()
                head = [
                    f"HTTP/1.1 {status} {_REASONS[status]}",
                    "Content-Type: text/plain",
                    f"Content-Length: {len(body)}",
                    *(f"{name}: {value}" for name, value in headers.items()),
                ]
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler

    def start(self) -> CapacitySite:
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> None:
        with self.condition:
            self.closed = True
            self.condition.notify_all()  # waiting requests are answered 503
        for server in self.servers:
            server.shutdown()
            server.server_close()

    def __enter__(self) -> CapacitySite:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


_REASONS = {200: "OK", 429: "Too Many Requests", 503: "Service Unavailable"}


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that gave up: nothing to report
