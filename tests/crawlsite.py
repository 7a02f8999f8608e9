"""A local HTTP server for crawl tests: pages /<stage>/<n>, counts requests in flight per stage.

Threaded (one thread per request), so it never limits concurrency itself. ``delay`` (seconds) per page.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType


class CrawlSite:
    def __init__(self, delay: float = 0.05) -> None:
        self.delay = delay
        self.lock = threading.Lock()
        self.in_flight: Counter[str] = Counter()
        self.max_in_flight: Counter[str] = Counter()
        self.hits: Counter[str] = Counter()
        self.arrivals: dict[str, list[float]] = defaultdict(list)  # time.monotonic() per request, per stage
        self.samples: list[tuple[float, dict[str, int]]] = []
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stage = self.path.strip("/").split("/", 1)[0] or "root"
                with site.lock:
                    site.in_flight[stage] += 1
                    site.max_in_flight[stage] = max(site.max_in_flight[stage], site.in_flight[stage])
                    site.hits[self.path] += 1
                    site.arrivals[stage].append(time.monotonic())
                    site.samples.append((time.monotonic(), dict(site.in_flight)))
                try:
                    time.sleep(site.delay)
                    body = f"<html><body><p>{self.path}</p></body></html>".encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                finally:
                    with site.lock:
                        site.in_flight[stage] -= 1
                        site.samples.append((time.monotonic(), dict(site.in_flight)))

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def mean_in_flight(self, stage: str, start: float, end: float) -> float:
        """Time-weighted mean of the stage's in-flight count between two monotonic instants."""
        total = 0.0
        previous_time, previous = start, 0
        for moment, counts in self.samples:
            if moment < start:
                previous = counts.get(stage, 0)
                continue
            if moment > end:
                break
            total += previous * (moment - previous_time)
            previous_time, previous = moment, counts.get(stage, 0)
        total += previous * (end - previous_time)
        return total / (end - start) if end > start else 0.0

    def __enter__(self) -> CrawlSite:
        self.thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.server.shutdown()
        self.server.server_close()
