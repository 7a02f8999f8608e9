"""The lock designs bench/contention.py compares: ours, and peer designs a crawl cluster might use
instead.

``DESIGNS[key].make(client, index, options)`` returns ``(acquire, release)`` for one benchmark
process: ``acquire()`` blocks until granted and returns a token, ``release(token)`` gives the slot
back.

The zset semaphore and the WATCH/MULTI counter are written here from their textbook descriptions
(they are designs, not packages). redis-py's Lock ships with redis-py; python-redis-lock and pottery
are the ``bench`` extra (``pip install -e '.[bench]'``) and are skipped when missing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from scrapy_redislock import CountingLock

Acquire = Callable[[], Any]
Release = Callable[[Any], Any]
Maker = Callable[[redis.Redis, int, "Options"], tuple[Acquire, Release]]

LEASE = 30.0  # seconds; every design gets the same lease/expiry, far longer than a run, so nothing expires
POLL = 0.001  # the polling designs retry after 1 ms


def _token_list(client: redis.Redis, index: int, options: Options) -> tuple[Acquire, Release]:
    """Not a lock (no lease, no owner, no fencing): one token in a list, taken with BLPOP and given
    back with LPUSH.

    The least a blocking hand-off through Redis costs: the floor under every design that wakes a
    blocked waiter."""
    key = "bench:tokens"
    if client.set(f"{key}:made", 1, nx=True):
        client.lpush(key, 1)

    def acquire() -> None:
        client.blpop([key], 0)

    return acquire, lambda _token: client.lpush(key, 1)


@dataclass(frozen=True)
class Options:
    """Knobs of the peer designs that the command line sets."""

    zset_skew: float = 2.0  # seconds; see clock_offset()


def clock_offset(index: int, skew: float) -> float:
    """Client-clock error of benchmark process ``index`` for the zset semaphore.

    A third of the processes run ``skew`` seconds behind, a third are exact, a third run ``skew``
    ahead (process 0 behind, 1 exact, 2 ahead, 3 behind, ...). NTP-less or badly synced machines are
    off by seconds; a design that ranks holders by client time is only as right as the worst clock.
    """
    return ((index % 3) - 1) * skew


def _ours(limit: int) -> Maker:
    def make(client: redis.Redis, index: int, options: Options) -> tuple[Acquire, Release]:
        lock = CountingLock(client, "bench", limit=limit, ttl=LEASE)
        return lock.acquire, lock.release

    return make


def _redis_py_lock(sleep: float) -> Maker:
    """redis-py's Lock: SET NX PX, polled every ``sleep`` s; release is a Lua compare-and-delete."""

    def make(client: redis.Redis, index: int, options: Options) -> tuple[Acquire, Release]:
        lock = client.lock("bench:redispy", timeout=LEASE, sleep=sleep)

        def acquire() -> None:
            lock.acquire()

        return acquire, lambda _token: lock.release()

    return make


def _python_redis_lock(
    client: redis.Redis, index: int, options: Options
) -> tuple[Acquire, Release]:
    """python-redis-lock: SET NX EX, and a waiter BLPOPs a signal list that the releaser LPUSHes."""
    import redis_lock  # type: ignore[import-not-found,import-untyped]

    lock = redis_lock.Lock(client, "bench", expire=int(LEASE))

    def acquire() -> None:
        lock.acquire()

    return acquire, lambda _token: lock.release()


def _pottery(client: redis.Redis, index: int, options: Options) -> tuple[Acquire, Release]:
    """pottery's Redlock with a single master: SET NX PX, retried after a random 0-200 ms sleep."""
    from pottery import Redlock  # type: ignore[import-not-found,import-untyped]

    lock = Redlock(key="bench:pottery", masters={client}, auto_release_time=LEASE)

    def acquire() -> None:
        lock.acquire()

    return acquire, lambda _token: lock.release()


def _zset_semaphore(limit: int) -> Maker:
    """The counting semaphore of "Redis in Action" 6.3.1, ranked by the client's own clock.

    One MULTI/EXEC: ZREMRANGEBYSCORE drops entries older than the lease by *this client's* time,
    ZADD the owner with this client's time.time(), ZRANK; rank < limit wins, else ZREM and retry
    after 1 ms. Release: ZREM.
    """

    def make(client: redis.Redis, index: int, options: Options) -> tuple[Acquire, Release]:
        offset = clock_offset(index, options.zset_skew)
        key = "bench:zsem"

        def acquire() -> str:
            token = uuid.uuid4().hex
            while True:
                now = time.time() + offset
                pipe = client.pipeline(transaction=True)
                pipe.zremrangebyscore(key, "-inf", now - LEASE)
                pipe.zadd(key, {token: now})
                pipe.zrank(key, token)
                rank = pipe.execute()[-1]
                if rank is not None and rank < limit:
                    return token
                client.zrem(key, token)
                time.sleep(POLL)

        return acquire, lambda token: client.zrem(key, token)

    return make


def _watch_counter(limit: int) -> Maker:
    """Optimistic counter: WATCH, GET; below the limit MULTI INCR EXEC, else UNWATCH and retry after
    1 ms."""

    def make(client: redis.Redis, index: int, options: Options) -> tuple[Acquire, Release]:
        key = "bench:count"

        def acquire() -> None:
            while True:
                with client.pipeline() as pipe:
                    try:
                        pipe.watch(key)
                        if int(pipe.get(key) or 0) < limit:
                            pipe.multi()
                            pipe.incr(key)
                            pipe.execute()
                            return
                        pipe.unwatch()
                    except redis.WatchError:
                        pass  # someone changed the count between GET and EXEC: try again
                time.sleep(POLL)

        return acquire, lambda _token: client.decr(key)

    return make


@dataclass(frozen=True)
class Design:
    label: str
    limit: int
    make: Maker
    needs: str | None = None  # optional module the design imports


DESIGNS: dict[str, Design] = {
    "ours3": Design("scrapy_redislock CountingLock", 3, _ours(3)),
    "zset3": Design(
        "zset semaphore ranked by client timestamps, 1 ms polling", 3, _zset_semaphore(3)
    ),
    "watch3": Design("WATCH/MULTI counter with max, 1 ms polling", 3, _watch_counter(3)),
    "ours1": Design("scrapy_redislock CountingLock", 1, _ours(1)),
    "redispy": Design("redis-py Lock, default sleep 0.1 s", 1, _redis_py_lock(0.1)),
    "redispy1ms": Design("redis-py Lock, sleep 1 ms", 1, _redis_py_lock(0.001)),
    "prl": Design("python-redis-lock (BLPOP signal)", 1, _python_redis_lock, needs="redis_lock"),
    "pottery": Design("pottery Redlock, one master", 1, _pottery, needs="pottery"),
    "zset1": Design(
        "zset semaphore ranked by client timestamps, 1 ms polling", 1, _zset_semaphore(1)
    ),
    "floor1": Design(
        "bare token list, BLPOP/LPUSH (not a lock: Redis's own wake-up floor)", 1, _token_list
    ),
}


def available(key: str) -> bool:
    """False when the design's optional package is not installed."""
    module = DESIGNS[key].needs
    if module is None:
        return True
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def make_locker(
    key: str, client: redis.Redis, index: int, options: Options
) -> tuple[Acquire, Release]:
    return DESIGNS[key].make(client, index, options)
