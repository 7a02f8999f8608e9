"""``python -m scrapy_redislock forget STAGE`` against a real redis-server (issue 26, item 10c): it
deletes a stage nobody uses, in one script (``lock/scripts/retire.lua`` through
``LockCore.retire``), and refuses, naming who and changing nothing, while a grant is held (a dead
holder's too) or an owner was seen within 3 leases; ``--force`` frees and forgets them first."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from scrapy_redislock import CountingLock
from scrapy_redislock.cli.main import main

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
HOST = socket.gethostname()

HOLDER_SCRIPT = """
import json, sys, time
import redis
from scrapy_redislock import CountingLock
lock = CountingLock(redis.Redis.from_url(sys.argv[1]), sys.argv[2], limit=2, ttl=30, identity={"spider": "shop"})
permit = lock.acquire()
print(json.dumps({"owner": lock.owner}), flush=True)
time.sleep(3600)
"""


def call(*argv: str, stdin: io.StringIO | None = None) -> tuple[int, str, str]:
    """The command line in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), env={}, stdin=stdin or io.StringIO(), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def keys_of(client: redis.Redis, stage: str) -> list[bytes]:
    return sorted(client.scan_iter(f"redislock:{{{stage}}}:*"))


def state(client: redis.Redis) -> dict[bytes, Any]:
    """Every key and what it holds (streams by entries and group), to show that a refusal wrote
    nothing."""
    found: dict[bytes, Any] = {}
    for key in sorted(client.scan_iter()):
        kind = client.type(key)
        if kind == b"hash":
            found[key] = client.hgetall(key)
        elif kind == b"zset":
            found[key] = client.zrange(key, 0, -1)
        elif kind == b"stream":
            groups = client.xinfo_groups(key)
            found[key] = (
                client.xrange(key),
                [(g["name"], g["last-delivered-id"], g["pending"]) for g in groups],
            )
        else:
            found[key] = kind
    return found


def test_forget_deletes_a_stage_nobody_uses_and_workers_stages_too(
    redis_url: str, redis_client: redis.Redis
) -> None:
    for stage in ("detial", "workers:detail"):
        assert call("set-limit", stage, "2", "--create", "--url", redis_url)[0] == 0
        assert keys_of(redis_client, stage)
        code, out, err = call("forget", stage, "--yes", "--url", redis_url)
        assert code == 0, err
        assert out.strip() == f"{stage}: forgotten: its keys are deleted from Redis (limit 2)"
        assert keys_of(redis_client, stage) == []
    # A holder that closed (released and unregistered) no longer uses the stage.
    lock = CountingLock(redis_client, "list", limit=1, ttl=30)
    lock.release(lock.acquire())
    lock.close()
    assert call("forget", "list", "--yes", "--url", redis_url)[0] == 0
    assert redis_client.dbsize() == 0
    code, _, err = call("forget", "list", "--yes", "--url", redis_url)
    assert code == 1 and "unknown stage 'list'" in err


def test_forget_refuses_a_stage_in_use_naming_who_and_changes_nothing(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A live holder, a holder SIGKILLed a moment ago (its lease runs), and an owner that holds
    nothing but was seen within 3 leases: each is named, and Redis is left exactly as it was.
    --force frees and forgets them, then deletes."""
    lock = CountingLock(redis_client, "seen", limit=2, ttl=30, identity={"spider": "plan"})
    lock.release(lock.acquire())  # registered and seen just now; holds nothing
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER_SCRIPT, redis_url, "held"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        owner = json.loads(process.stdout.readline())["owner"]
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.communicate()
    before = state(redis_client)
    code, _, err = call("forget", "held", "--yes", "--url", redis_url)
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert (
        f"stage 'held' is in use, nothing was deleted: 1 slot(s) held by {owner} (host {HOST}, pid "
        f"{process.pid}" in err
    )
    assert "lease left" in err and "pass --force" in err
    code, _, err = call("forget", "seen", "--yes", "--url", redis_url)
    assert (
        code == 1
        and f"registered {lock.owner} (host {HOST}, pid {os.getpid()}, spider plan), seen" in err
    ), err
    # no terminal, no --yes: refused before asking
    code, _, err = call("forget", "seen", "--url", redis_url)
    assert code == 1 and "in use" in err
    assert state(redis_client) == before

    code, out, err = call("forget", "held", "--url", redis_url, "--force")  # --force still asks
    assert code == 1 and "pass --yes to confirm" in err
    assert state(redis_client) == before
    code, out, err = call("forget", "held", "--force", "--yes", "--url", redis_url)
    assert code == 0, err
    assert (
        out.strip()
        == "held: forgotten: its keys are deleted from Redis (limit 2); freed 1 held slot(s) first"
    )
    assert keys_of(redis_client, "held") == []
    assert call("forget", "seen", "--force", "--yes", "--url", redis_url)[0] == 0
    assert redis_client.dbsize() == 0
    lock.close()
