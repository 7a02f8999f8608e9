"""The live web dashboard: ``python -m scrapy_redislock dashboard`` and ``scrapy redislock
dashboard``.

One aiohttp server (the ``dashboard`` extra: aiohttp, prometheus_client) with:

- ``/``: one page (``dashboard.html``: plain HTML and JavaScript, no build step) that follows
  ``/events``. Per stage it shows limit, held, free, debt, waiters and the holders with their lease
  left (expired ones marked); per StageWorkerMixin spider the queue backlog and the workers, alive
  or dead, and the stage each works on; charts of grants per second and queue lengths over the last
  ``--history`` seconds.
- ``/events``: server-sent events: the history, then one frame every ``--interval`` seconds.
- ``/api/status``: the latest frame as JSON.
- ``/metrics``: Prometheus's text format, read from Redis at each scrape (no crawl needs to run).
- ``POST /api/set-limit``, ``/api/release``, ``/api/reset``, ``/api/requeue``: only with
  ``--allow-control`` and the header ``Authorization: Bearer <token>``, the token printed at start;
  they run the command line's own sub-commands.

Redis is read by :mod:`scrapy_redislock.cli.status` alone (over
:mod:`scrapy_redislock.lock.status`), with the blocking client in worker threads, never on the event
loop. Reads no settings itself: the command line resolves where to connect (REDISLOCK_URL,
REDIS_URL, REDISLOCK_KEY_PREFIX, REDISLOCK_TTL; see :mod:`scrapy_redislock.cli.target`). The page
shows the URL masked. Started while Redis is down or out of reach, it serves anyway: the page says
Redis is unreachable and ``/metrics`` has ``redislock_up 0``, until Redis answers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import io
import ipaddress
import json
import logging
import secrets
import signal
import socket
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

import redis
import redis.exceptions
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scrapy_redislock._redis import RedisClient
from scrapy_redislock.cli.commands import COMMANDS
from scrapy_redislock.cli.render import Streams, never_goes
from scrapy_redislock.cli.status import read_all
from scrapy_redislock.cli.target import EXIT_OK, EXIT_USAGE, REDIS_ERRORS, CliError, Target, failure
from scrapy_redislock.lock.status import StageStatus
from scrapy_redislock.workers.status import SpiderStatus, WorkerStatus

logger = logging.getLogger(__name__)

HEARTBEAT = 15.0  # seconds between keep-alive comments on an idle event stream
MAX_BODY = 16 * 1024  # bytes of a control request's JSON body (a few names and a number)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAX_HOLDERS_SHOWN = 200  # grants per stage sent to the page; the counts stay exact
CONTROL_COMMANDS = ("set-limit", "release", "reset", "requeue")
Frame = dict[str, Any]
Family = GaugeMetricFamily | CounterMetricFamily


@dataclass
class SeenWorker:
    """A worker as the dashboard last saw it registered, and what became of it."""

    status: WorkerStatus
    ttl: float
    gone_at: float | None = None
    # alive, dead (past its beat deadline, or reaped by the others), left (closed)
    state: str = "alive"


class Sampler:
    """Reads Redis every interval (in a thread), keeps the charts' history and hands frames to the
    open pages."""

    def __init__(self, target: Target, interval: float, history: float, control: bool) -> None:
        self.target = target
        self.client: RedisClient = target.client()
        self.interval = interval
        self.history = history
        self.control = control
        self.latest: Frame = {}
        self.points: deque[Frame] = deque()
        self.subscribers: set[asyncio.Queue[Frame | None]] = set()
        self.workers: dict[tuple[str, str], SeenWorker] = {}
        self.queue_stages: dict[str, set[str]] = {}
        self.delivered: tuple[float, dict[str, int]] | None = None
        self.wakeup = asyncio.Event()

    def read(self) -> tuple[list[StageStatus], list[SpiderStatus]]:
        return read_all(self.client, self.target.prefix, self.target.ttl)

    # -- frames ------------------------------------------------------------------------------------

    def frame(self, stages: list[StageStatus], spiders: list[SpiderStatus], now: float) -> Frame:
        rates = self._rates(stages, now)
        stage_rows = []
        for stage in stages:
            row = stage.to_json()
            row["grants_more"] = max(0, len(row["grants"]) - MAX_HOLDERS_SHOWN)
            row["grants"] = row["grants"][:MAX_HOLDERS_SHOWN]
            row["grants_per_second"] = rates.get(stage.label)
            row["never_goes"] = never_goes(stage, stage.label)  # paused at 0 with requests waiting
            stage_rows.append(row)
        spider_rows = [self._spider(spider, now) for spider in spiders]
        # spiders no longer in Redis whose workers the page still shows (as left or dead)
        gone = sorted({name for name, _ in self.workers} - {spider.spider for spider in spiders})
        spider_rows += [self._spider(SpiderStatus(name, 0.0, {}), now) for name in gone]
        # adaptive limits (REDISLOCK_ADAPTIVE): the limit of each lock's last window beside its
        # latency and its share of overload answers and errors
        windows = {s.label: s.adaptive for s in stages if s.adaptive is not None}
        point = {
            "t": now,
            "grants": {name: rate for name, rate in rates.items() if rate is not None},
            "queues": {
                f"{s['spider']}/{stage}": n for s in spider_rows for stage, n in s["queues"].items()
            },
            "limits": {label: w.limit for label, w in windows.items()},
            "latency": {
                label: round(w.latency * 1000, 1)
                for label, w in windows.items()
                if w.latency is not None
            },
            "errors": {
                label: round(100 * (w.overload_rate + w.error_rate), 2)
                for label, w in windows.items()
            },
        }
        return {
            **self.empty_frame(now),
            "stages": stage_rows,
            "spiders": spider_rows,
            "point": point,
        }

    def empty_frame(self, now: float, error: str | None = None) -> Frame:
        """A frame with nothing read (yet): what the page shows while Redis has never answered."""
        return {
            "time": now,
            "url": self.target.safe_url,
            "prefix": self.target.prefix,
            "interval": self.interval,
            "history": self.history,
            "control": self.control,
            "error": error,
            "stages": [],
            "spiders": [],
            "point": {"t": now, "grants": {}, "queues": {}},
        }

    def _rates(self, stages: list[StageStatus], now: float) -> dict[str, float | None]:
        """Grants per second since the last read (None for a stage seen for the first time)."""
        delivered = {s.label: s.delivered for s in stages if s.exists}
        previous = self.delivered
        self.delivered = (now, delivered)
        rates: dict[str, float | None] = dict.fromkeys(delivered)
        if previous is not None and now > previous[0]:
            for name, count in delivered.items():
                if name in previous[1]:
                    # A recreated lock starts counting again (as a Prometheus counter reset would).
                    before = previous[1][name] if count >= previous[1][name] else 0
                    rates[name] = round((count - before) / (now - previous[0]), 3)
        return rates

    def _spider(self, spider: SpiderStatus, now: float) -> Frame:
        row = spider.to_json()
        stages = self.queue_stages.setdefault(spider.spider, set())
        stages.update(spider.queues)
        row["queues"] = {stage: spider.queues.get(stage, 0) for stage in sorted(stages)}
        present = {worker.worker for worker in spider.workers}
        for worker, raw in zip(spider.workers, row["workers"], strict=True):
            raw["state"], raw["gone_at"] = ("alive" if worker.alive else "dead"), None
            self.workers[(spider.spider, worker.worker)] = SeenWorker(
                worker, spider.ttl, state=raw["state"]
            )
        for (name, worker_id), seen in sorted(self.workers.items()):
            if name != spider.spider or worker_id in present:
                continue
            if seen.gone_at is None:
                seen.gone_at = now
                # A closing worker unregisters itself within a beat; one that vanished after missing
                # beats was reaped by the others: it is dead. (Inferred: keep --interval well below
                # half the silence a worker may keep: 5 s with work, the ttl without.)
                silent = (
                    not seen.status.alive
                    or seen.status.silence >= (seen.status.grace or seen.ttl) / 2
                )
                seen.state = "dead" if silent else "left"
            if now - seen.gone_at > self.history:
                del self.workers[(name, worker_id)]
                continue
            raw = {**asdict(seen.status), "host": seen.status.host, "pid": seen.status.pid}
            row["workers"].append(
                {**raw, "alive": False, "state": seen.state, "gone_at": seen.gone_at}
            )
        return row

    # -- the loop ----------------------------------------------------------------------------------

    async def sample(self) -> None:
        now = round(time.time(), 3)
        try:
            stages, spiders = await asyncio.to_thread(self.read)
        except (*REDIS_ERRORS, OSError) as exc:
            message, _ = failure(exc, self.target)
            empty = self.empty_frame(now, message)
            frame = {**empty, **self.latest, "time": now, "error": message, "point": empty["point"]}
        else:
            frame = self.frame(stages, spiders, now)
        self.publish(frame)

    def publish(self, frame: Frame) -> None:
        self.latest = frame
        self.points.append(frame["point"])
        while self.points and frame["time"] - self.points[0]["t"] > self.history:
            self.points.popleft()
        self._send(frame)

    def _send(self, frame: Frame | None) -> None:
        """To every open page (None: the stream ends)."""
        for queue in self.subscribers:
            if queue.full():  # a page that does not keep up misses frames, not the newest
                queue.get_nowait()
            queue.put_nowait(frame)

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wakeup.wait(), self.interval)
            self.wakeup.clear()
            try:
                await self.sample()
            # never let the loop die silently: the page would freeze on an old frame
            except Exception:
                logger.exception("Dashboard: reading Redis failed; retrying")

    def subscribe(self) -> asyncio.Queue[Frame | None]:
        queue: asyncio.Queue[Frame | None] = asyncio.Queue(maxsize=8)
        self.subscribers.add(queue)
        return queue

    def close(self) -> None:
        self._send(None)
        self.client.close()


# -- Prometheus ------------------------------------------------------------------------------------


class RedisCollector(Collector):
    """The locks and worker queues under the prefix, read from Redis at each scrape, named as
    Prometheus advises."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        try:
            stages, spiders = self.sampler.read()
            up = 1
        except (*REDIS_ERRORS, OSError):
            stages, spiders, up = [], [], 0
        yield from stage_metrics(stages)
        yield from spider_metrics(spiders)
        yield GaugeMetricFamily("redislock_up", "1 if Redis answered this scrape, else 0", value=up)
        yield GaugeMetricFamily(
            "redislock_scrape_duration_seconds",
            "Seconds this scrape took to read Redis",
            time.perf_counter() - started,
        )


# Every stage metric (redislock_<name>) and its help, in the order /metrics lists them.
STAGE_METRICS = {
    "stage_limit": "Slots of the stage, cluster-wide",
    "stage_held": "Slots held now",
    "stage_free": "Slots free now",
    "stage_debt": "Held slots to give back before a new grant (after lowering the limit)",
    "stage_waiters": "Requests or workers waiting for a slot, as each process last reported",
    "stage_expired_grants": "Held slots whose lease ran out (holder stopped renewing)",
    "stage_processes": "Processes registered with the stage's lock",
    "stage_ttl_seconds": "Lease of a slot",
    "stage_fence": "Last fencing token generated",
    "stage_present": "1 if the lock's stream is in Redis, 0 if it was lost (the next process recreates it)",
    "grants": "Slots granted since the lock was created (and slots withdrawn by lowering the limit)",
    "stage_unreadable": "1 if the stage's state in Redis holds a value its scripts never write (status says which)",
}
COUNTERS = {"grants"}  # only grow (Prometheus adds _total); the others are gauges
# The last window of each adaptive limit (REDISLOCK_ADAPTIVE), as redislock_adaptive_<name>.
ADAPTIVE_METRICS = {
    "limit": "The limit the stage's or key's adaptive controller applied last",
    "latency_seconds": "Mean download latency of its last window",
    "noload_latency_seconds": "Its estimate of the latency with no queue",
    "overload_ratio": "429 and 503 answers per outcome in its last window",
    "error_ratio": "Timeouts and connection errors per outcome in its last window",
}

# Per StageWorkerMixin spider, beside redislock_queue_length (per spider and stage).
SPIDER_METRICS = {
    "workers_alive": "Workers whose last beat's deadline has not passed",
    "workers_dead": "Registered workers past their beat deadline, not yet reaped",
    "requests_in_flight": "Requests popped by workers and not finished yet",
    "spider_unreadable": "1 if the spider's state in Redis holds a value its scripts never write (status says which)",
}


def _families(prefix: str, helps: dict[str, str], labels: list[str]) -> dict[str, Family]:
    """One metric family per name of ``helps``, in its order."""
    return {
        name: (CounterMetricFamily if name in COUNTERS else GaugeMetricFamily)(
            f"{prefix}{name}", doc, labels=labels
        )
        for name, doc in helps.items()
    }


def stage_metrics(stages: list[StageStatus]) -> Iterator[Metric]:
    """STAGE_METRICS of every stage, then ADAPTIVE_METRICS of every stage that adapts."""
    metrics = _families("redislock_", STAGE_METRICS, ["stage", "group"])
    adaptive = _families("redislock_adaptive_", ADAPTIVE_METRICS, ["stage", "group"])
    for s in stages:
        for family, values in ((metrics, _stage_values(s)), (adaptive, _adaptive_values(s))):
            for name, value in values.items():
                if value is not None:
                    family[name].add_metric([s.stage, s.group], value)
    yield from metrics.values()
    yield from adaptive.values()


def _stage_values(s: StageStatus) -> dict[str, float | None]:
    """A stage's STAGE_METRICS (None: not reported): an unreadable stage says only that; one whose
    stream was lost only its limit, ttl and that it is not present."""
    if s.error:
        return {"stage_unreadable": 1}
    values = {"stage_limit": s.limit, "stage_ttl_seconds": s.ttl, "stage_present": int(s.exists)}
    if not s.exists:
        return {**values, "stage_unreadable": 0}
    return {
        **values,
        "stage_held": s.held,
        "stage_free": s.free,
        "stage_debt": s.debt,
        "stage_waiters": s.waiters,
        "stage_expired_grants": s.expired,
        "stage_processes": len(s.processes),
        "stage_fence": s.fence,
        "grants": s.delivered,
        "stage_unreadable": 0,
    }


def _adaptive_values(s: StageStatus) -> dict[str, float | None]:
    """A stage's ADAPTIVE_METRICS: its adaptive limit's last window; none when it does not adapt."""
    window = s.adaptive
    if window is None:
        return {}
    return {
        "limit": window.limit,
        "latency_seconds": window.latency,
        "noload_latency_seconds": window.noload,
        "overload_ratio": window.overload_rate,
        "error_ratio": window.error_rate,
    }


def spider_metrics(spiders: list[SpiderStatus]) -> Iterator[Metric]:
    queue = GaugeMetricFamily(
        "redislock_queue_length", "Requests waiting in a stage queue", labels=["spider", "stage"]
    )
    alive, dead, in_flight, unreadable = _families(
        "redislock_", SPIDER_METRICS, ["spider"]
    ).values()
    for spider in spiders:
        unreadable.add_metric([spider.spider], 1 if spider.error else 0)
        for stage, length in spider.queues.items():
            queue.add_metric([spider.spider, stage], length)
        alive.add_metric([spider.spider], spider.alive)
        dead.add_metric([spider.spider], spider.dead)
        in_flight.add_metric([spider.spider], sum(w.in_flight for w in spider.workers))
    yield from (queue, alive, dead, in_flight, unreadable)


# -- the web application ---------------------------------------------------------------------------


def _event(name: str, data: Any) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def allowed_hosts(host: str, given: list[str]) -> frozenset[str] | None:
    """The host names the page may be reached by (the Host header's name, lower case; None: any):
    the address it listens on (loopback: every loopback name; every address: this machine's names)
    and the ``--allowed-host`` names. A DNS-rebinding page reaches the dashboard under its own
    name, which is none of these."""
    if "*" in given:
        return None
    names = {host.lower(), *(name.lower() for name in given)}
    if host in LOOPBACK:
        names.update(LOOPBACK)
    if host in ("0.0.0.0", "::", ""):
        names.update({*LOOPBACK, socket.gethostname().lower(), socket.getfqdn().lower()})
    return frozenset(names)


def _ip_literal(name: str) -> bool:
    """An address, not a name: no DNS answer can rebind it to another site, so a Host that is one
    is always answered (e.g. Prometheus scraping ``10.0.0.5:8030``)."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _host_name(header: str) -> str:
    """The name of a Host header or an Origin's host, without the port: ``[::1]:80`` -> ``::1``."""
    if header.startswith("["):
        return header[1:].partition("]")[0].lower()
    return header.rpartition(":")[0].lower() if header.count(":") == 1 else header.lower()


class Dashboard:
    """The routes; ``token`` None means read-only; ``hosts``: the Host names it answers (None:
    any)."""

    def __init__(
        self, sampler: Sampler, token: str | None, io: Streams, hosts: frozenset[str] | None = None
    ) -> None:
        self.sampler = sampler
        self.token = token
        self.io = io
        self.hosts = hosts
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RedisCollector(sampler))

    @web.middleware
    async def check_host(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Refuse (421) a request whose Host is not a name the dashboard answers, and (403) a POST
        whose Origin is another site's: a page under the attacker's name (DNS rebinding) must not
        read the status or the metrics."""
        if self.hosts is not None:
            host = _host_name(request.headers.get("Host", ""))
            if host not in self.hosts and not _ip_literal(host):
                return _failed("wrong Host: start the dashboard with --allowed-host", 421)
            origin = request.headers.get("Origin")
            if request.method != "GET" and origin is not None:
                scheme, _, rest = origin.partition("://")
                if scheme not in ("http", "https") or _host_name(rest) not in self.hosts:
                    return _failed("cross-origin request refused", 403)
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.check_host], client_max_size=MAX_BODY)
        app.router.add_get("/", self.page)
        app.router.add_get("/events", self.events)
        app.router.add_get("/api/status", self.status)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/favicon.ico", self.favicon)
        app.router.add_post("/api/{command}", self.steer)
        return app

    async def favicon(self, request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(
            body=(resources.files("scrapy_redislock.cli") / "dashboard.html").read_bytes(),
            content_type="text/html",
            headers={"Cache-Control": "no-store"},
        )

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.sampler.latest)

    async def metrics(self, request: web.Request) -> web.Response:
        body = await asyncio.to_thread(generate_latest, self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def events(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        queue = self.sampler.subscribe()
        try:
            history = {"points": list(self.sampler.points), "frame": self.sampler.latest}
            await response.write(_event("history", history))
            while True:
                try:
                    frame = await asyncio.wait_for(queue.get(), HEARTBEAT)
                except TimeoutError:
                    await response.write(b": keep-alive\n\n")
                    continue
                if frame is None:  # shutting down
                    break
                await response.write(_event("frame", frame))
        except ConnectionError:  # ConnectionResetError too
            pass  # the page went away
        finally:
            self.sampler.subscribers.discard(queue)
        return response

    def _refused(self, request: web.Request) -> str | None:
        if self.token is None:
            return "control is off: start the dashboard with --allow-control to steer from the page"
        scheme, _, value = request.headers.get("Authorization", "").partition(" ")
        given = value.strip().encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, self.token.encode()):
            return "wrong or missing token: give the token the dashboard printed at start"
        return None

    async def steer(self, request: web.Request) -> web.Response:
        command = request.match_info["command"]
        if command not in CONTROL_COMMANDS:
            raise web.HTTPNotFound()
        refused = self._refused(request)
        if refused:
            return _failed(refused, 403)
        body = await _json_body(request)
        if not isinstance(body, dict):
            return _failed("the body must be a JSON object", 400)
        given = {name: str(body.get(name, "")) for name in ("stage", "limit", "holder", "worker")}
        opts = argparse.Namespace(
            command=command,
            **given,
            group=None if body.get("group") is None else str(body.get("group")),
            force=False,  # a reset of live holders is refused here: the command line's --force
            create=False,
            ttl=None,
            adaptive=False,
            yes=True,
        )
        code, message = await asyncio.to_thread(self.run_command, opts)
        self.io.say(  # say() escapes control characters: the stage is the caller's text
            f"control from {request.remote}: {command} {given['stage'][:200]}: {message}"
        )
        self.sampler.wakeup.set()  # show the result at once
        if code != EXIT_OK:
            return _failed(message, 400 if code == EXIT_USAGE else 409)
        return web.json_response({"ok": True, "message": message})

    def run_command(self, opts: argparse.Namespace) -> tuple[int, str]:
        """One of the command line's sub-commands, confirmed; (exit status, what it said)."""
        out, err = io.StringIO(), io.StringIO()
        try:
            code = COMMANDS[opts.command](
                opts, self.sampler.target, Streams(io.StringIO(), out, err)
            )
        except (CliError, *REDIS_ERRORS, OSError) as exc:
            message, code = failure(exc, self.sampler.target)
            return code, message
        return code, (out.getvalue() + err.getvalue()).strip()


def _failed(error: str, status: int) -> web.Response:
    """A refused or failed request, as the page reads it."""
    return web.json_response({"ok": False, "error": error}, status=status)


async def _json_body(request: web.Request) -> Any:
    """The request's JSON body; None when it is not JSON, nests deeper than Python parses, or is
    over MAX_BODY bytes (the caller answers 400)."""
    raw = await request.content.read(MAX_BODY + 1)
    if len(raw) > MAX_BODY:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


# Redis is down or out of reach: the dashboard and /metrics start anyway and say so (an exporter
# must report an outage, not exit). Whatever else fails (credentials, ACL, a bad URL option) stops
# them at once, in one line.
UNREACHABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.RedisClusterException,
    OSError,
)
# ConnectionErrors too
REFUSED = (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError)


async def _first_read(sampler: Sampler) -> str:
    """Read Redis once before serving: '' when it answered, else why it is unreachable now (the page
    and /metrics then say so until it answers). A refusal is raised: it would not cure itself."""
    now = round(time.time(), 3)
    try:
        first = await asyncio.to_thread(sampler.read)
    except UNREACHABLE as exc:
        if isinstance(exc, REFUSED):
            raise
        message, _ = failure(exc, sampler.target)
        sampler.publish(sampler.empty_frame(now, message))
        return message
    sampler.publish(sampler.frame(*first, now=now))
    return ""


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve(opts: argparse.Namespace, target: Target, io: Streams) -> int:
    """Run the dashboard until SIGINT or SIGTERM; 0 then. A wrong URL or a busy port fails at once,
    in one line."""
    sampler = Sampler(target, opts.interval, opts.history, control=opts.allow_control)
    # refusing (credentials, ACL): the one-line error, exit 1
    unreachable = await _first_read(sampler)
    token = secrets.token_urlsafe(24) if opts.allow_control else None
    dashboard = Dashboard(sampler, token, io, allowed_hosts(opts.host, opts.allowed_host))
    runner = web.AppRunner(dashboard.app(), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, opts.host, opts.port).start()
    except OSError as exc:
        await runner.cleanup()
        sampler.close()
        where = _address(opts.host, opts.port)
        reason = exc.strerror or str(exc)
        raise CliError(f"cannot listen on {where} (--host/--port): {reason}") from None
    port = runner.addresses[0][1] if runner.addresses else opts.port
    url = f"http://{_address(opts.host, port)}/"
    io.say(
        f"dashboard: {url}  (Redis {target.safe_url}, prefix {target.prefix!r}, read every {opts.interval:g}s)"
    )
    io.say(f"metrics: {url}metrics")
    if unreachable:
        io.say(
            f"note: {unreachable}; serving anyway (redislock_up 0), reading it again every {opts.interval:g}s"
        )
    if token:
        io.say(f"control: on; token {token}")
        io.say(f"  open {url}#token={token}")
    else:
        io.say("control: off (read-only; --allow-control lets the page steer)")
    if opts.host not in LOOPBACK:
        io.say(f"note: listening on {opts.host}: whoever reaches this port sees the page")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    sampling = asyncio.create_task(sampler.run())
    try:
        await stop.wait()
    finally:
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
        sampler.close()
        await runner.cleanup()
    io.say("dashboard: stopped")
    return EXIT_OK


__all__ = ["Dashboard", "RedisCollector", "Sampler", "serve"]
