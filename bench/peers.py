"""The lock designs compared by bench/contention.py: ours, and the peer designs it is meant to beat.

Each design gives ``make_locker(design, client, index) -> (acquire, release)`` for one process.
The zset semaphore and the WATCH/MULTI counter are written here from their textbook descriptions (they are
designs, not packages); redis-py's Lock ships with redis-py; python-redis-lock and pottery are optional
(``pip install .[bench]``) and skipped when missing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from scrapy_redislock import CountingLock

Acquire = Callable[[], Any]
Release = Callable[[Any], None]

# The client-timestamp zset semaphore with realistic clock skew: process i's clock is i * 5 ms off.
SKEW_PER_PROCESS = 0.005


def _ours(limit: int) -> Callable[[redis.Redis, int], tuple[Acquire, Release]]:
    def make(client: redis.Redis, index: int) -> tuple[Acquire, Release]:
        lock = CountingLock(client, "bench", limit=limit, ttl=30)
        return lock.acquire, lock.release

    return make


def _redis_py_lock(sleep: float) -> Callable[[redis.Redis, int], tuple[Acquire, Release]]:
    def make(client: redis.Redis, index: int) -> tuple[Acquire, Release]:
        lock = client.lock("bench", timeout=30, sleep=sleep)

        def acquire() -> Any:
            lock.acquire()
            return None

        return acquire, lambda _token: lock.release()

    return make


def _python_redis_lock(client: redis.Redis, index: int) -> tuple[Acquire, Release]:
    import redis_lock  # type: ignore[import-not-found]

    lock = redis_lock.Lock(client, "bench", expire=30)

    def acquire() -> Any:
        lock.acquire()
        return None

    return acquire, lambda _token: lock.release()


def _pottery(client: redis.Redis, index: int) -> tuple[Acquire, Release]:
    from pottery import Redlock  # type: ignore[import-not-found]

    lock = Redlock(key="bench", masters={client}, auto_release_time=30)

    def acquire() -> Any:
        lock.acquire()
        return None

    return acquire, lambda _token: lock.release()


def _zset_semaphore(limit: int) -> Callable[[redis.Redis, int], tuple[Acquire, Release]]:
    """Rank holders by the client's own clock: ZADD now, drop stale by client time, win if rank < limit."""

    def make(client: redis.Redis, index: int) -> tuple[Acquire, Release]:
        skew = index * SKEW_PER_PROCESS

        def acquire() -> Any:
            token = uuid.uuid4().hex
            while True:
                now = time.time() + skew
                pipe = client.pipeline(transaction=True)
                pipe.zremrangebyscore("bench:sem", "-inf", now - 30)
                pipe.zadd("bench:sem", {token: now})
                pipe.zrank("bench:sem", token)
                rank = pipe.execute()[-1]
                if rank is not None and rank < limit:
                    return token
                client.zrem("bench:sem", token)
                time.sleep(0.001)

        return acquire, lambda token: client.zrem("bench:sem", token)

    return make


def _watch_counter(limit: int) -> Callable[[redis.Redis, int], tuple[Acquire, Release]]:
    def make(client: redis.Redis, index: int) -> tuple[Acquire, Release]:
        def acquire() -> Any:
            while True:
                with client.pipeline() as pipe:
                    try:
                        pipe.watch("bench:count")
                        if int(pipe.get("bench:count") or 0) < limit:
                            pipe.multi()
                            pipe.incr("bench:count")
                            pipe.execute()
                            return None
                        pipe.unwatch()
                    except redis.WatchError:
                        pass
                time.sleep(0.001)

        return acquire, lambda _token: client.decr("bench:count")

    return make


def _prepare_ours(limit: int) -> Callable[[redis.Redis], None]:
    return lambda client: CountingLock(client, "bench", limit=limit, ttl=30).set_limit(limit) and None


def _nothing(client: redis.Redis) -> None:
    return None


DESIGNS: dict[str, dict[str, Any]] = {
    "ours3": {"label": "scrapy_redislock CountingLock", "limit": 3, "make": _ours(3), "prepare": _prepare_ours(3)},
    "zset3": {
        "label": "zset semaphore, client timestamps, 1 ms polling",
        "limit": 3,
        "make": _zset_semaphore(3),
        "prepare": _nothing,
    },
    "watch3": {
        "label": "WATCH/MULTI counter, 1 ms polling",
        "limit": 3,
        "make": _watch_counter(3),
        "prepare": _nothing,
    },
    "ours1": {"label": "scrapy_redislock CountingLock", "limit": 1, "make": _ours(1), "prepare": _prepare_ours(1)},
    "redispy": {"label": "redis-py Lock, sleep 0.1 s", "limit": 1, "make": _redis_py_lock(0.1), "prepare": _nothing},
    "redispy1ms": {
        "label": "redis-py Lock, sleep 1 ms",
        "limit": 1,
        "make": _redis_py_lock(0.001),
        "prepare": _nothing,
    },
    "prl": {"label": "python-redis-lock", "limit": 1, "make": _python_redis_lock, "prepare": _nothing},
    "pottery": {"label": "pottery Redlock, one master", "limit": 1, "make": _pottery, "prepare": _nothing},
    "zset1": {
        "label": "zset semaphore, client timestamps, 1 ms polling",
        "limit": 1,
        "make": _zset_semaphore(1),
        "prepare": _nothing,
    },
}


def available(design: str) -> bool:
    module = {"prl": "redis_lock", "pottery": "pottery"}.get(design)
    if module is None:
        return True
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def make_locker(design: str, client: redis.Redis, index: int) -> tuple[Acquire, Release]:
    return DESIGNS[design]["make"](client, index)
