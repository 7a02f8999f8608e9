"""The operator's command line against a real redis-server: in-process (``main(argv)``) and as real
processes (``python -m scrapy_redislock``, ``scrapy redislock``), including ACL, TLS, a terminal
prompt and a live crawl."""

from __future__ import annotations

import asyncio
import io
import json
import os
import pty
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio

from scrapy_redislock import CountingLock, Permit
from scrapy_redislock.cli.main import main
from scrapy_redislock.cli.render import render_status, seconds
from scrapy_redislock.cli.target import Target
from scrapy_redislock.lock.permit import LockKeys, group_prefix
from scrapy_redislock.lock.status import Grant, Process, StageStatus
from scrapy_redislock.workers.queue import QueueKeys, StageQueues
from testing.crawlproc import start_crawl
from testing.lockstate import held_slots
from testing.redis_server import RedisServer, free_port
from testing.site import CrawlSite

ROOT = Path(__file__).resolve().parents[2]
HOST = socket.gethostname()
CLEAN_ENV = {
    k: v
    for k, v in os.environ.items()
    if k not in {"REDISLOCK_URL", "REDIS_URL", "REDISLOCK_KEY_PREFIX"}
}


# -- helpers ---------------------------------------------------------------------------------------


class Tty(io.StringIO):
    """Standard input that says it is a terminal, with the operator's typed answer in it."""

    def isatty(self) -> bool:
        return True


def call(
    *argv: str, stdin: io.StringIO | None = None, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """Run the command line in this process; (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = main(
        list(argv),
        env={} if env is None else env,
        stdin=stdin or io.StringIO(),
        stdout=out,
        stderr=err,
    )
    return code, out.getvalue(), err.getvalue()


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30, **kwargs: Any
) -> subprocess.CompletedProcess:
    """Run ``python -m scrapy_redislock ARGS`` as a real process."""
    return subprocess.run(
        [sys.executable, "-m", "scrapy_redislock", *args],
        cwd=ROOT,
        env={**CLEAN_ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=kwargs.pop("stdin", subprocess.DEVNULL),
        **kwargs,
    )


def one_line_error(stderr: str) -> str:
    """The error output must be exactly one line, and no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def status_json(url: str, *extra: str) -> dict[str, Any]:
    code, out, err = call("status", "--json", "--url", url, *extra)
    assert code == 0, err
    return {s["stage"]: s for s in json.loads(out)["stages"]}


def redis_state(client: redis.Redis) -> dict[bytes, Any]:
    """Every key and its content, to show that a refused command wrote nothing."""
    state: dict[bytes, Any] = {}
    for key in sorted(client.scan_iter()):
        kind = client.type(key)
        if kind == b"hash":
            state[key] = client.hgetall(key)
        elif kind == b"stream":
            groups = client.xinfo_groups(key)
            state[key] = (
                client.xrange(key),
                [(g["name"], g["last-delivered-id"], g["pending"]) for g in groups],
            )
        else:
            state[key] = kind
    return state


def holder(
    locks: list[CountingLock],
    client: redis.Redis,
    name: str,
    limit: int | None,
    ttl: float = 30,
    **ident: Any,
):
    lock = CountingLock(client, name, limit=limit, ttl=ttl, identity=ident or None)
    locks.append(lock)
    return lock


HOLDER_SCRIPT = """
import json, sys, time
import redis
from scrapy_redislock import CountingLock
lock = CountingLock(redis.Redis.from_url(sys.argv[1]), sys.argv[2], limit=int(sys.argv[3]), ttl=float(sys.argv[4]),
                    identity={"spider": "worker"})
permit = lock.acquire()
print(json.dumps({"owner": lock.owner, "fence": permit.fence}), flush=True)
time.sleep(3600)
"""


def holder_process(
    url: str, name: str, limit: int, ttl: float
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """A separate process that takes one slot and holds it until killed."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER_SCRIPT, url, name, str(limit), str(ttl)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    return process, json.loads(process.stdout.readline())


# -- pure rendering --------------------------------------------------------------------------------


def test_durations_are_short_and_readable() -> None:
    assert [seconds(v) for v in (0.25, 3.0, 42.4, 303, 7500)] == [
        "0.25s",
        "3.0s",
        "42s",
        "5m03s",
        "2h05m",
    ]
    assert seconds(None) == "-"


def test_render_shows_holders_waiters_and_expired_leases() -> None:
    stage = StageStatus(
        stage="detail",
        exists=True,
        limit=3,
        ttl=30.0,
        held=2,
        free=1,
        debt=0,
        waiters=7,
        fence=41,
        grants=[
            Grant("h1:11:aa", "0-40", 40, 1.5, 28.5),
            Grant("h2:22:bb", "0-41", 41, 31.0, -1.0),
        ],
        processes=[
            Process(
                "h1:11:aa", 1, 2, {"host": "h1", "pid": 11, "spider": "shop", "started": 1000.0}
            ),
            Process("h2:22:bb", 1, 0, {"host": "h2", "pid": 22}),
            Process("h3:33:cc", 0, 5, {"host": "h3", "pid": 33, "label": "lister"}),
            Process("h4:44:dd", 0, 0, {"host": "h4", "pid": 44}),
        ],
    )
    target = Target(url="redis://user:pw@host:6379/0", source="--url", prefix="redislock", ttl=30)
    text = render_status([stage], target, now=1060.0)
    assert "redis://user:***@host:6379/0" in text and ":pw@" not in text
    summary = next(line for line in text.splitlines() if line.startswith("detail "))
    assert summary.split() == ["detail", "3", "2", "1", "0", "7", "41", "30s", "4"]
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("  h")}
    started = time.strftime("%H:%M:%S", time.localtime(1000.0))
    assert rows["h1:11:aa"] == ["h1:11:aa", "h1", "11", "shop", started, "40", "1.5s", "28s", "2"]
    assert rows["h2:22:bb"][-2:] == ["expired", "0"]
    assert rows["h3:33:cc"] == ["h3:33:cc", "h3", "33", "lister", "-", "-", "-", "-", "5"]
    assert "h4:44:dd" not in rows and "+ 1 registered process(es) holding nothing" in text


# -- status ----------------------------------------------------------------------------------------


@pytest.mark.integration
def test_status_shows_every_stage_with_holders_and_waiters(
    redis_url: str, redis_client: redis.Redis, locks: list[CountingLock]
) -> None:
    detail = holder(locks, redis_client, "detail", 3, ttl=20, spider="shop")
    other = holder(locks, redis_client, "detail", None, ttl=20, spider="shop")
    lister = holder(locks, redis_client, "list", 1, ttl=20, spider="shop")
    grants = [detail.acquire(), detail.acquire(), other.acquire(), lister.acquire()]
    detail.annotate(waiting=4)
    other.annotate(waiting=1)
    detail.maintain()
    other.maintain()

    stages = status_json(redis_url)
    assert set(stages) == {"detail", "list"}
    d = stages["detail"]
    assert (d["limit"], d["held"], d["free"], d["debt"], d["waiters"]) == (3, 3, 0, 0, 5)
    assert d["fence"] == max(p.fence for p in grants[:3]) and d["ttl"] == 20
    by_grant = {g["fence"]: g for g in d["grants"]}
    assert set(by_grant) == {p.fence for p in grants[:3]}
    for permit in grants[:3]:
        row = by_grant[permit.fence]
        assert row["holder"] == permit.owner and row["host"] == HOST and row["pid"] == os.getpid()
        assert row["spider"] == "shop" and 0 <= row["age"] < 5 and 15 < row["lease_left"] <= 20
        assert abs(row["started"] - time.time()) < 60
    assert stages["list"]["held"] == 1 and stages["list"]["grants"][0]["holder"] == lister.owner

    code, out, err = call("status", "--url", redis_url)
    assert code == 0, err
    summary = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.startswith(("detail ", "list "))
    }
    assert summary["detail"][:8] == ["detail", "3", "3", "0", "0", "5", str(d["fence"]), "20s"]
    assert out.count(detail.owner) == 2 and out.count(other.owner) == 1 and str(os.getpid()) in out


@pytest.mark.integration
def test_status_groups_keys_busiest_first_and_filters_them(
    redis_url: str, redis_client: redis.Redis, locks: list[CountingLock]
) -> None:
    """Locks of keys met at run time (``key:<key>``) are listed apart from the stages, busiest
    first; ``--stage-key PATTERN`` keeps the keys matching a glob."""
    holder(locks, redis_client, "detail", 2).acquire()
    busy = holder(locks, redis_client, "key:shop.example.com", 3, spider="shop")
    busy.acquire(), busy.acquire()
    busy.annotate(waiting=2)
    busy.maintain()
    holder(locks, redis_client, "key:a.example.com", 2).acquire()
    holder(locks, redis_client, "key:other.org", 2).acquire()

    code, out, err = call("status", "--url", redis_url)
    assert code == 0, err
    head, _, keys = out.partition(
        "KEYS AND SCOPES (REDISLOCK_STAGE_KEY, REDISLOCK_SCOPES): 3 in use, busiest first"
    )
    assert "detail" in head and "key:" not in head  # the stages' part shows no key
    rows = [
        line.split() for line in keys.splitlines() if line.startswith("  ") and "KEY" not in line
    ]
    assert [row[0] for row in rows] == ["shop.example.com", "a.example.com", "other.org"]
    assert rows[0][1:5] == ["3", "2", "2", "1"]  # limit, held, waiting, processes

    code, out, err = call("status", "--url", redis_url, "--stage-key", "*.example.com")
    assert code == 0, err
    assert "2 in use matching '*.example.com'" in out and "other.org" not in out
    code, out, err = call("status", "--json", "--url", redis_url, "--stage-key", "other.*")
    document = json.loads(out)
    assert [s["stage"] for s in document["keys"]] == ["key:other.org"]
    assert [s["stage"] for s in document["stages"]] == ["detail"]


@pytest.mark.integration
def test_status_says_why_requests_of_a_paused_scope_never_go(
    redis_url: str, redis_client: redis.Redis, locks: list[CountingLock]
) -> None:
    """A scope paused at 0 (``set-limit key:<scope> 0``) with requests waiting for it: status says
    they wait for it and what lets them go."""
    proxy = holder(locks, redis_client, "key:proxy:p1", 2)
    proxy.acquire()
    code, out, err = call("set-limit", "key:proxy:p1", "0", "--url", redis_url)
    assert code == 0, err
    proxy.annotate(waiting=2)
    proxy.maintain()
    code, out, err = call("status", "--url", redis_url)
    assert code == 0, err
    assert (
        "paused: 2 request(s) wait for 'proxy:p1', whose limit is 0: they go only after "
        "`set-limit key:proxy:p1 N` with N >= 1"
    ) in out
    code, out, err = call("set-limit", "key:proxy:p1", "1", "--url", redis_url)
    assert code == 0, err
    code, out, err = call("status", "--url", redis_url)
    assert "paused:" not in out


@pytest.mark.integration
def test_status_of_an_empty_prefix_and_prefix_sources(
    redis_url: str, redis_client: redis.Redis, locks: list
) -> None:
    holder(locks, redis_client, "detail", 2).acquire()
    other = CountingLock(redis_client, "detail", limit=5, key_prefix="other")
    locks.append(other)
    other.acquire()
    assert status_json(redis_url)["detail"]["limit"] == 2
    assert status_json(redis_url, "--prefix", "other")["detail"]["limit"] == 5
    code, out, _ = call(
        "status", "--json", env={"REDISLOCK_URL": redis_url, "REDISLOCK_KEY_PREFIX": "other"}
    )
    assert code == 0 and json.loads(out)["stages"][0]["limit"] == 5
    code, out, _ = call("status", "--url", redis_url, "--prefix", "nothing-here")
    assert code == 0 and "no stage locks under prefix 'nothing-here'" in out


@pytest.mark.integration
def test_url_comes_from_the_option_then_redislock_url_then_redis_url(
    redis_url: str, redis_client: redis.Redis, dead_url: Callable[[], str]
) -> None:
    # a stage whose stream is lost
    redis_client.hset(LockKeys.of("redislock", "detail").meta, mapping={"limit": 1})
    dead = dead_url()
    code, out, _ = call("status", env={"REDIS_URL": redis_url})
    assert code == 0 and "detail" in out and "stream is missing" in out
    code, _, err = call("status", env={"REDISLOCK_URL": dead, "REDIS_URL": redis_url})
    assert code == 1 and dead in one_line_error(err) and "$REDISLOCK_URL" in err
    code, _, err = call("status", "--url", redis_url, env={"REDISLOCK_URL": dead})
    assert code == 0, err


@pytest.mark.integration
def test_watch_refreshes_until_count_or_ctrl_c(
    redis_url: str, redis_client: redis.Redis, locks: list
) -> None:
    holder(locks, redis_client, "detail", 2).acquire()
    code, out, _ = call("status", "--url", redis_url, "--watch", "0.05", "--count", "3", "--json")
    frames = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(frames) == 3 and all(f["stages"][0]["held"] == 1 for f in frames)
    assert frames[0]["time"] < frames[2]["time"]

    process = subprocess.Popen(
        [sys.executable, "-m", "scrapy_redislock", "status", "--watch", "0.1", "--url", redis_url],
        cwd=ROOT,
        env=CLEAN_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    seen = 0
    deadline = time.monotonic() + 20
    while seen < 2 and time.monotonic() < deadline:
        if process.stdout.readline().startswith("detail "):
            seen += 1
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=10)
    assert (
        seen == 2
        and process.returncode == 0
        and "Traceback" not in err
        and "KeyboardInterrupt" not in err
    )


# -- set-limit -------------------------------------------------------------------------------------


@pytest.mark.integration
def test_set_limit_reaches_running_holders_without_restart(
    redis_url: str, redis_client: redis.Redis, locks: list
) -> None:
    first = holder(locks, redis_client, "detail", 1)
    second = holder(locks, redis_client, "detail", 1)
    held = first.acquire()
    assert second.try_acquire() is None

    result = cli("set-limit", "detail", "3", "--url", redis_url)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "detail: limit 1 -> 3, live for every process"
    taken = [second.try_acquire(), second.try_acquire()]
    assert all(isinstance(p, Permit) for p in taken) and second.try_acquire() is None

    code, out, _ = call("set-limit", "detail", "1", "--url", redis_url)
    assert (
        code == 0 and "limit 3 -> 1" in out and "3 slots are held now; lowering revokes none" in out
    )
    assert status_json(redis_url)["detail"]["debt"] == 2
    first.release(held)
    second.release(taken[0])
    assert second.try_acquire() is None  # 1 still held = the new limit
    second.release(taken[1])
    assert isinstance(first.try_acquire(), Permit)


@pytest.mark.integration
def test_set_limit_of_an_unknown_stage_needs_create(
    redis_url: str, redis_client: redis.Redis, locks: list
) -> None:
    holder(locks, redis_client, "detail", 2).acquire()
    before = redis_state(redis_client)
    code, _, err = call("set-limit", "detial", "4", "--url", redis_url)
    line = one_line_error(err)
    assert (
        code == 1
        and "unknown stage 'detial'" in line
        and "stages there: detail" in line
        and "--create" in line
    )
    assert redis_state(redis_client) == before

    code, out, err = call(
        "set-limit", "pages", "4", "--create", "--ttl", "12.5", "--url", redis_url
    )
    assert code == 0, err
    assert out.strip() == "pages: created with limit 4 (ttl 12.5s)"
    meta = redis_client.hgetall(LockKeys.of("redislock", "pages").meta)
    assert (meta[b"limit"], meta[b"ttl"]) == (b"4", b"12500")
    assert status_json(redis_url)["pages"]["free"] == 4


@pytest.mark.integration
@pytest.mark.parametrize(
    ("argv", "code", "expected"),
    [
        (["set-limit", "detail", "-1"], 2, "N must be an integer from 0 to 1000, got '-1'"),
        (["set-limit", "detail", "1.5"], 2, "N must be an integer from 0 to 1000, got '1.5'"),
        (["set-limit", "detail", "three"], 2, "got 'three'"),
        (["set-limit", "de{tail}", "2"], 2, "STAGE must be a non-empty string without braces"),
        (
            ["set-limit", "detail", "2", "--create", "--ttl", "-3"],
            2,
            "--ttl must be a number of seconds",
        ),
        (["set-limit", "detail"], 2, "N is missing (or --adaptive to lift a pin)"),
        (["status", "--watch", "0"], 2, "--watch takes a number of seconds > 0, got '0'"),
        (["status", "--count", "2"], 2, "--count needs --watch"),
        (["release", "nope", "someone", "--yes"], 1, "unknown stage 'nope'"),
        (["release", "detail", "nobody", "--yes"], 1, "no holder 'nobody' in stage 'detail'"),
        (["reset", "nope", "--yes"], 1, "unknown stage 'nope'"),
        (["status", "--prefix", "a{b"], 2, "--prefix must be a non-empty string without braces"),
        (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_and_changes_nothing(
    redis_url: str,
    redis_client: redis.Redis,
    locks: list,
    argv: list[str],
    code: int,
    expected: str,
) -> None:
    holder(locks, redis_client, "detail", 2).acquire()
    before = redis_state(redis_client)
    got, _, err = call(*argv, "--url", redis_url) if argv[0] != "frobnicate" else call(*argv)
    assert got == code
    assert expected in one_line_error(err), err
    assert redis_state(redis_client) == before


@pytest.mark.integration
def test_unreachable_redis_and_bad_urls_fail_in_one_line(
    redis_url: str, dead_url: Callable[[], str]
) -> None:
    dead = dead_url()
    result = cli("status", "--url", dead)
    assert result.returncode == 1 and one_line_error(result.stderr).startswith(
        "redislock: error: cannot reach Redis"
    )
    result = cli("set-limit", "detail", "3", "--url", dead)
    assert result.returncode == 1 and "cannot reach Redis at " + dead in one_line_error(
        result.stderr
    )
    for url, words in [
        ("http://localhost:6379", "not a valid redis URL"),
        ("redis://h:port/0", "valid redis URL"),
    ]:
        result = cli("status", "--url", url)
        assert result.returncode == 2 and words in one_line_error(result.stderr)


# -- release and reset -----------------------------------------------------------------------------


@pytest.mark.integration
def test_release_frees_a_dead_workers_slot_at_once(
    redis_url: str, redis_client: redis.Redis, locks: list
) -> None:
    process, record = holder_process(redis_url, "detail", 1, ttl=60)
    process.kill()  # SIGKILL: its slot stays held until the 60 s lease runs out
    process.communicate()
    stage = status_json(redis_url)["detail"]
    assert [(g["holder"], g["pid"], g["spider"]) for g in stage["grants"]] == [
        (record["owner"], process.pid, "worker")
    ]

    waiter = holder(locks, redis_client, "detail", None)
    got: list[Permit] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=20)))
    thread.start()
    time.sleep(0.2)
    assert not got
    result = cli("release", "detail", f"{HOST}:{process.pid}", "--yes", "--url", redis_url)
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout.strip()
        == f"detail: released 1 slot(s) of {record['owner']} (host {HOST}, pid {process.pid}, "
        "spider worker)"
    )
    assert "warning" not in result.stderr  # the process is dead: no warning
    thread.join(5)
    assert got and got[0].fence > record["fence"]
    stage = status_json(redis_url)["detail"]
    assert [g["holder"] for g in stage["grants"]] == [waiter.owner]
    assert record["owner"] not in {p["holder"] for p in stage["processes"]}


@pytest.mark.integration
def test_release_of_a_live_holder_warns_and_it_finds_the_slot_lost(
    redis_url: str, redis_client: redis.Redis, locks: list
) -> None:
    first = holder(locks, redis_client, "detail", 3)
    second = holder(locks, redis_client, "detail", 3)
    permits = [first.acquire(), first.acquire()]
    second.acquire()
    code, _, err = call("release", "detail", f"{HOST}:{os.getpid()}", "--yes", "--url", redis_url)
    assert code == 1 and "is ambiguous" in err and first.owner in err and second.owner in err
    code, out, err = call("release", "detail", first.owner, "--yes", "--url", redis_url)
    assert code == 0 and f"released 2 slot(s) of {first.owner}" in out
    assert f"warning: process {os.getpid()} of {first.owner} is running on this machine" in err
    assert sorted(p.fence for p in first.maintain()) == sorted(p.fence for p in permits)
    assert first.release(permits[0]) is False
    assert status_json(redis_url)["detail"]["held"] == 1


@pytest.mark.integration
def test_reset_frees_every_slot_keeps_the_limit_and_fences_increase(
    redis_url: str, redis_client: redis.Redis, locks: list
) -> None:
    one = holder(locks, redis_client, "detail", 2)
    two = holder(locks, redis_client, "detail", 2)
    permits = [one.acquire(), two.acquire()]
    holder(locks, redis_client, "detail", 2).set_limit(1)  # leaves a debt of 1
    waiter = holder(locks, redis_client, "detail", None)
    got: list[Permit] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=20)))
    thread.start()
    time.sleep(0.2)
    stage = status_json(redis_url)["detail"]
    assert (stage["held"], stage["debt"], stage["limit"]) == (2, 1, 1)

    result = cli("reset", "detail", "--yes", "--url", redis_url)
    assert result.returncode == 1 and "has live holders, nothing was changed" in result.stderr
    result = cli("reset", "detail", "--force", "--yes", "--url", redis_url)
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout.strip()
        == "detail: reset: freed 2 held slot(s); limit 1 kept, 1 fresh slot(s) for the waiters"
    )
    assert "warning: resetting live holders" in result.stderr
    thread.join(5)
    assert got and got[0].fence > max(p.fence for p in permits)
    stage = status_json(redis_url)["detail"]
    assert (stage["held"], stage["free"], stage["debt"], stage["limit"]) == (1, 0, 0, 1)
    assert [p.fence for p in one.maintain()] == [permits[0].fence]
    assert two.release(permits[1]) is False
    waiter.release(got[0])
    assert status_json(redis_url)["detail"]["free"] == 1


@pytest.mark.integration
def test_reset_refuses_live_holders_without_force_and_says_what_the_site_may_see(
    redis_url: str, redis_client: redis.Redis, locks: list
) -> None:
    """A holder whose process runs on this machine, or one of another machine with lease left, is
    live (as ``release`` judges it): ``reset`` changes nothing without --force. A holder whose
    process here is dead is not: the reset goes on."""
    here = holder(locks, redis_client, "detail", 5)
    here.acquire()
    before = redis_state(redis_client)
    code, _, err = call("reset", "detail", "--yes", "--url", redis_url)
    assert code == 1 and redis_state(redis_client) == before
    assert one_line_error(err) == (
        f"redislock: error: stage 'detail' has live holders, nothing was changed: process "
        f"{os.getpid()} of {here.owner} is running on this machine; until their requests end, the "
        "site may see up to 1 request(s) in flight beyond the cap of 5 (their slots are free to "
        "others at once); pass --force to reset anyway, or `release` a holder known to be dead"
    )
    here.close()
    remote = holder(locks, redis_client, "detail", 5, host="crawler-7")
    remote.acquire()
    code, _, err = call("reset", "detail", "--yes", "--url", redis_url)
    assert code == 1 and f"{remote.owner} on host crawler-7 renewed a slot" in err
    assert "s of lease left" in err
    remote.close()
    process, _ = holder_process(redis_url, "detail", 5, ttl=60)
    process.kill()  # SIGKILL: its slot stays held for the 60 s lease, but it is dead
    process.communicate()
    assert status_json(redis_url)["detail"]["held"] == 1
    code, out, err = call("reset", "detail", "--yes", "--url", redis_url)
    assert (code, err) == (0, "")
    assert (
        out
        == "detail: reset: freed 1 held slot(s); limit 5 kept, 5 fresh slot(s) for the waiters\n"
    )


@pytest.mark.integration
def test_a_command_that_frees_nothing_names_the_lock_of_the_same_stage_that_holds(
    redis_url: str, redis_client: redis.Redis, locks: list
) -> None:
    """Seen in a trial: "freed 0" while ``status`` showed 4-5 held: the slots were the worker slots
    (``workers:detail``) beside the request stage ``detail``, which held none. Now the command names
    where the held slots are."""
    holder(locks, redis_client, "detail", 3).set_limit(3)  # the request stage: idle
    process, record = holder_process(redis_url, "workers:detail", 5, ttl=60)
    process.kill()
    process.communicate()
    assert status_json(redis_url)["workers:detail"]["held"] == 1
    code, out, _ = call("reset", "detail", "--yes", "--url", redis_url)
    assert (code, out) == (
        0,
        "detail: reset: freed 0 held slot(s); note: 'workers:detail' has 1 held (a lock of its "
        "own: name it to act on it)\n",
    )
    code, out, _ = call("release", "detail", f"{HOST}:{process.pid}", "--yes", "--url", redis_url)
    assert code == 1  # not a holder of 'detail'
    code, out, _ = call("reset", "workers:detail", "--yes", "--url", redis_url)
    assert code == 0 and out.startswith("workers:detail: reset: freed 1 held slot(s)")
    assert record["owner"]


@pytest.mark.integration
def test_stages_of_several_groups_are_shown_apart_and_addressed_by_group(
    redis_url: str, redis_client: redis.Redis, locks: list
) -> None:
    """Two spiders' ``detail`` (cap groups ``shopfull`` and ``othershop``) and one of no group (the
    0.x names): status shows each with its group; a command on ``detail`` alone is refused naming
    the groups, ``--group`` picks one."""
    for group, limit in (("shopfull", 3), ("othershop", 10)):
        lock = CountingLock(
            redis_client, "detail", limit=limit, key_prefix=group_prefix("redislock", group)
        )
        locks.append(lock)
        lock.acquire()
    holder(locks, redis_client, "list", 2).acquire()
    code, out, _ = call("status", "--json", "--url", redis_url)
    assert code == 0
    found = sorted((s["group"], s["stage"], s["limit"]) for s in json.loads(out)["stages"])
    assert found == [("", "list", 2), ("othershop", "detail", 10), ("shopfull", "detail", 3)]
    code, out, _ = call("status", "--url", redis_url)
    header = next(line for line in out.splitlines() if line.startswith("STAGE"))
    assert header.split()[:3] == ["STAGE", "GROUP", "LIMIT"]
    assert "detail (group shopfull): 1 held of 3, 0 waiting" in out
    assert "detail (group othershop): 1 held of 10, 0 waiting" in out
    assert "\nlist: 1 held of 2, 0 waiting" in out

    before = redis_state(redis_client)
    for args in (["set-limit", "detail", "5"], ["reset", "detail", "--yes"], ["forget", "detail"]):
        code, _, err = call(*args, "--url", redis_url)
        assert code == 1 and one_line_error(err) == (
            "redislock: error: stage 'detail' is in 2 groups under prefix 'redislock': "
            "'othershop', 'shopfull'; name one with --group GROUP ('' for the keys of no group)"
        )
    assert redis_state(redis_client) == before
    code, out, _ = call("set-limit", "detail", "5", "--group", "othershop", "--url", redis_url)
    assert (code, out) == (0, "detail (group othershop): limit 10 -> 5, live for every process\n")
    code, _, err = call("set-limit", "detail", "5", "--group", "nope", "--url", redis_url)
    assert code == 1 and "unknown stage 'detail' in group 'nope' under prefix 'redislock'" in err
    assert "stages there: list, detail (group othershop), detail (group shopfull)" in err
    code, out, _ = call("set-limit", "list", "4", "--url", redis_url)  # in one group only
    assert (code, out) == (0, "list: limit 2 -> 4, live for every process\n")
    stages = json.loads(call("status", "--json", "--url", redis_url)[1])["stages"]
    assert sorted((s["group"], s["stage"], s["limit"]) for s in stages) == [
        ("", "list", 4),
        ("othershop", "detail", 5),
        ("shopfull", "detail", 3),
    ]


@pytest.mark.integration
def test_release_and_reset_refuse_without_a_terminal_or_yes(
    redis_url: str, redis_client: redis.Redis, locks: list
) -> None:
    lock = holder(locks, redis_client, "detail", 2)
    lock.acquire()
    before = redis_state(redis_client)
    for args in (["reset", "detail", "--force"], ["release", "detail", lock.owner]):
        result = cli(*args, "--url", redis_url)
        warnings = [
            f"warning: process {os.getpid()} of {lock.owner} is running on this machine\n",
            f"warning: resetting live holders (process {os.getpid()} of {lock.owner} is running "
            "on this machine): until their requests end, the site may see up to 1 request(s) in "
            "flight beyond the cap of 2 (their slots are free to others at once)\n",
        ]
        line = one_line_error(result.stderr.replace(warnings[0], "").replace(warnings[1], ""))
        assert result.returncode == 1 and "standard input is not a terminal; pass --yes" in line
    # In process: a terminal that answers no, then yes.
    code, _, err = call("reset", "detail", "--force", "--url", redis_url, stdin=Tty("n\n"))
    assert code == 1 and "[y/N]" in err and "aborted; nothing was changed" in err
    assert redis_state(redis_client) == before
    code, out, err = call("reset", "detail", "--force", "--url", redis_url, stdin=Tty("yes\n"))
    assert (
        code == 0
        and "Reset stage 'detail': free 1 held slot(s) of 1 holder(s)" in err
        and "freed 1" in out
    )


@pytest.mark.integration
def test_confirmation_prompt_on_a_real_terminal(
    redis_url: str, redis_client: redis.Redis, locks: list
) -> None:
    lock = holder(locks, redis_client, "detail", 2)
    lock.acquire()

    def answer(text: str) -> subprocess.CompletedProcess:
        master, slave = pty.openpty()
        try:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "scrapy_redislock",
                    "release",
                    "detail",
                    lock.owner,
                    "--url",
                    redis_url,
                ],
                cwd=ROOT,
                env=CLEAN_ENV,
                stdin=slave,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            os.write(master, text.encode())
            out, err = process.communicate(timeout=30)
        finally:
            os.close(slave)
            os.close(master)
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    refused = answer("\n")  # the default is no
    assert refused.returncode == 1 and "[y/N]" in refused.stderr and "aborted" in refused.stderr
    assert status_json(redis_url)["detail"]["held"] == 1
    done = answer("y\n")
    assert done.returncode == 0 and f"released 1 slot(s) of {lock.owner}" in done.stdout
    assert status_json(redis_url)["detail"]["held"] == 0


# -- ACL and TLS -----------------------------------------------------------------------------------


@pytest.mark.integration
def test_acl_user_and_password_in_the_url_are_used_and_never_printed(
    redis_url: str, redis_client: redis.Redis, locks: list
) -> None:
    password = "s3cr#t/pw"  # needs percent-encoding in a URL
    encoded = "s3cr%23t%2Fpw"
    redis_client.acl_setuser(
        "operator", enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all"]
    )
    try:
        holder(locks, redis_client, "detail", 2).acquire()
        port_part = redis_url.split("//", 1)[1]
        good = f"redis://operator:{encoded}@{port_part}"
        result = cli("status", "--url", good)
        assert result.returncode == 0, result.stderr
        assert "redis://operator:***@" in result.stdout
        result = cli("set-limit", "detail", "3", "--url", good)
        assert result.returncode == 0 and "limit 2 -> 3" in result.stdout
        bad = f"redis://operator:wrong{encoded}@{port_part}"
        result = cli("status", "--url", bad)
        line = one_line_error(result.stderr)
        assert (
            result.returncode == 1 and "refused the credentials" in line and "operator:***@" in line
        )
        for output in (result.stdout, result.stderr):
            assert password not in output and encoded not in output and "wrong" not in output
        # A read-only user may look, not change: status works, set-limit is refused by Redis in one
        # line.
        redis_client.acl_setuser(
            "viewer", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@read", "+@connection", "+multi",
            "+exec", "+xinfo"],
        )  # fmt: skip
        viewer = f"redis://viewer:pw@{port_part}"
        assert status_json(viewer)["detail"]["limit"] == 3
        before = redis_state(redis_client)
        code, _, err = call("set-limit", "detail", "5", "--url", viewer)
        line = one_line_error(err)
        assert (
            code == 1
            and "refused the command (ACL)" in line
            and "evalsha" in line
            and "viewer:***@" in line
        )
        assert redis_state(redis_client) == before
    finally:
        redis_client.acl_deluser("operator", "viewer")


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, int, Path]]:
    """A redis-server with a TLS port and a self-signed certificate (skipped if openssl or TLS
    support is missing)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    made = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert), "-days",
         "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        capture_output=True,
    )  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {made.stderr[-200:]!r}")
    tls_port = free_port()
    extra = ["--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    extra += ["--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]
    server = RedisServer(extra_args=extra)
    try:
        server.start()
    except RuntimeError as exc:
        pytest.skip(f"this redis-server has no TLS support: {exc}")
    yield server, tls_port, cert
    server.stop()


@pytest.mark.integration
def test_tls_urls_work_and_tls_failures_are_one_clear_line(
    tls_server: tuple[RedisServer, int, Path],
) -> None:
    server, tls_port, cert = tls_server
    plain = redis.Redis.from_url(server.url)
    plain.flushdb()
    lock = CountingLock(plain, "detail", limit=2)
    lock.acquire()
    try:
        tls = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}"
        result = cli("status", "--json", "--url", tls)
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        assert data["url"] == tls and data["stages"][0]["held"] == 1
        result = cli("set-limit", "detail", "4", "--url", tls)
        assert result.returncode == 0 and lock.get_limit() == 4

        unverified = f"rediss://127.0.0.1:{tls_port}/0?socket_connect_timeout=2"
        line = one_line_error(cli("status", "--url", unverified).stderr)
        assert "certificate verify failed" in line and "ssl_ca_certs=FILE" in line
        not_tls = f"rediss://127.0.0.1:{server.port}/0?socket_connect_timeout=1&socket_timeout=1"
        result = cli("status", "--url", not_tls)
        line = one_line_error(result.stderr)
        assert (
            result.returncode == 1
            and "cannot reach Redis" in line
            and "does the server speak TLS" in line
        )
    finally:
        lock.close()
        plain.close()


# -- as a Scrapy command ---------------------------------------------------------------------------


@pytest.mark.integration
def test_scrapy_command_reads_the_project_settings(
    redis_url: str, redis_client: redis.Redis, locks: list, tmp_path: Path
) -> None:
    lock = CountingLock(redis_client, "detail", limit=2, key_prefix="shop")
    locks.append(lock)
    lock.acquire()
    (tmp_path / "scrapy.cfg").write_text("[settings]\ndefault = shopproject.settings\n")
    package = tmp_path / "shopproject"
    package.mkdir()
    (package / "__init__.py").write_text("")
    settings = package / "settings.py"
    settings.write_text(
        f"REDISLOCK_URL = {redis_url!r}\nREDISLOCK_KEY_PREFIX = 'shop'\nREDISLOCK_STAGES = "
        f"{{'detail': 2}}\n"
        "COMMANDS_MODULE = 'scrapy_redislock.commands'\n"
    )

    def scrapy(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "scrapy", "redislock", *args], cwd=tmp_path, env=CLEAN_ENV, capture_output=True,
            text=True, timeout=60,
        )  # fmt: skip

    result = scrapy("status", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["prefix"] == "shop" and data["stages"][0]["grants"][0]["holder"] == lock.owner
    result = scrapy("set-limit", "detail", "5")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "detail: limit 2 -> 5, live for every process",
        "note: this project's REDISLOCK_STAGES says 'detail': 2; a crawl process started from now "
        "on writes that "
        "limit back",
    ]
    result = scrapy("-s", "REDISLOCK_KEY_PREFIX=elsewhere", "status")
    assert result.returncode == 0 and "no stage locks under prefix 'elsewhere'" in result.stdout
    result = scrapy("reset", "detail", "--force")
    warning, error = result.stderr.strip().splitlines()
    assert result.returncode == 1 and "pass --yes" in error and "resetting live holders" in warning

    settings.write_text(f"REDISLOCK_URL = {redis_url!r}\nREDISLOCK_STAGES = {{'detail': -1}}\n")
    result = scrapy("status")
    assert (
        result.returncode == 2
        and "REDISLOCK_STAGES['detail'] must be an integer" in one_line_error(result.stderr)
    )


# -- a live crawl ----------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.crawl
def test_set_limit_during_a_live_crawl_changes_what_the_server_sees(
    redis_url: str, redis_client: redis.Redis
) -> None:
    with CrawlSite(delay=0.15) as site:
        settings = {
            "REDISLOCK_URL": redis_url,
            "REDISLOCK_STAGES": {"detail": 2},
            "CONCURRENT_REQUESTS": 16,
        }
        crawl = start_crawl(site.url, "detail:400", settings)
        try:
            deadline = time.monotonic() + 30
            while not site.arrivals["detail"] and time.monotonic() < deadline:
                time.sleep(0.05)
            started = time.monotonic()
            # a few pages on each of the two slots (a count, not a time: a busy machine sends them
            # late)
            assert site.wait_for(lambda: site.count("detail") >= 6, timeout=30)
            assert site.max_in_flight_between("detail", started, time.monotonic()) == 2

            raised = cli("set-limit", "detail", "6", "--url", redis_url)
            assert raised.returncode == 0 and "limit 2 -> 6" in raised.stdout, raised.stderr
            changed = time.monotonic()
            time.sleep(1.5)
            assert site.max_in_flight_between("detail", changed + 0.3, time.monotonic()) == 6

            stage = status_json(redis_url)["detail"]
            assert stage["limit"] == 6 and stage["held"] >= 1
            assert {(g["pid"], g["spider"], g["host"]) for g in stage["grants"]} == {
                (crawl.pid, "plan", HOST)
            }

            code, out, _ = call("set-limit", "detail", "1", "--url", redis_url)
            assert code == 0 and "limit 6 -> 1" in out
            lowered = time.monotonic()  # the new limit is in Redis by now
            # The six slots held at the lowering end with their pages, and none is granted while
            # more than one is held (an order, not a time: a busy machine stretches the pages and
            # sends a granted request late): from then on, one page at a time ...
            assert site.wait_for(lambda: held_slots(redis_client, locks=["detail"]) <= 1, 30)
            drained = time.monotonic()
            seen = site.count("detail")
            assert site.wait_for(lambda: site.count("detail") >= seen + 4, timeout=30)
            assert site.max_in_flight_between("detail", drained, time.monotonic()) == 1
            # ... and before then, only pages on the six slots granted before the lowering reached
            # the site beside another: two a slot at most (one more page passes a slot on locally
            # while it is younger than REDISLOCK_LOCAL_REUSE, 0.25 s, and a page takes 0.15 s at
            # least). A limit the crawl read late would let 40 pages a second through meanwhile.
            with site.lock:
                arrived = set(site.arrivals["detail"])
                beside = [
                    m
                    for m, counts in site.samples
                    if m > lowered and m in arrived and counts.get("detail", 0) > 1
                ]
            assert len(beside) <= 2 * 6, beside

            # let it finish
            assert cli("set-limit", "detail", "16", "--url", redis_url).returncode == 0
            output, _ = crawl.communicate(timeout=60)
        finally:
            if crawl.poll() is None:
                crawl.kill()
                crawl.communicate()
    assert crawl.returncode == 0, output[-3000:]
    assert sum(site.hits.values()) == 400
    stage = status_json(redis_url)["detail"]
    assert stage["held"] == 0 and stage["processes"] == []


# -- requeue: a dead worker's in-flight requests back in their queues now (issue 26, item 3) -------


def test_requeue_puts_a_workers_in_flight_requests_back_and_refuses_what_it_cannot_name(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def make() -> list[str]:
        client = redis.asyncio.Redis.from_url(redis_url)
        made = []
        for name in ("h1:11:aaaaaa", "h1:12:bbbbbb"):
            queues = StageQueues(client, "shop", ["list", "detail"], worker=name)
            await queues.beat("detail")
            made.append(queues.worker)
        await queues.push_many(
            [("detail", f"d{n}", f"r{n}".encode()) for n in range(3)] + [("list", "l", b"x")]
        )
        await queues.pop("detail", 2)
        await queues.pop("list", 1)
        await client.aclose()
        return made

    alive, dead = asyncio.run(make())
    keys = QueueKeys.of("redislock", "shop")
    redis_client.zadd(keys.due, {dead: 0})  # past its deadline
    code, _, err = call("requeue", "nobody", "--yes", "--url", redis_url)
    assert code == 1 and "no worker 'nobody' under prefix 'redislock'" in one_line_error(err)
    assert dead in err and alive in err
    code, _, err = call("requeue", "h1", "--yes", "--url", redis_url)
    assert code == 1 and "worker 'h1' is ambiguous" in one_line_error(err)
    # not confirmed: stdin is not a terminal
    code, _, err = call("requeue", "h1:12", "--url", redis_url)
    assert code == 1 and "--yes" in one_line_error(err)
    assert redis_client.hlen(keys.inflight(dead)) == 3
    code, out, err = call("requeue", "h1:12", "--yes", "--url", redis_url)
    assert code == 0 and err == "", err
    assert out.strip() == (
        f"shop: requeued 3 in-flight request(s) of worker {dead} (stage detail) at the front of "
        "their queues; it is "
        "unregistered"
    )
    # r0 is popped first again
    assert redis_client.lrange(keys.queue("detail"), 0, -1) == [b"r2", b"r1", b"r0"]
    assert redis_client.lrange(keys.queue("list"), 0, -1) == [b"x"]
    assert (
        not redis_client.exists(keys.inflight(dead))
        and redis_client.zscore(keys.alive, dead) is None
    )
    assert (
        redis_client.zscore(keys.due, dead) is None and int(redis_client.get(keys.in_flight)) == 0
    )
    # A worker that still beats: done as asked, with a warning (what it has in progress is fetched
    # twice).
    code, out, err = call("requeue", alive, "--yes", "--url", redis_url)
    assert code == 0 and "requeued 0 in-flight request(s)" in out
    assert err.startswith(f"warning: worker {alive} beat") and "fetched twice" in err
