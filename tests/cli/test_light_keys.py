"""The operator's commands on the lock of a key met at run time while it is on its light path (no
stream: :mod:`scrapy_redislock.lock.light`), against a real redis-server: ``status`` lists its
holders, ``set-limit`` writes a limit every process obeys, ``release`` frees one holder's light
grants, ``reset`` all of them, ``forget`` deletes it."""

from __future__ import annotations

import io
import json

import pytest
import redis

from scrapy_redislock import CountingLock
from scrapy_redislock.cli.main import main
from scrapy_redislock.lock.permit import LockKeys

pytestmark = pytest.mark.integration
KEY = "key:shop.example"
KEYS = LockKeys.of("redislock", KEY)


def call(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), env={}, stdin=io.StringIO(), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def light(client: redis.Redis, limit: int = 3) -> CountingLock:
    return CountingLock(client, KEY, limit, 30.0, light=True, maintain_loop=False)


def keys_json(url: str) -> dict[str, dict]:
    code, out, err = call("status", "--json", "--url", url)
    assert code == 0, err
    return {k["stage"]: k for k in json.loads(out)["keys"]}


def test_status_lists_a_light_key_and_its_holders(
    redis_url: str, redis_client: redis.Redis
) -> None:
    a, b = light(redis_client), light(redis_client)
    a.acquire(), a.acquire(), b.acquire()
    shown = keys_json(redis_url)[KEY]
    assert shown["held"] == 3 and shown["limit"] is None and shown["waiters"] == 0
    assert sorted(p["holder"] for p in shown["processes"]) == sorted([a.owner, b.owner])
    assert all(0 < g["lease_left"] <= 30 for g in shown["grants"])
    code, out, _ = call("status", "--url", redis_url)
    assert code == 0 and "shop.example" in out


def test_set_limit_holds_for_every_process_and_survives_idle(
    redis_url: str, redis_client: redis.Redis
) -> None:
    holder = light(redis_client, limit=5)
    permit = holder.acquire()
    code, _, err = call("set-limit", KEY, "1", "--url", redis_url)
    assert code == 0, err
    assert light(redis_client, limit=5).try_acquire() is None  # the operator's 1, not the 5
    holder.release(permit)
    assert redis_client.ttl(KEYS.light) == -1  # kept while idle: a pause (0) would hold too
    code, _, err = call("set-limit", KEY, "0", "--url", redis_url)
    assert code == 0, err
    assert light(redis_client, limit=5).try_acquire() is None
    assert not redis_client.exists(KEYS.slots)  # set-limit never sets the stream up


def test_release_reset_and_forget(redis_url: str, redis_client: redis.Redis) -> None:
    dead, live = light(redis_client), light(redis_client)
    dead.acquire(), dead.acquire()
    kept = live.acquire()
    code, _, err = call("release", KEY, dead.owner, "--url", redis_url, "--yes")
    assert code == 0, err
    assert redis_client.zrange(KEYS.light, 0, -1) == [kept.token.encode()]
    code, out, err = call("forget", KEY, "--url", redis_url, "--yes")
    assert code == 1 and "in use" in err
    code, out, err = call("reset", KEY, "--url", redis_url, "--yes")
    assert code == 1 and f"{live.owner} renewed a slot" in err and "beyond its cap" in err
    code, out, err = call("reset", KEY, "--url", redis_url, "--yes", "--force")
    assert code == 0 and "freed 1 held slot" in out, err
    assert not redis_client.exists(KEYS.light)
    live.acquire()
    code, _, err = call("forget", KEY, "--url", redis_url, "--yes", "--force")
    assert code == 0, err
    assert not list(redis_client.scan_iter("redislock:{key:*"))
