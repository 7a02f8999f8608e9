"""Readers that treat Redis as untrusted input (issue 41, points 3 to 6), against a real
redis-server: values a crawler may write (its role may write any key of the prefix) neither crash
nor spoof ``status``, ``set-limit``, ``reset``, ``forget``, the dashboard or ``/metrics``; names with
terminal escape sequences are printed escaped; dead letters are read with a bound; the watcher role
can run ``status`` once a worker spider has keys; the dashboard answers only its own Host names."""

from __future__ import annotations

import json

import pytest
import redis

from scrapy_redislock import CountingLock
from scrapy_redislock.lock.permit import LockKeys
from scrapy_redislock.workers.queue import QueueKeys
from testing.dashboardproc import DashboardProcess
from tests.cli.test_acl import _redis_7, cli, make_user  # noqa: F401  (_redis_7: a fixture)
from tests.cli.test_dashboard import metrics, worker_spider
from tests.cli.test_main import call

pytestmark = pytest.mark.integration

DETAIL = LockKeys.of("redislock", "detail")
# what a crawler may write into a stage's keys (issue 41, point 3)
CORRUPTIONS = {
    "limit abc": lambda c: c.hset(DETAIL.meta, "limit", "abc"),
    "ttl 1.5e3": lambda c: c.hset(DETAIL.meta, "ttl", "1.5e3"),
    "deep owners": lambda c: c.hset(DETAIL.owners, "evil", "[" * 100_000 + "]" * 100_000),
    "400-digit started": lambda c: c.hset(DETAIL.owners, "evil", '{"started": ' + "9" * 400 + "}"),
    "inf in the adaptive log": lambda c: c.lpush(DETAIL.adapt_log, "[1e999, 1e999, 1, 1, 0, 0, 1]"),
    "meta of the wrong type": lambda c: (c.delete(DETAIL.meta), c.set(DETAIL.meta, "x")),
}


def stages(redis_client: redis.Redis) -> CountingLock:
    """Two stages: 'detail' (one slot held), and 'list', which stays sound."""
    detail = CountingLock(redis_client, "detail", limit=3, ttl=30, identity={"spider": "shop"})
    detail.acquire()
    CountingLock(redis_client, "list", limit=2, ttl=30).acquire()
    return detail


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS))
def test_a_corrupted_stage_is_shown_as_such_and_the_tools_still_work(
    redis_url: str, redis_client: redis.Redis, corrupt: str
) -> None:
    stages(redis_client)
    CORRUPTIONS[corrupt](redis_client)
    code, out, err = call("status", "--url", redis_url)
    assert code == 0 and "Traceback" not in err, err
    assert "list: 1 held of 2" in out  # the other stage as usual
    code, out, err = call("status", "--json", "--url", redis_url)
    assert code == 0, err
    shown = {s["stage"]: s for s in json.loads(out)["stages"]}  # strict JSON: no Infinity
    assert shown["list"]["held"] == 1
    if corrupt in ("limit abc", "meta of the wrong type"):
        assert "unreadable" in shown["detail"]["why_waiting"]
    if corrupt == "meta of the wrong type":
        redis_client.delete(DETAIL.meta)
        redis_client.hset(DETAIL.meta, "limit", "abc")
    # the operator repairs it with the command line (its holder, this process, is alive: --force)
    code, out, err = call("reset", "detail", "--force", "--yes", "--url", redis_url)
    assert code == 0, err
    code, out, err = call("set-limit", "detail", "4", "--url", redis_url)
    assert code == 0, err
    if corrupt == "limit abc":
        assert out.startswith("detail: limit (not a valid one in Redis) -> 4"), out
    assert redis_client.hget(DETAIL.meta, "limit") == b"4"
    code, out, err = call("forget", "detail", "--force", "--yes", "--url", redis_url)
    assert code == 0, err
    assert not redis_client.exists(DETAIL.meta, DETAIL.slots)


def test_a_bad_worker_or_spider_value_is_an_error_of_that_item(
    redis_url: str, redis_client: redis.Redis
) -> None:
    worker_spider(redis_url)
    keys = QueueKeys.of("redislock", "shop")
    redis_client.zadd(keys.alive, {"evil:1:x": float("inf")})
    redis_client.set("redislock:{other}:alive", "not a zset")
    code, out, err = call("status", "--url", redis_url)
    assert code == 0, err
    assert "spider shop: 1 worker(s) alive" in out
    assert "unreadable: worker evil:1:x: its beat is not a finite number: inf" in out
    assert "spider other: its state in Redis is unreadable: a key has the wrong type" in out
    code, out, err = call("status", "--json", "--url", redis_url)
    spiders = {s["spider"]: s for s in json.loads(out)["spiders"]}
    assert code == 0 and spiders["shop"]["alive"] == 1 and spiders["other"]["error"]


ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b[H\x1b[31mFAKE: all good\u202e"


def test_names_from_redis_reach_the_terminal_escaped(
    redis_url: str, redis_client: redis.Redis
) -> None:
    lock = CountingLock(
        redis_client, "detail" + ESCAPES, limit=1, ttl=30, identity={"host": ESCAPES}
    )
    lock.acquire()
    keys = QueueKeys.of("redislock", "shop")
    worker = "h" + ESCAPES + ":1:w; rm -rf ~"
    redis_client.zadd(keys.alive, {worker: 0})
    redis_client.zadd(keys.due, {worker: 0})
    redis_client.lpush(keys.deadletter, b'{"error": "' + ESCAPES.encode() + b'"}\ndetail\n\nx')
    code, out, err = call("status", "--url", redis_url)
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "\\x1b[31mFAKE: all good" in out
    # the suggested command is quoted for a shell, and escaped
    assert "`requeue 'h\\x1b]0;pwned" in out and "; rm -rf ~'`" in out
    code, out, err = call("release", "detail" + ESCAPES, "nobody", "--yes", "--url", redis_url)
    assert code == 1 and "\x1b" not in err and "\\x1b" in err


def test_dead_letters_are_read_within_a_bound(redis_url: str, redis_client: redis.Redis) -> None:
    keys = QueueKeys.of("redislock", "shop")
    big = b'{"error": "big"}\ndetail\n\n' + b"x" * (20 * 1024 * 1024)
    for _ in range(5):
        redis_client.lpush(keys.deadletter, big)
    code, out, err = call("status", "--url", redis_url)
    assert code == 0, err
    assert "shop: 5 in redislock:{shop}:deadletter, not read here: the list holds about" in out
    redis_client.delete(keys.deadletter)
    redis_client.lpush(keys.deadletter, b'{"error": "small"}\ndetail\n\nx')
    code, out, err = call("status", "--url", redis_url)
    assert "small" in out


def test_the_watcher_can_run_status_once_a_worker_spider_has_keys(
    redis_client: redis.Redis, redis_url: str
) -> None:
    worker_spider(redis_url)
    redis_client.lpush(QueueKeys.of("redislock", "shop").deadletter, b'{"error": "x"}\ndetail\n\nx')
    watcher = make_user(redis_client, "watcher", "watcher")
    try:
        shown = cli(watcher, "status")
        assert shown.returncode == 0, shown.stderr
        assert "spider shop: 1 worker(s) alive" in shown.stdout and "x" in shown.stdout
    finally:
        redis_client.execute_command("ACL", "DELUSER", "watcher")


def test_the_dashboard_answers_only_its_own_host_names_and_bounded_bodies(
    redis_url: str, redis_client: redis.Redis
) -> None:
    stages(redis_client)
    CORRUPTIONS["limit abc"](redis_client)
    with DashboardProcess(redis_url, "--allow-control") as dashboard:
        # a DNS-rebinding page reaches it under the attacker's name
        code, _ = dashboard.get("/api/status", headers={"Host": "evil.example:8030"})
        assert code == 421
        code, body = dashboard.get("/api/status")
        assert code == 200 and json.loads(body)["stages"]
        code, reply = dashboard.post(
            "/api/set-limit",
            {"stage": "list", "limit": 1},
            token=dashboard.token,
            headers={"Origin": "http://evil.example"},
        )
        assert code == 403 and "cross-origin" in reply["error"]
        for body in (b"[" * 100_000, b'{"stage": "' + b"x" * 100_000 + b'"}'):
            code, reply = dashboard.post("/api/set-limit", body, token=dashboard.token)
            assert code == 400 and not reply["ok"]
        code, reply = dashboard.post(
            "/api/set-limit", {"stage": "list", "limit": 10**23}, token=dashboard.token
        )
        assert code == 400 and "from 0 to 1000" in reply["error"]
        found = metrics(dashboard)  # a 200, with the corrupted stage flagged
        assert found[("redislock_stage_unreadable", (("group", ""), ("stage", "detail")))] == 1
        assert found[("redislock_stage_held", (("group", ""), ("stage", "list")))] == 1
    with DashboardProcess(redis_url, "--allowed-host", "dash.example.com") as dashboard:
        code, _ = dashboard.get("/metrics", headers={"Host": "dash.example.com"})
        assert code == 200
