"""A maximum limit (issue 41, point 1): no typo, operator or crawler can make a resize freeze the
shared Redis. MAX_LIMIT is checked wherever a limit enters (the argument check, settings, the command
line, the scripts themselves), and a resize from 3 to the maximum and back, with every slot free or
every slot held, keeps a concurrent PING under 50 ms at its worst (docs/security.md)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from importlib import resources
from typing import Any

import pytest
import redis
import redis.exceptions
from scrapy.settings import Settings

from scrapy_redislock import CountingLock
from scrapy_redislock._redis import MAX_LIMIT, check_limit, load_scripts
from scrapy_redislock.crawl.settings import read_settings
from scrapy_redislock.errors import ConfigError, InvalidArgument
from scrapy_redislock.lock.adaptive import AdaptiveParams
from scrapy_redislock.lock.core import LockCore
from scrapy_redislock.lock.permit import LockKeys
from tests.cli.test_main import call, one_line_error

pytestmark = pytest.mark.integration


def test_the_scripts_know_the_same_maximum() -> None:
    lib = (resources.files("scrapy_redislock.lock") / "scripts" / "_lib.lua").read_text("utf-8")
    assert re.search(r"^local MAX_LIMIT = (\d+)$", lib, re.MULTILINE)[1] == str(MAX_LIMIT)  # type: ignore[index]


@pytest.mark.parametrize("bad", [MAX_LIMIT + 1, 10**23, -1, 1.5, "3", True])
def test_the_argument_check_refuses_more_than_the_maximum(bad: object) -> None:
    with pytest.raises(InvalidArgument, match=f"limit must be an integer from 0 to {MAX_LIMIT}"):
        check_limit(bad)
    assert check_limit(MAX_LIMIT) == MAX_LIMIT


def test_settings_and_the_adaptive_maximum_refuse_more_than_the_maximum() -> None:
    for name, value in (
        ("REDISLOCK_STAGES", {"detail": MAX_LIMIT + 1}),
        ("REDISLOCK_WORKER_STAGES", {"a": 10**23}),
        ("REDISLOCK_KEY_LIMIT", MAX_LIMIT + 1),
        ("REDISLOCK_KEY_LIMITS", {"example.com": MAX_LIMIT + 1}),
        ("REDISLOCK_ADAPTIVE_MIN", MAX_LIMIT + 1),
    ):
        with pytest.raises(ConfigError, match=f"from (0|1) to {MAX_LIMIT}|at most"):
            read_settings(Settings({name: value}))
    with pytest.raises(InvalidArgument, match=f"at most MAX_LIMIT \\({MAX_LIMIT}\\)"):
        AdaptiveParams(maximum=MAX_LIMIT + 1)


def _state(client: redis.Redis) -> dict[bytes, Any]:
    return {key: client.dump(key) for key in sorted(client.scan_iter())}


@pytest.mark.parametrize(
    "bad", [str(MAX_LIMIT + 1), "99999999999999999999999", "abc", "1.5", "inf", "-1", "nan"]
)
def test_set_limit_script_refuses_a_bad_limit_and_writes_nothing(
    redis_client: redis.Redis, bad: str
) -> None:
    """What a crawler could send with EVALSHA (it may run the project's scripts): refused, with the
    value named, before anything is written."""
    lock = CountingLock(redis_client, "detail", limit=3, ttl=30)
    redis_client.hset(LockKeys.of("redislock", "detail").adapt, "pinned", 3)
    before = _state(redis_client)
    core = LockCore.create("detail", None, 30.0)
    keys = core.keys
    source = load_scripts("scrapy_redislock.lock", ("set_limit",), "_lib")["set_limit"]
    with pytest.raises(
        redis.exceptions.ResponseError, match="BADLIMIT limit must be an integer from 0 to"
    ):
        redis_client.eval(source, 3, keys.slots, keys.meta, keys.adapt, bad, 30000, "0", "0")
    with pytest.raises(redis.exceptions.ResponseError, match="BADLIMIT"):  # a key's lock too
        redis_client.eval(
            source, 4, keys.slots, keys.meta, keys.adapt, keys.light, bad, 30000, "0", "0"
        )
    assert _state(redis_client) == before
    lock.close()


def test_the_command_line_refuses_a_huge_limit_at_once(redis_url: str) -> None:
    code, _, err = call("set-limit", "detail", "99999999999999999999999", "--url", redis_url)
    assert code == 2
    assert one_line_error(err).endswith(
        f"N must be an integer from 0 to {MAX_LIMIT}, got '99999999999999999999999'"
    )
    code, _, err = call("set-limit", "detail", "1" * 5000, "--url", redis_url)
    assert code == 2 and "..." in one_line_error(err)


PINGER = """
import sys, time, redis
client = redis.Redis.from_url(sys.argv[1])
client.ping()
print("ready", flush=True)
worst = 0.0
while True:
    started = time.perf_counter()
    client.ping()
    worst = max(worst, time.perf_counter() - started)
    if client.exists("pinger-stop"):
        break
print(worst, flush=True)
"""


class Pinger:
    """PING in a loop in a process of its own (a thread here would wait for this one's GIL too);
    ``worst``: its longest round trip, seconds."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst = math.inf

    def __enter__(self) -> Pinger:
        self.process = subprocess.Popen(
            [sys.executable, "-c", PINGER, self.url], stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc: object) -> None:
        with redis.Redis.from_url(self.url) as client:
            client.set("pinger-stop", 1)
        out, _ = self.process.communicate(timeout=30)
        self.worst = float(out.strip())


def slowest(client: redis.Redis) -> tuple[float, str]:
    """The longest command Redis ran since the slow log was reset: (seconds, its name)."""
    entries = client.slowlog_get(10_000)
    worst = max(entries, key=lambda e: e["duration"])
    return worst["duration"] / 1e6, str(worst["command"])[:60]


def _resize_cycle(lock: CountingLock, url: str) -> None:
    """3 -> MAX_LIMIT -> 3 -> MAX_LIMIT with every slot free; every slot held; MAX_LIMIT -> 3 (a
    debt) -> MAX_LIMIT -> 3 held; a reset; back to MAX_LIMIT; then the lock at 3 again."""
    for limit in (MAX_LIMIT, 3, MAX_LIMIT):
        lock.set_limit(limit)
    permits = [lock.try_acquire() for _ in range(MAX_LIMIT)]
    assert all(permits) and lock.try_acquire() is None
    for limit in (3, MAX_LIMIT, 3):
        lock.set_limit(limit)
    assert call("reset", "detail", "--force", "--yes", "--url", url)[0] == 0  # its holders live
    lock.set_limit(MAX_LIMIT)
    assert lock.get_limit() == MAX_LIMIT
    lock.set_limit(3)


def test_a_resize_to_the_maximum_and_back_keeps_redis_responsive(
    admin_url: str, redis_client: redis.Redis
) -> None:
    """A resize from 3 to MAX_LIMIT and back, with every slot free and with every slot held, and a
    reset of MAX_LIMIT held slots: no command blocks Redis for 50 ms (the slow log's longest), so a
    concurrent PING waits no longer for it.

    What a PING waits for is the command ahead of it; both figures are printed. The slow log counts
    wall time, which a loaded test machine stretches (another process takes the CPU from Redis
    mid-script): the cycle runs up to three times, and its least-disturbed run is the cost."""
    lock = CountingLock(redis_client, "detail", limit=3, ttl=60)
    redis_client.config_set("slowlog-max-len", 100_000)
    runs = []
    try:
        for _ in range(3):
            redis_client.config_set("slowlog-log-slower-than", 0)
            redis_client.slowlog_reset()
            with Pinger(admin_url) as pinger:
                _resize_cycle(lock, admin_url)
            redis_client.config_set("slowlog-log-slower-than", 1_000_000)
            took, command = slowest(redis_client)
            runs.append((took, pinger.worst, command))
            print(f"slowest command {took:.4f} s ({command}), worst PING {pinger.worst:.4f} s")
            if took < 0.050:
                break
    finally:
        redis_client.config_set("slowlog-log-slower-than", 10_000)
        lock.close()
    assert min(took for took, _, _ in runs) < 0.050, runs
