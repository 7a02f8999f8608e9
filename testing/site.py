"""A local HTTP server for crawl tests and benchmarks: pages ``/<stage>/<n>``, requests in flight counted per stage.

Threaded (a thread per connection, HTTP/1.1 keep-alive), so it never limits concurrency itself. Each page takes
``delay`` seconds (``delays[stage]`` overrides it per stage; ``?sleep=<s>`` per request).

A request counts as in flight from the moment its request line and headers have been read until just *before*
its response is written: the client cannot have the response, and so cannot have freed its slot, while the
server still counts the request. The count therefore never exceeds the slots held (a count taken after writing
would race with the client's next request, and show one request too many when a thread is slow to resume).

Reusable by any test: ``with CrawlSite(delay=0.05) as site: ... site.url, site.max_in_flight["detail"]``.
``site.routes["/robots.txt"] = ("text/plain", "User-agent: *\nDisallow: /detail/")`` serves a fixed body at a
path (counted like any page, after the same delay); :func:`links_page` makes an HTML page of links.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import NamedTuple
from urllib.parse import parse_qs, urlsplit


class Served(NamedTuple):
    stage: str
    path: str
    arrived: float
    answered: float  # just before the response was written


def links_page(paths: list[str]) -> tuple[str, str]:
    """A route: an HTML page linking to each path."""
    return "text/html", "<html><body>" + "".join(f'<a href="{p}">{p}</a>' for p in paths) + "</body></html>"


class CrawlSite:
    """The server and what it saw; all times are ``time.monotonic()`` (the same clock in every process)."""

    def __init__(self, delay: float = 0.05, delays: dict[str, float] | None = None) -> None:
        self.delay = delay
        self.delays: dict[str, float] = dict(delays or {})
        self.lock = threading.Lock()
        self.in_flight: Counter[str] = Counter()
        self.max_in_flight: Counter[str] = Counter()
        self.hits: Counter[str] = Counter()  # path (without query) -> times requested
        self.arrivals: dict[str, list[float]] = defaultdict(list)  # stage -> arrival instants
        self.served: list[Served] = []  # one record per answered request
        self.samples: list[tuple[float, dict[str, int]]] = []  # (instant, in-flight counts) at every change
        self.routes: dict[str, tuple[str, str]] = {}  # path -> (content type, body) served instead of the default
        self.bodies: dict[str, bytes] = {}  # path -> body of the last POST there
        site = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real sites and Scrapy's connection pool use
            disable_nagle_algorithm = True  # with keep-alive, Nagle + delayed ACK would add 40 ms to responses

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                stage = parts.path.strip("/").split("/", 1)[0] or "root"
                sleep = parse_qs(parts.query).get("sleep")
                arrived = site.arrive(stage, parts.path)
                try:
                    time.sleep(float(sleep[0]) if sleep else site.delays.get(stage, site.delay))
                finally:
                    site.leave(stage, parts.path, arrived)
                kind, text = site.routes.get(parts.path, ("text/html", f"<html><body><p>{self.path}</p></body></html>"))
                body = text.encode()
                head = f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n"
                self.wfile.write(head.encode() + body)  # one write: no small-packet delays

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with site.lock:
                    site.bodies[urlsplit(self.path).path] = body
                self.do_GET()

            def log_message(self, format: str, *args: object) -> None:
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client that gave up (download timeout, killed crawl): nothing to report

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def arrive(self, stage: str, path: str) -> float:
        with self.lock:
            now = time.monotonic()
            self.in_flight[stage] += 1
            self.max_in_flight[stage] = max(self.max_in_flight[stage], self.in_flight[stage])
            self.hits[path] += 1
            self.arrivals[stage].append(now)
            self.samples.append((now, dict(self.in_flight)))
            return now

    def leave(self, stage: str, path: str, arrived: float) -> None:
        with self.lock:
            now = time.monotonic()
            self.in_flight[stage] -= 1
            self.served.append(Served(stage, path, arrived, now))
            self.samples.append((now, dict(self.in_flight)))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def count(self, stage: str) -> int:
        """Requests of ``stage`` that reached the server so far."""
        with self.lock:
            return len(self.arrivals[stage])

    def wait_for(self, condition: Callable[[], bool], timeout: float = 30.0, step: float = 0.001) -> bool:
        """Poll ``condition`` until it holds or ``timeout`` seconds pass; returns whether it held."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(step)
        return True

    def mean_in_flight(self, stage: str, start: float, end: float) -> float:
        """Time-weighted mean of the stage's in-flight count between two monotonic instants."""
        with self.lock:
            samples = list(self.samples)
        total = 0.0
        previous_time, previous = start, 0
        for moment, counts in samples:
            if moment < start:
                previous = counts.get(stage, 0)
                continue
            if moment > end:
                break
            total += previous * (moment - previous_time)
            previous_time, previous = moment, counts.get(stage, 0)
        total += previous * (end - previous_time)
        return total / (end - start) if end > start else 0.0

    def max_in_flight_between(self, stage: str, start: float, end: float) -> int:
        """The most requests of ``stage`` in flight at once between two monotonic instants."""
        with self.lock:
            samples = list(self.samples)
        highest, before = 0, 0
        for moment, counts in samples:
            if moment < start:
                before = counts.get(stage, 0)
            elif moment <= end:
                highest = max(highest, counts.get(stage, 0))
        return max(highest, before)

    def __enter__(self) -> CrawlSite:
        self.thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.server.shutdown()
        self.server.server_close()
