"""The dashboard and /metrics against a real redis-server, as real processes (``python -m
scrapy_redislock dashboard``, ``scrapy redislock dashboard``): what Redis holds shows the same in
``status --json``, on the page's event stream and in Prometheus's format; steering needs
--allow-control and the token; bad input is one line."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from prometheus_client.parser import text_string_to_metric_families

from scrapy_redislock import CountingLock
from scrapy_redislock.cli.status import read_all
from scrapy_redislock.lock.permit import GROUP, LockKeys, owner_of
from scrapy_redislock.lock.status import stage_status
from scrapy_redislock.workers.queue import QueueKeys, StageQueues
from testing.dashboardproc import DashboardProcess
from testing.redis_server import RedisServer
from tests.cli.test_main import call, one_line_error

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
METRIC = re.compile(r"\bredislock_\w+")


def held_stages(redis_client: redis.Redis, locks: list[CountingLock]) -> None:
    """detail: 2 of 3 held by one process; list: 1 of 1 held, its limit then lowered to 0 (debt
    1)."""
    detail = CountingLock(redis_client, "detail", limit=3, ttl=30, identity={"spider": "shop"})
    listing = CountingLock(redis_client, "list", limit=1, ttl=30)
    locks += [detail, listing]
    detail.acquire()
    detail.acquire()
    listing.acquire()
    listing.set_limit(0)


def worker_spider(url: str, *, beat: bool = True) -> str:
    """A StageWorkerMixin spider's state made with its own queue code: 3 detail and 1 list request
    queued, one worker registered on detail with 1 request popped. Returns the worker's id."""

    async def make() -> str:
        client = redis.asyncio.Redis.from_url(url)
        queues = StageQueues(client, "shop", ["list", "detail"], ttl=30)
        await queues.push_many(
            [("detail", f"d{n}", b"detail-request") for n in range(4)] + [("list", "l", b"x")]
        )
        if beat:
            await queues.beat("detail")
        await queues.pop("detail", 1)
        await client.aclose()
        return queues.worker

    return asyncio.run(make())


def status_json(url: str) -> dict[str, Any]:
    code, out, err = call("status", "--json", "--url", url)
    assert code == 0, err
    return json.loads(out)


def metrics(dashboard: DashboardProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` parsed with prometheus_client's own parser: {(sample name, labels): value}."""
    status, body = dashboard.get("/metrics")
    assert status == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def first_event(dashboard: DashboardProcess) -> tuple[str, dict[str, Any]]:
    """The first server-sent event of ``/events``: (event name, data)."""
    with urllib.request.urlopen(dashboard.url + "/events", timeout=10) as stream:
        assert stream.headers["Content-Type"].startswith("text/event-stream")
        name, data = "", ""
        for raw in stream:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data += line[len("data: ") :]
            elif not line and data:
                return name, json.loads(data)
    raise AssertionError("the event stream ended before its first event")


# -- reading Redis (status.py) ---------------------------------------------------------------------


def test_a_consumer_counts_for_its_owner() -> None:
    assert owner_of("vm:12:ab#3") == "vm:12:ab"
    assert owner_of("vm:12:ab") == "vm:12:ab"
    assert owner_of("a#b#7") == "a#b"
    assert owner_of("#1") == "#1" and owner_of("__limbo__") == "__limbo__"


def test_per_wait_consumers_are_shown_as_their_owner(
    redis_client: redis.Redis, locks: list[CountingLock]
) -> None:
    """A holder whose grants sit under consumers '<owner>#<n>' is one process holding them all."""
    lock = CountingLock(redis_client, "detail", limit=3, ttl=30, identity={"spider": "shop"})
    locks.append(lock)
    lock.acquire()
    slots = LockKeys.of("redislock", "detail").slots
    for n in (1, 2):  # as a lock that names each wait would take its slot
        redis_client.xreadgroup(GROUP, f"{lock.owner}#{n}", {slots: ">"}, count=1)
    status = stage_status(redis_client, "redislock", "detail")
    assert status is not None and status.held == 3
    assert [(p.holder, p.held, p.spider) for p in status.processes] == [(lock.owner, 3, "shop")]
    assert {g.owner for g in status.grants} == {lock.owner}
    assert {g.holder for g in status.grants} == {lock.owner}  # a wait's consumer name is not shown
    assert all(status.process(g.holder) is status.processes[0] for g in status.grants)


def test_worker_spiders_are_read_with_their_queues_and_workers(
    redis_url: str, redis_client: redis.Redis, locks: list[CountingLock]
) -> None:
    worker = worker_spider(redis_url)
    # a lock named as the spider: both are found
    namesake = CountingLock(redis_client, "shop", limit=1, ttl=30)
    locks.append(namesake)
    namesake.acquire()
    stages, spiders = read_all(redis_client, "redislock", 30.0)
    assert [s.stage for s in stages] == ["shop"] and [s.spider for s in spiders] == ["shop"]
    shop = spiders[0]
    assert shop.queues == {"detail": 3, "list": 1}
    assert [(w.worker, w.stage, w.in_flight, w.alive) for w in shop.workers] == [
        (worker, "detail", 1, True)
    ]
    assert shop.workers[0].host == socket.gethostname() and shop.alive == 1 and shop.dead == 0
    assert shop.workers[0].deadline_in is not None and 29 < shop.workers[0].deadline_in <= 30
    # Past the deadline its beat promised: dead at once (the live workers requeue its request at
    # their next beat), whatever the ttl of the worker slots says.
    redis_client.zadd(QueueKeys.of("redislock", "shop").due, {worker: 0})
    shop = read_all(redis_client, "redislock", 30.0)[1][0]
    assert shop.dead == 1 and shop.alive == 0 and shop.workers[0].deadline_in < 0
    # A worker that set no deadline (an older version) is judged by the ttl, as before.
    redis_client.zrem(QueueKeys.of("redislock", "shop").due, worker)
    assert read_all(redis_client, "redislock", 30.0)[1][0].alive == 1
    deadline = time.monotonic() + 10
    while read_all(redis_client, "redislock", 0.2)[1][0].alive and time.monotonic() < deadline:
        time.sleep(0.02)
    shop = read_all(redis_client, "redislock", 0.2)[1][0]
    assert shop.dead == 1 and shop.workers[0].silence >= 0.2


# -- /metrics --------------------------------------------------------------------------------------


def test_metrics_match_status_json(
    redis_url: str, redis_client: redis.Redis, locks: list[CountingLock]
) -> None:
    """Prometheus's parser reads /metrics back, and every value equals what `status --json` says; no
    crawl runs."""
    held_stages(redis_client, locks)
    worker_spider(redis_url)
    with DashboardProcess(redis_url) as dashboard:
        scraped = metrics(dashboard)
    status = status_json(redis_url)
    assert [s["stage"] for s in status["stages"]] == ["detail", "list"]
    for stage in status["stages"]:
        labels = (("group", ""), ("stage", stage["stage"]))
        for field, name in [
            ("limit", "redislock_stage_limit"),
            ("held", "redislock_stage_held"),
            ("free", "redislock_stage_free"),
            ("debt", "redislock_stage_debt"),
            ("waiters", "redislock_stage_waiters"),
            ("expired", "redislock_stage_expired_grants"),
            ("fence", "redislock_stage_fence"),
            ("ttl", "redislock_stage_ttl_seconds"),
            ("delivered", "redislock_grants_total"),
        ]:
            assert scraped[(name, labels)] == stage[field], (name, labels)
        assert scraped[("redislock_stage_processes", labels)] == len(stage["processes"])
    assert scraped[("redislock_stage_held", (("group", ""), ("stage", "detail")))] == 2
    assert scraped[("redislock_stage_debt", (("group", ""), ("stage", "list")))] == 1
    assert scraped[("redislock_grants_total", (("group", ""), ("stage", "detail")))] == 2
    (spider,) = status["spiders"]
    for stage, length in spider["queues"].items():
        assert scraped[("redislock_queue_length", (("spider", "shop"), ("stage", stage)))] == length
    assert scraped[("redislock_workers_alive", (("spider", "shop"),))] == spider["alive"] == 1
    assert scraped[("redislock_workers_dead", (("spider", "shop"),))] == spider["dead"] == 0
    assert (
        scraped[("redislock_requests_in_flight", (("spider", "shop"),))] == spider["in_flight"] == 1
    )
    assert scraped[("redislock_up", ())] == 1
    # The example Grafana dashboard in docs/ asks only for series that exist.
    grafana = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    asked = {
        name
        for panel in grafana["panels"]
        for t in panel["targets"]
        for name in METRIC.findall(t["expr"])
    }
    assert len(asked) >= 10 and asked <= {name for name, _ in scraped}, asked - {
        name for name, _ in scraped
    }


def test_metrics_say_when_redis_is_gone() -> None:
    server = RedisServer().start()
    try:
        with DashboardProcess(server.url) as dashboard:
            assert metrics(dashboard)[("redislock_up", ())] == 1
            server.stop()
            scraped = metrics(dashboard)
            assert scraped[("redislock_up", ())] == 0
            assert not [key for key in scraped if key[0].startswith("redislock_stage_")]
    finally:
        server.stop()


def test_the_dashboard_and_metrics_start_while_redis_is_down_say_so_and_recover(
    redis_client: redis.Redis, locks: list[CountingLock]
) -> None:
    """An exporter started during an outage reports it (redislock_up 0, the page says Redis is
    unreachable) instead of exiting, and shows the data once Redis answers."""
    server = RedisServer()  # its port chosen, nothing listening there yet
    # the port held (bound, not listening: a connection is refused) until the server starts, so that
    # no other test's server takes it meanwhile (one once did: the dashboard found a Redis there)
    holder = socket.socket()
    holder.bind(("127.0.0.1", server.port))
    try:
        with DashboardProcess(server.url, "--interval", "0.2") as dashboard:
            assert any(
                line.startswith("note: cannot reach Redis at") for line in dashboard.output
            ), dashboard.output
            scraped = metrics(dashboard)
            assert scraped[("redislock_up", ())] == 0
            assert not [
                key
                for key in scraped
                if key[0].startswith(("redislock_stage_", "redislock_queue_"))
            ]
            name, data = first_event(dashboard)
            assert name == "history" and data["frame"]["error"].startswith(
                f"cannot reach Redis at {server.url}"
            )
            assert data["frame"]["stages"] == [] and data["frame"]["url"] == server.url
            status, page = dashboard.get("/")
            assert status == 200 and "Redis is unreachable: " in page
            holder.close()
            server.start()
            with redis.Redis(port=server.port) as client:
                lock = CountingLock(client, "detail", limit=3, ttl=30)
                locks.append(lock)
                lock.acquire()
                wait = time.monotonic() + 20
                while metrics(dashboard).get(("redislock_up", ())) != 1:
                    assert time.monotonic() < wait, "/metrics never saw Redis come back"
                    time.sleep(0.05)
                assert (
                    metrics(dashboard)[
                        ("redislock_stage_held", (("group", ""), ("stage", "detail")))
                    ]
                    == 1
                )
                # The page shows the frame sampled last: one taken after Redis came back but before
                # the lock was taken has no error and nothing held; wait for one taken after.
                while (frame := json.loads(dashboard.get("/api/status")[1]))[
                    "error"
                ] is not None or not any(stage["held"] for stage in frame["stages"]):
                    assert time.monotonic() < wait, f"the page never saw Redis come back: {frame}"
                    time.sleep(0.05)
                (stage,) = frame["stages"]
                assert (stage["stage"], stage["held"]) == ("detail", 1)
                lock.close()
        code, err = dashboard.stop()
        assert code == 0 and "Traceback" not in err, err
    finally:
        holder.close()
        server.stop()


def test_a_dashboard_whose_credentials_are_refused_still_stops_at_once(redis_url: str) -> None:
    """Only an outage is waited out: credentials Redis refuses would not cure themselves."""
    wrong = redis_url.replace("redis://", "redis://nobody:wrong@", 1)
    code, _, err = call("dashboard", "--url", wrong, "--port", "0")
    assert code == 1 and "refused the credentials" in one_line_error(err), err


# -- the page's data and steering ------------------------------------------------------------------


def test_the_event_stream_starts_with_the_state_and_no_password(
    redis_url: str, redis_client: redis.Redis
) -> None:
    redis_client.acl_setuser(
        "watcher", enabled=True, passwords=["+s3cret-pw"], keys=["*"], commands=["+@all"]
    )
    try:
        url = redis_url.replace("redis://", "redis://watcher:s3cret-pw@")
        lock = CountingLock(redis_client, "detail", limit=2, ttl=30)
        lock.acquire()
        with DashboardProcess(url) as dashboard:
            name, data = first_event(dashboard)
            status, page = dashboard.get("/")
            _, latest = dashboard.get("/api/status")
        lock.close()
        assert name == "history" and data["frame"]["control"] is False
        (stage,) = data["frame"]["stages"]
        assert (stage["stage"], stage["limit"], stage["held"], stage["free"]) == ("detail", 2, 1, 1)
        assert stage["grants"][0]["owner"] == lock.owner and stage["grants"][0]["lease_left"] > 0
        assert data["frame"]["url"] == redis_url.replace("redis://", "redis://watcher:***@")
        assert status == 200 and "EventSource" in page
        for text in (json.dumps(data), latest, page, "".join(dashboard.output)):
            assert "s3cret-pw" not in text
    finally:
        redis_client.acl_deluser("watcher")


def test_steering_needs_allow_control_and_the_token(
    redis_url: str, redis_client: redis.Redis
) -> None:
    lock = CountingLock(redis_client, "detail", limit=2, ttl=30)
    lock.acquire()
    limit = lambda: int(redis_client.hget(LockKeys.of("redislock", "detail").meta, "limit"))  # noqa: E731
    # read-only: refused even with a token-looking header
    with DashboardProcess(redis_url) as dashboard:
        assert dashboard.token is None
        code, reply = dashboard.post(
            "/api/set-limit", {"stage": "detail", "limit": 5}, token="anything"
        )
        assert code == 403 and "--allow-control" in reply["error"]
    assert limit() == 2
    with DashboardProcess(redis_url, "--allow-control") as dashboard:
        assert dashboard.token and len(dashboard.token) >= 32
        for token in (None, "", "wrong", dashboard.token + "x"):
            code, reply = dashboard.post(
                "/api/set-limit", {"stage": "detail", "limit": 5}, token=token
            )
            assert code == 403 and "token" in reply["error"] and not reply["ok"]
        assert limit() == 2
        code, reply = dashboard.post(
            "/api/set-limit", {"stage": "detail", "limit": 5}, token=dashboard.token
        )
        assert code == 200 and reply == {
            "ok": True,
            "message": "detail: limit 2 -> 5, live for every process",
        }
        assert limit() == 5
        code, reply = dashboard.post(
            "/api/set-limit", {"stage": "detial", "limit": 1}, token=dashboard.token
        )
        assert code == 409 and "unknown stage 'detial'" in reply["error"]
        code, reply = dashboard.post(
            "/api/set-limit", {"stage": "detail", "limit": "-1"}, token=dashboard.token
        )
        assert code == 400 and reply["error"] == "N must be an integer from 0 to 1000, got '-1'"
        code, reply = dashboard.post("/api/set-limit", b"not json", token=dashboard.token)
        assert code == 400 and "JSON object" in reply["error"]
        code, reply = dashboard.post(
            "/api/release", {"stage": "detail", "holder": lock.owner}, token=dashboard.token
        )
        assert code == 200 and "released 1 slot(s)" in reply["message"]
        code, reply = dashboard.post("/api/reset", {"stage": "detail"}, token=dashboard.token)
        assert code == 200 and reply["message"].startswith("detail: reset")
        assert dashboard.get("/api/nothing")[0] in (404, 405)
    assert any("control from 127.0.0.1: set-limit detail" in line for line in dashboard.output)
    assert stage_status(redis_client, "redislock", "detail").held == 0  # type: ignore[union-attr]
    lock.close()


def test_a_busy_port_a_wrong_url_and_bad_arguments_are_one_line(redis_url: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "scrapy_redislock",
                "dashboard",
                "--url",
                redis_url,
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    line = one_line_error(result.stderr)
    assert (
        result.returncode == 1 and f"cannot listen on 127.0.0.1:{port} (--host/--port)" in line
    ), line
    assert "in use" in line
    code, _, err = call("dashboard", "--url", "http://localhost:6379", "--port", "0")
    assert code == 2 and "--url is not a valid redis URL" in one_line_error(err)
    for args, message in [
        (["--port", "70000"], "--port takes an integer from 0 to 65535, got '70000'"),
        (["--port", "x"], "--port takes an integer from 0 to 65535, got 'x'"),
        (["--interval", "0"], "--interval takes a number of seconds > 0, got '0'"),
        (["--history", "inf"], "--history takes a number of seconds > 0, got 'inf'"),
    ]:
        code, _, err = call("dashboard", "--url", redis_url, *args)
        assert code == 2 and message in one_line_error(err)


def test_scrapy_redislock_dashboard_reads_the_project_settings(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """`scrapy redislock dashboard` in a project: the project's REDISLOCK_KEY_PREFIX; SIGTERM ends
    it with 0."""
    (tmp_path / "scrapy.cfg").write_text("[settings]\ndefault = proj.settings\n")
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "__init__.py").write_text("")
    (tmp_path / "proj" / "settings.py").write_text('REDISLOCK_KEY_PREFIX = "staging"\n')
    lock = CountingLock(redis_client, "pages", limit=4, ttl=30, key_prefix="staging")
    lock.acquire()
    dashboard = DashboardProcess(
        redis_url, command=[sys.executable, "-m", "scrapy", "redislock"], cwd=tmp_path
    )
    with dashboard:
        assert "prefix 'staging'" in dashboard.output[0]
        assert (
            metrics(dashboard)[("redislock_stage_limit", (("group", ""), ("stage", "pages")))] == 4
        )
    lock.close()
    code, err = dashboard.stop()
    assert code == 0 and "Traceback" not in err, err
    assert dashboard.output[-1].strip() == "dashboard: stopped"


def test_adaptive_limits_are_charted_and_exported(
    redis_url: str, redis_client: redis.Redis, locks: list[CountingLock]
) -> None:
    """A stage whose limit adapts (lock/adaptive.py): the frame's point carries its limit, latency
    and error share for the dashboard's charts, and /metrics exports its last window."""
    from scrapy_redislock.lock.adaptive import AdaptiveParams, Sample, update
    from scrapy_redislock.lock.base import CommandRunner
    from scrapy_redislock.lock.permit import LockKeys
    from scrapy_redislock.lock.protocol import drive

    lock = CountingLock(redis_client, "detail", limit=4, ttl=30)
    locks.append(lock)
    lock.acquire()
    keys, runner = LockKeys.of("redislock", "detail"), CommandRunner(redis_client)
    params = AdaptiveParams(window=0.5, min_samples=1, maximum=8)
    sample = Sample(responses=20, latency_sum=2.0, latency_sq_sum=0.2, overloads=1)
    # a new controller's window starts where the sample does: a second ago, so it is due and commits
    assert drive(update(keys, sample, params, span=1.0), runner, "detail") is not None
    with DashboardProcess(redis_url) as dashboard:
        _, data = first_event(dashboard)
        scraped = metrics(dashboard)
    (stage,) = data["frame"]["stages"]
    window = stage["adaptive"]
    assert window["latency"] == pytest.approx(0.1) and window["overload_rate"] == pytest.approx(
        1 / 21
    )
    point = data["frame"]["point"]
    assert point["limits"] == {"detail": window["limit"]}
    assert point["latency"] == {"detail": 100.0}
    assert point["errors"]["detail"] == pytest.approx(100 / 21, abs=0.01)
    labels = (("group", ""), ("stage", "detail"))
    assert scraped[("redislock_adaptive_limit", labels)] == window["limit"]
    assert scraped[("redislock_adaptive_latency_seconds", labels)] == pytest.approx(0.1)
    assert scraped[("redislock_adaptive_overload_ratio", labels)] == pytest.approx(1 / 21)


def test_a_paused_scope_with_waiting_requests_says_why_on_the_page(
    redis_url: str, redis_client: redis.Redis, locks: list[CountingLock]
) -> None:
    """A scope set to 0 (paused) while requests wait for it: the dashboard's frame says why they
    never go and what lets them go; a stage with a free slot says nothing."""
    proxy = CountingLock(redis_client, "key:proxy:p1", limit=2, ttl=30)
    locks.append(proxy)
    proxy.acquire()
    proxy.set_limit(0)
    proxy.annotate(waiting=3)
    proxy.maintain()
    with DashboardProcess(redis_url) as dashboard:
        _, data = first_event(dashboard)
    (row,) = data["frame"]["stages"]
    assert row["never_goes"] == (
        "paused: 3 request(s) wait for 'key:proxy:p1', whose limit is 0: they go only after "
        "`set-limit key:proxy:p1 N` with N >= 1"
    )
