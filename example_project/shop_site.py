"""A fake shop on localhost: /list/<i> -> /detail/<i>-<j> -> /comments/<i>-<j>/<k>, with a page delay.

It counts what a crawl does to it: requests in flight per stage (and the most ever), hits per page (to check
exactly-once), and when each page was served, so the demo and the tests can see the caps from outside.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType


class ShopSite:
    def __init__(self, lists: int = 10, details: int = 20, comments: int = 5, delay: float = 0.03) -> None:
        self.lists, self.details, self.comments, self.delay = lists, details, comments, delay
        self.lock = threading.Lock()
        self.in_flight: Counter[str] = Counter()
        self.max_in_flight: Counter[str] = Counter()
        self.hits: Counter[str] = Counter()
        self.served: dict[str, list[float]] = defaultdict(list)  # stage -> time.time() of each page served
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = self.path.strip("/").split("/")
                stage = parts[0]
                with site.lock:
                    site.in_flight[stage] += 1
                    site.max_in_flight[stage] = max(site.max_in_flight[stage], site.in_flight[stage])
                    site.hits[self.path] += 1
                try:
                    time.sleep(site.delay)
                    body = site.page(parts).encode()
                    self.send_response(200 if body else 404)
                    self.send_header("Content-Type", "text/html")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                finally:
                    with site.lock:
                        site.in_flight[stage] -= 1
                        site.served[stage].append(time.time())

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def page(self, parts: list[str]) -> str:
        if parts[0] == "list" and len(parts) == 2:
            i = parts[1]
            links = "".join(f'<a class="detail" href="/detail/{i}-{j}">p{j}</a>' for j in range(self.details))
        elif parts[0] == "detail" and len(parts) == 2:
            p = parts[1]
            links = "".join(f'<a class="comments" href="/comments/{p}/{k}">c{k}</a>' for k in range(self.comments))
        elif parts[0] == "comments":
            links = "<p>comments</p>"
        else:
            return ""
        return f"<html><body>{links}</body></html>"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def totals(self) -> dict[str, int]:
        details = self.lists * self.details
        return {"list": self.lists, "detail": details, "comments": details * self.comments}

    def reset_counts(self) -> None:
        with self.lock:
            self.in_flight.clear()
            self.max_in_flight.clear()
            self.hits.clear()
            self.served.clear()

    def __enter__(self) -> ShopSite:
        self.thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.server.shutdown()
        self.server.server_close()
