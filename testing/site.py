"""The one fake site of the tests, benchmarks and example crawl: pages ``/<stage>/...``, counted per
stage.

:class:`CrawlSite` answers any path; :class:`ShopSite` is the shop of the example crawl
(``/list/index -> /list/<i> -> /detail/<i>-<j> -> /comments/<i>-<j>/<k>``). Both watch a crawl from
the outside: requests in flight per stage (and the most ever), which workers have requests of a
stage in flight at once (a worker names itself in its User-Agent), hits per page (exactly-once), and
when each page was served.

Threaded (a thread per connection, HTTP/1.1 keep-alive), so it never limits concurrency itself. Each
page takes ``delay`` seconds (``delays[stage]`` overrides it per stage; ``?sleep=<s>`` per request).

A request counts as in flight from the moment its request line and headers have been read until just
*before* its response is written (or, with ``site.watch_disconnects = True``, until its client closes
the connection: a download timeout; counted in ``site.abandoned``): the client cannot have the
response, and so cannot have freed its slot, while the server still counts the request. The count
therefore never exceeds the slots held (a count taken after writing would race with the client's
next request, and show one request too many when a thread is slow to resume).

Reusable by any test: ``with CrawlSite(delay=0.05) as site: ... site.url,
site.max_in_flight["detail"]``.

Several host names: ``CrawlSite(hosts=4)`` answers on 127.0.0.1 to 127.0.0.4 (one port; Linux routes
all of 127/8 to the loopback), ``site.url_of(i)``; per host it counts requests in flight
(``max_host_in_flight``) and when each arrived (``host_arrivals``, as its handler thread saw it, and
``host_kernel_arrivals``, when the kernel received the request's bytes, before any thread of the
site ran: what a site's network sees; :meth:`gaps` are the intervals between request starts of one
host, by either), and for requests carrying ``X-Booked-Start`` (a delay's booked
start) when they arrived (``booked_starts``). ``python -m testing.site`` serves the shop alone
(``--host 0.0.0.0`` in a container).
``site.routes["/robots.txt"] = ("text/plain", "User-agent: *\nDisallow: /detail/")`` serves a fixed
body at a path (counted like any page, after the same delay); :func:`links_page` makes an HTML page
of links.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import select
import socket
import struct
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import NamedTuple
from urllib.parse import parse_qs, urlsplit

# Linux: the receive time of a socket's data as ancillary data (struct timespec, CLOCK_REALTIME)
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)


def kernel_arrival(connection: socket.socket) -> float | None:
    """When the kernel received the data waiting on ``connection`` (seconds since the epoch),
    without reading it; waits for data. None at the end of the connection or without the
    timestamp."""
    try:
        data, ancillary, _flags, _address = connection.recvmsg(
            1, socket.CMSG_SPACE(16), socket.MSG_PEEK
        )
    except OSError:
        return None
    for level, kind, raw in ancillary:
        if data and level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(raw) >= 16:
            seconds, nanos = struct.unpack("qq", raw[:16])
            return seconds + nanos / 1e9
    return None


STARTS_HEADER = (
    "X-Starts"  # JSON {stage, key:<key> or key:<scope>: confirmed start}, set by a test middleware
)
BOOKED_HEADER = "X-Booked-Start"  # the start a request booked (seconds since the epoch), set by a test middleware


class Served(NamedTuple):
    stage: str
    path: str
    arrived: float
    answered: float  # just before the response was written
    worker: str = ""  # the client's User-Agent


def links_page(paths: list[str]) -> tuple[str, str]:
    """A route: an HTML page linking to each path."""
    return "text/html", "<html><body>" + "".join(
        f'<a href="{p}">{p}</a>' for p in paths
    ) + "</body></html>"


class CrawlSite:
    """The server and what it saw; all times are ``time.monotonic()`` (the same clock in every
    process)."""

    def __init__(
        self,
        delay: float = 0.05,
        delays: dict[str, float] | None = None,
        port: int = 0,
        hosts: int = 1,
        address: str = "127.0.0.1",
    ) -> None:
        self.delay = delay
        self.host_in_flight: Counter[str] = Counter()
        self.max_host_in_flight: Counter[str] = Counter()
        self.host_arrivals: dict[str, list[float]] = defaultdict(list)  # host -> arrival instants
        # host -> when the kernel received each request's first bytes (wall clock; SO_TIMESTAMPNS):
        # what the site's network sees, before its own threads run
        self.host_kernel_arrivals: dict[str, list[float]] = defaultdict(list)
        # host -> (arrival, booked start) for requests carrying BOOKED_HEADER, both wall clock
        # (time.time(): the clock Redis's TIME reads on this machine)
        self.booked_starts: dict[str, list[tuple[float, float]]] = defaultdict(list)
        # the same with the kernel's receive time (host_kernel_arrivals) as the arrival
        self.kernel_booked_starts: dict[str, list[tuple[float, float]]] = defaultdict(list)
        # (arrival, {name: confirmed start}) for requests carrying STARTS_HEADER (their delays' and
        # rate windows' confirmed starts on Redis's clock, by stage, key or scope)
        self.scope_starts: list[tuple[float, dict[str, float]]] = []
        self.delays: dict[str, float] = dict(delays or {})
        self.lock = threading.Lock()
        self.in_flight: Counter[str] = Counter()
        self.max_in_flight: Counter[str] = Counter()
        self.hits: Counter[str] = Counter()  # path (without query) -> times requested
        self.arrivals: dict[str, list[float]] = defaultdict(list)  # stage -> arrival instants
        self.served: list[Served] = []  # one record per answered request
        # (instant, in-flight counts) at every change
        self.samples: list[tuple[float, dict[str, int]]] = []
        # path -> (content type, body) served instead of the default
        self.routes: dict[str, tuple[str, str]] = {}
        self.bodies: dict[str, bytes] = {}  # path -> body of the last POST there
        # stage -> worker -> requests
        self.workers_in_flight: dict[str, Counter[str]] = defaultdict(Counter)
        # stage -> most workers with a request in flight at once
        self.max_workers: Counter[str] = Counter()
        # True: a request whose client closed the connection before its page was ready stops
        # counting as in flight at once (counted in ``abandoned``), as a site's own load would
        self.watch_disconnects = False
        self.abandoned: Counter[str] = Counter()  # stage -> requests whose client gave up
        self.first_request: float | None = None  # wall clock (time.time()), for plots
        self.last_served: float | None = None
        # cleared: every request waits after its arrival until it is set again (or 60 s pass), so
        # that a test can hold a crawl where it is while something else happens
        self.open = threading.Event()
        self.open.set()
        site = self

        class Handler(BaseHTTPRequestHandler):
            # keep-alive, as real sites and Scrapy's connection pool use
            protocol_version = "HTTP/1.1"
            # with keep-alive, Nagle + delayed ACK would add 40 ms to responses
            disable_nagle_algorithm = True

            def setup(self) -> None:
                super().setup()
                with contextlib.suppress(OSError):
                    self.connection.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)

            def handle_one_request(self) -> None:
                self.kernel_arrived = kernel_arrival(self.connection)
                super().handle_one_request()

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                stage = site.stage_of(parts.path)
                sleep = parse_qs(parts.query).get("sleep")
                worker = self.headers.get("User-Agent", "")
                host = str(self.server.server_address[0])
                arrived = site.arrive(stage, parts.path, worker, host)
                if self.kernel_arrived is not None:
                    with site.lock:
                        site.host_kernel_arrivals[host].append(self.kernel_arrived)
                starts = self.headers.get(STARTS_HEADER)
                if starts:
                    with site.lock:
                        site.scope_starts.append((time.time(), json.loads(starts)))
                booked = self.headers.get(BOOKED_HEADER)
                if booked:
                    with site.lock:
                        site.booked_starts[host].append((time.time(), float(booked)))
                        if self.kernel_arrived is not None:
                            site.kernel_booked_starts[host].append(
                                (self.kernel_arrived, float(booked))
                            )
                site.open.wait(timeout=60)
                try:
                    stayed = self.serve_for(
                        float(sleep[0]) if sleep else site.delays.get(stage, site.delay)
                    )
                finally:
                    site.leave(stage, parts.path, arrived, worker, host)
                if not stayed:
                    with site.lock:
                        site.abandoned[stage] += 1
                    self.close_connection = True
                    return
                found = site.content(parts.path)
                kind, text = found or ("text/html", "")
                body = text.encode()
                status = "200 OK" if found else "404 Not Found"
                head = f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n"
                # a worker killed mid-request
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(head.encode() + body)  # one write: no small-packet delays

            def serve_for(self, seconds: float) -> bool:
                """Take ``seconds`` over the page; with ``watch_disconnects``, False as soon as
                the client closed the connection (it gave up: a download timeout)."""
                if not site.watch_disconnects:
                    time.sleep(seconds)
                    return True
                end = time.monotonic() + seconds
                while (left := end - time.monotonic()) > 0:
                    ready, _, _ = select.select([self.connection], [], [], min(left, 0.01))
                    if ready:
                        try:
                            data = self.connection.recv(1, socket.MSG_PEEK)
                        except OSError:
                            return False
                        if not data:
                            return False
                        time.sleep(min(left, 0.01))  # bytes of a next request: not a close
                return True

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

        self.server = Server((address, port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.more_servers = [
            Server((f"127.0.0.{i}", self.port), Handler) for i in range(2, hosts + 1)
        ]
        for server in self.more_servers:
            server.daemon_threads = True
        self.more_threads = [
            threading.Thread(target=s.serve_forever, daemon=True) for s in self.more_servers
        ]

    def stage_of(self, path: str) -> str:
        """The stage a path is counted under: its first segment."""
        return path.strip("/").split("/", 1)[0] or "root"

    def content(self, path: str) -> tuple[str, str] | None:
        """(content type, body) of a page, None for a 404; a fixed route if one is set."""
        return self.routes.get(path, ("text/html", f"<html><body><p>{path}</p></body></html>"))

    def arrive(self, stage: str, path: str, worker: str = "", host: str = "127.0.0.1") -> float:
        with self.lock:
            now = time.monotonic()
            self.host_in_flight[host] += 1
            self.max_host_in_flight[host] = max(
                self.max_host_in_flight[host], self.host_in_flight[host]
            )
            self.host_arrivals[host].append(now)
            if self.first_request is None:
                self.first_request = time.time()
            self.workers_in_flight[stage][worker] += 1
            self.max_workers[stage] = max(
                self.max_workers[stage], len(self.workers_in_flight[stage])
            )
            self.in_flight[stage] += 1
            self.max_in_flight[stage] = max(self.max_in_flight[stage], self.in_flight[stage])
            self.hits[path] += 1
            self.arrivals[stage].append(now)
            self.samples.append((now, dict(self.in_flight)))
            return now

    def leave(
        self, stage: str, path: str, arrived: float, worker: str = "", host: str = "127.0.0.1"
    ) -> None:
        with self.lock:
            now = time.monotonic()
            self.host_in_flight[host] -= 1
            if not self.host_in_flight[host]:
                del self.host_in_flight[host]
            counts = self.workers_in_flight[stage]
            counts[worker] -= 1
            if counts[worker] <= 0:
                del counts[worker]
            self.last_served = time.time()
            self.in_flight[stage] -= 1
            if not self.in_flight[stage]:
                # only what is in flight: a sample copies it (thousands of stages)
                del self.in_flight[stage]
            self.served.append(Served(stage, path, arrived, now, worker))
            self.samples.append((now, dict(self.in_flight)))

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url_of(self, host: int) -> str:
        """The site's URL on host name number ``host`` (1 is 127.0.0.1, the same as ``url``)."""
        return f"http://127.0.0.{host}:{self.port}"

    def gaps(self, host: str, kernel: bool = False) -> list[float]:
        """Seconds between consecutive request starts (arrivals) of one host: as the handler
        thread saw them, or (``kernel``) as the kernel received them."""
        with self.lock:
            arrivals = sorted((self.host_kernel_arrivals if kernel else self.host_arrivals)[host])
        return [later - earlier for earlier, later in itertools.pairwise(arrivals)]

    def count(self, stage: str) -> int:
        """Requests of ``stage`` that reached the server so far."""
        with self.lock:
            return len(self.arrivals[stage])

    def done(self, stage: str) -> int:
        """Requests of ``stage`` answered so far."""
        with self.lock:
            return sum(1 for record in self.served if record.stage == stage)

    def reset_counts(self) -> None:
        """Forget what was seen (between two crawls of one site)."""
        with self.lock:
            for seen in (
                self.in_flight,
                self.max_in_flight,
                self.workers_in_flight,
                self.max_workers,
                self.hits,
                self.abandoned,
            ):
                seen.clear()
            self.host_in_flight.clear()
            self.max_host_in_flight.clear()
            self.host_arrivals.clear()
            self.host_kernel_arrivals.clear()
            self.booked_starts.clear()
            self.scope_starts.clear()
            self.arrivals.clear()
            self.served.clear()
            self.samples.clear()
            self.first_request = self.last_served = None

    def wait_for(
        self, condition: Callable[[], bool], timeout: float = 30.0, step: float = 0.001
    ) -> bool:
        """Poll ``condition`` until it holds or ``timeout`` seconds pass; returns whether it
        held."""
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
        for thread in self.more_threads:
            thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for server in (self.server, *self.more_servers):
            server.shutdown()
            server.server_close()


STAGES = ("list", "detail", "comments")


class ShopSite(CrawlSite):
    """The example crawl's shop: ``lists`` list pages, ``details`` products on each, ``comments``
    pages on each."""

    def __init__(
        self,
        lists: int = 10,
        details: int = 20,
        comments: int = 5,
        delay: float = 0.03,
        port: int = 0,
        address: str = "127.0.0.1",
    ) -> None:
        super().__init__(delay, port=port, address=address)
        self.lists, self.details, self.comments = lists, details, comments

    def stage_of(self, path: str) -> str:
        # counted apart from the list pages
        return "index" if path == "/list/index" else super().stage_of(path)

    def content(self, path: str) -> tuple[str, str] | None:
        parts = path.strip("/").split("/")
        if parts == ["list", "index"]:  # the category: links to all its list pages
            links = "".join(
                f'<a class="list" href="/list/{i}">page {i}</a>' for i in range(self.lists)
            )
        elif (
            parts[0] == "list"
            and len(parts) == 2
            and parts[1].isdigit()
            and int(parts[1]) < self.lists
        ):
            i = parts[1]
            links = "".join(
                f'<a class="detail" href="/detail/{i}-{j}">p{j}</a>' for j in range(self.details)
            )
        elif parts[0] == "detail" and len(parts) == 2:
            p = parts[1]
            links = "".join(
                f'<a class="comments" href="/comments/{p}/{k}">c{k}</a>'
                for k in range(self.comments)
            )
        elif parts[0] == "comments" and len(parts) == 3:
            links = "<p>comments</p>"
        else:
            return None
        return "text/html", f"<html><body>{links}</body></html>"

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
        """Every page of the shop a crawl from the list pages fetches, as paths (the index is not
        one of them)."""
        lists = range(self.lists)
        details = [f"{i}-{j}" for i in lists for j in range(self.details)]
        return {
            *(f"/list/{i}" for i in lists),
            *(f"/detail/{p}" for p in details),
            *(f"/comments/{p}/{k}" for p in details for k in range(self.comments)),
        }


def add_shop_arguments(
    parser: argparse.ArgumentParser,
    *,
    lists: int = 10,
    details: int = 50,
    comments: int = 3,
    delay: float = 0.05,
) -> None:
    """The shop's size and speed as command-line options (the demo, the benchmarks, ``python -m
    testing.site``)."""
    parser.add_argument(
        "--lists", type=int, default=lists, help=f"list pages in the category (default {lists})"
    )
    parser.add_argument(
        "--details", type=int, default=details, help=f"products per list page (default {details})"
    )
    parser.add_argument(
        "--comments", type=int, default=comments, help=f"comment pages per product ({comments})"
    )
    parser.add_argument(
        "--delay",
        type=float,
        default=delay,
        help=f"seconds the site takes per page (default {delay})",
    )


# -- measuring caps from what the site saw ---------------------------------------------------------


def most_at_once(served: list[Served], cap: int, who: str = "request") -> tuple[int, float]:
    """The most holders in flight at one instant, and the seconds during which there were more than
    ``cap``.

    A holder is a request (``who="request"``) or a worker (``who="worker"``: all of a worker's
    requests count once).
    """
    events = []
    for n, record in enumerate(served):
        holder = record.worker if who == "worker" else str(n)
        events += [(record.arrived, 1, holder), (record.answered, -1, holder)]
    events.sort(key=lambda event: (event[0], event[1]))  # at one instant, answers before arrivals
    open_: Counter[str] = Counter()
    most, above, since = 0, 0.0, None
    for instant, step, holder in events:
        open_[holder] += step
        if open_[holder] == 0:
            del open_[holder]
        holders = len(open_)
        most = max(most, holders)
        if holders > cap and since is None:
            since = instant
        elif holders <= cap and since is not None:
            above += instant - since
            since = None
    return most, above


def longest_pause(records: list[Served]) -> float:
    """The longest time with no request in flight, between the first arrival and the last answer:
    what a failover stalled the crawl for."""
    pause, busy_until = 0.0, None
    for record in sorted(records, key=lambda r: r.arrived):
        if busy_until is not None and record.arrived > busy_until:
            pause = max(pause, record.arrived - busy_until)
        busy_until = record.answered if busy_until is None else max(busy_until, record.answered)
    return pause


def served(site: CrawlSite, *paths: str) -> list[Served]:
    """The site's records of requests to pages under the given first path segments."""
    with site.lock:
        return [record for record in site.served if record.stage in paths]


def arguments() -> argparse.ArgumentParser:
    """``python -m testing.site``'s options (deploy/docker-compose.yml's shop service uses them;
    tests/test_deploy.py parses its command with this parser)."""
    parser = argparse.ArgumentParser(
        prog="python -m testing.site", description="Serve the fake shop."
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; 0.0.0.0 in a container)",
    )
    add_shop_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    shop = ShopSite(
        args.lists, args.details, args.comments, args.delay, args.port, address=args.host
    )
    with shop:
        print(f"shop at {shop.start_url} (listening on {args.host}); Ctrl-C to stop", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            shop.thread.join()


if __name__ == "__main__":
    main()
