"""What a restart of Redis costs the lock, and what the restart check costs when nothing restarts.

    ./run.sh bench restarts [--ttl 3] [--rounds 200]

Part 1, a redis-server with an RDB snapshot, SIGKILLed and started again from it (as after a crash):
- a newcomer's wait for a slot when no holder survives (the reservation: one lease);
- a holder's re-adoption at its first renewal after the restart;
- a newcomer's wait when a surviving holder releases instead (its reserved slot comes back at once).
Part 2, Redis commands per grant (acquire + release, uncontended) and per renewal (one maintain of
one permit), from INFO commandstats: client commands (EVALSHA, XREADGROUP) and the commands the
scripts run inside Redis. Prints what it measured; nothing is asserted.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from typing import Any

import redis

from bench import add_smoke
from scrapy_redislock import CountingLock
from testing.redis_server import RedisServer

# what the client sends; the rest run in scripts
CLIENT_COMMANDS = {"evalsha", "eval", "xreadgroup", "script|load"}


def calls(client: redis.Redis) -> Counter[str]:
    stats = client.info("commandstats")
    return Counter({name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()})


def per_op(client: redis.Redis, rounds: int, op: Any) -> tuple[float, float, Counter[str]]:
    client.config_resetstat()
    for _ in range(rounds):
        op()
    seen = calls(client)
    seen.pop("config|resetstat", None)
    client_side = sum(n for name, n in seen.items() if name in CLIENT_COMMANDS)
    return client_side / rounds, sum(seen.values()) / rounds, seen


def restart_costs(ttl: float) -> dict[str, float]:
    with RedisServer() as server:
        admin = redis.Redis.from_url(server.url)

        # a waiter's own loop reaps the reservation once its lease is over
        def make() -> CountingLock:
            return CountingLock(redis.Redis.from_url(server.url), "detail", limit=1, ttl=ttl)

        out: dict[str, float] = {}

        old = make()
        old.maintain()
        admin.save()
        server.kill()
        server.start()
        newcomer = make()
        started = time.monotonic()
        permit = newcomer.acquire(timeout=3 * ttl)
        out["newcomer wait, no survivor (s)"] = time.monotonic() - started
        newcomer.release(permit)

        holder = make()
        admin.save()
        held = holder.acquire(timeout=1)
        server.kill()
        server.start()
        started = time.monotonic()
        while True:
            try:
                holder.maintain()
                break
            except redis.RedisError:
                time.sleep(0.01)
        out["holder re-adopted at its first renewal (s)"] = time.monotonic() - started
        assert not held.lost
        holder.release(held)

        holder2 = make()
        admin.save()
        held = holder2.acquire(timeout=1)
        server.kill()
        server.start()
        other = make()
        assert other.try_acquire() is None
        started = time.monotonic()
        holder2.release(held)
        permit = other.acquire(timeout=3 * ttl)
        out["newcomer wait after a survivor's release (s)"] = time.monotonic() - started
        other.release(permit)
        for each in (old, newcomer, holder, holder2, other):
            each.close()
        admin.close()
        return out


def command_costs(rounds: int) -> None:
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        lock = CountingLock(client, "detail", limit=1, ttl=30, maintain_loop=False)
        lock.release(lock.acquire(timeout=1))  # set up, scripts loaded

        per_client, per_all, seen = per_op(
            client, rounds, lambda: lock.release(lock.acquire(timeout=1))
        )
        print(
            f"per grant (acquire + release): {per_client:.2f} client commands, {per_all:.2f} with "
            "script calls"
        )
        print("   ", dict(sorted(seen.items())))
        permit = lock.acquire(timeout=1)
        per_client, per_all, seen = per_op(client, rounds, lambda: lock.maintain([permit]))
        print(
            f"per renewal (one permit): {per_client:.2f} client commands, {per_all:.2f} with "
            "script calls"
        )
        print("   ", dict(sorted(seen.items())))
        lock.close()
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ttl", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument(
        "--commands-only", action="store_true", help="part 2 only (e.g. to compare two versions)"
    )
    add_smoke(parser)
    opts = parser.parse_args()
    if opts.smoke:
        opts.ttl, opts.rounds = 1.0, 10
    if not opts.commands_only:
        for name, value in restart_costs(opts.ttl).items():
            print(f"{name}: {value:.2f}  (ttl {opts.ttl} s)")
    command_costs(opts.rounds)


if __name__ == "__main__":
    main()
