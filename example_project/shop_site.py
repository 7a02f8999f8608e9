"""A fake shop on localhost: /list/index -> /list/<i> -> /detail/<i>-<j> -> /comments/<i>-<j>/<k>, page delay.

It watches what a crawl does to it, from the outside: requests in flight per stage (and the most ever), which
workers have requests of a stage in flight at once (a worker names itself in its User-Agent; the most ever is
the workers-per-stage cap as the site sees it), hits per page (exactly-once), and when each page was served.
Threaded, so it never limits the crawl's concurrency itself. ``python -m example_project.shop_site`` serves it
alone.
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

STAGES = ("list", "detail", "comments")


class ShopSite:
    def __init__(
        self, lists: int = 10, details: int = 20, comments: int = 5, delay: float = 0.03, port: int = 0
    ) -> None:
        self.lists, self.details, self.comments, self.delay = lists, details, comments, delay
        self.lock = threading.Lock()
        self.in_flight: Counter[str] = Counter()
        self.max_in_flight: Counter[str] = Counter()
        self.workers_in_flight: dict[str, Counter[str]] = defaultdict(Counter)  # stage -> worker -> requests
        self.max_workers: Counter[str] = Counter()  # stage -> most workers with a request in flight at once
        self.hits: Counter[str] = Counter()
        self.served: dict[str, list[float]] = defaultdict(list)  # stage -> time.time() each page was served
        self.first_request: float | None = None
        self.last_served: float | None = None
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = self.path.strip("/").split("/")
                stage = "index" if parts == ["list", "index"] else parts[0]  # counted apart from the list pages
                worker = self.headers.get("User-Agent", "")
                site._arrive(stage, worker, self.path)
                try:
                    time.sleep(site.delay)
                    body = site.page(parts).encode()
                    self.send_response(200 if body else 404)
                    self.send_header("Content-Type", "text/html")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the worker was killed mid-request (the kill -9 run): nothing to answer
                finally:
                    site._leave(stage, worker)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _arrive(self, stage: str, worker: str, path: str) -> None:
        with self.lock:
            if self.first_request is None:
                self.first_request = time.time()
            self.in_flight[stage] += 1
            self.max_in_flight[stage] = max(self.max_in_flight[stage], self.in_flight[stage])
            self.workers_in_flight[stage][worker] += 1
            self.max_workers[stage] = max(self.max_workers[stage], len(self.workers_in_flight[stage]))
            self.hits[path] += 1

    def _leave(self, stage: str, worker: str) -> None:
        with self.lock:
            self.in_flight[stage] -= 1
            counts = self.workers_in_flight[stage]
            counts[worker] -= 1
            if counts[worker] <= 0:
                del counts[worker]
            now = time.time()
            self.served[stage].append(now)
            self.last_served = now

    def page(self, parts: list[str]) -> str:
        if parts == ["list", "index"]:  # the category: links to all its list pages
            links = "".join(f'<a class="list" href="/list/{i}">page {i}</a>' for i in range(self.lists))
        elif parts[0] == "list" and len(parts) == 2 and parts[1].isdigit() and int(parts[1]) < self.lists:
            i = parts[1]
            links = "".join(f'<a class="detail" href="/detail/{i}-{j}">p{j}</a>' for j in range(self.details))
        elif parts[0] == "detail" and len(parts) == 2:
            p = parts[1]
            links = "".join(f'<a class="comments" href="/comments/{p}/{k}">c{k}</a>' for k in range(self.comments))
        elif parts[0] == "comments" and len(parts) == 3:
            links = "<p>comments</p>"
        else:
            return ""
        return f"<html><body>{links}</body></html>"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def start_url(self) -> str:
        """The category index, which links every list page: the crawl's one start URL."""
        return f"{self.url}/list/index"

    def list_urls(self) -> list[str]:
        return [f"{self.url}/list/{i}" for i in range(self.lists)]

    @property
    def totals(self) -> dict[str, int]:
        """Items per stage (the index page yields none)."""
        details = self.lists * self.details
        return {"list": self.lists, "detail": details, "comments": details * self.comments}

    def expected_paths(self) -> set[str]:
        """Every page of the shop a crawl from the list pages fetches, as paths (the index is not one of them)."""
        lists = range(self.lists)
        details = [f"{i}-{j}" for i in lists for j in range(self.details)]
        return {
            *(f"/list/{i}" for i in lists),
            *(f"/detail/{p}" for p in details),
            *(f"/comments/{p}/{k}" for p in details for k in range(self.comments)),
        }

    def done(self, stage: str) -> int:
        with self.lock:
            return len(self.served.get(stage, ()))

    def reset_counts(self) -> None:
        with self.lock:
            self.in_flight.clear()
            self.max_in_flight.clear()
            self.workers_in_flight.clear()
            self.max_workers.clear()
            self.hits.clear()
            self.served.clear()
            self.first_request = self.last_served = None

    def __enter__(self) -> ShopSite:
        self.thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.server.shutdown()
        self.server.server_close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m example_project.shop_site", description="Serve the fake shop.")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--lists", type=int, default=10)
    parser.add_argument("--details", type=int, default=50)
    parser.add_argument("--comments", type=int, default=3)
    parser.add_argument("--delay", type=float, default=0.05)
    args = parser.parse_args()
    with ShopSite(args.lists, args.details, args.comments, args.delay, args.port) as site:
        print(f"shop at {site.start_url}; Ctrl-C to stop", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            site.thread.join()


if __name__ == "__main__":
    main()
