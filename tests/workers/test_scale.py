"""What an idle worker costs Redis does not grow with the number of workers: counted exactly, not
timed.

N idle ``scrapy runspider`` workers (nothing queued) run against the test Redis; MONITOR shows every
command, and each worker's connections are told apart by their client name (REDISLOCK_PARAMS). A
worker's heartbeat period runs from one of its ``queue_beat`` scripts to the next: the commands it
sent in between (with what its scripts ran) are the cost of one idle tick. The same count with 2 and
with 6 workers, and the same for every worker, is O(1).
"""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import time
import uuid
from collections import Counter

import pytest
import redis
import redis.asyncio
import scrapy

from scrapy_redislock._redis import text
from scrapy_redislock.crawl import requestformat
from scrapy_redislock.workers.queue import QueueKeys, StageQueues, worker_scripts
from testing.crawlproc import staged_worker
from testing.monitor import Monitor, commands
from testing.site import CrawlSite
from testing.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crawl]

TTL = 1.5  # a heartbeat every 0.5 s
PERIODS = 3  # heartbeat periods counted per worker


def script_sha(name: str) -> str:
    return hashlib.sha1(worker_scripts()[name].encode()).hexdigest()


def idle_workers(redis_url: str, prefix: str, count: int) -> list[subprocess.Popen[str]]:
    settings = {
        "REDISLOCK_WORKER_STAGES": {"a": 1, "b": None},
        "REDISLOCK_TTL": TTL,
        "REDISLOCK_IDLE_CLOSE": "None",
        "MAX_IDLE_TIME_BEFORE_CLOSE": 0,
        "REDISLOCK_KEY_PREFIX": prefix,
    }
    return [
        staged_worker(
            redis_url,
            "http://127.0.0.1:9",
            "",
            {**settings, "REDISLOCK_PARAMS": {"client_name": f"{prefix}-{n}"}},
        )
        for n in range(count)
    ]


def stop(workers: list[subprocess.Popen[str]]) -> None:
    for worker in workers:
        worker.terminate()
    for worker in workers:
        try:
            worker.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.communicate()


def names_by_address(client: redis.Redis, prefix: str) -> dict[str, str]:
    return {
        str(c["addr"]): str(c["name"])
        for c in client.client_list()
        if str(c.get("name", "")).startswith(prefix)
    }


def blocked(client: redis.Redis, prefix: str) -> int:
    """Connections of these workers blocked in BLPOP (each idle worker has one)."""
    return sum(
        1
        for c in client.client_list()
        if str(c.get("name", "")).startswith(prefix) and c["cmd"] == "blpop"
    )


def tick_costs(raw: bytes, names: dict[str, str]) -> dict[str, list[Counter[str]]]:
    """Per worker, the commands of each full heartbeat period MONITOR saw (client commands and
    script commands)."""
    sha = script_sha("queue_beat")
    periods: dict[str, list[Counter[str]]] = {}
    current: dict[str, Counter[str] | None] = {}
    last = None  # the worker of the last client command: a script's commands follow its EVALSHA
    for _, source, args in commands(raw):
        name = text(args[0]).lower()
        if source == "lua":
            counter = current.get(last) if last else None
            if counter is not None:
                counter["lua:" + name] += 1
            continue
        worker = names.get(source)
        last = worker
        if worker is None:
            continue
        if name == "evalsha" and text(args[1]) == sha:
            current[worker] = Counter()  # a beat starts a period; the one before it is complete
            periods.setdefault(worker, []).append(current[worker])
        counter = current.get(worker)
        if counter is not None:
            counter[name] += 1
    # The last period of each worker is cut off by the end of the window.
    return {worker: found[:-1] for worker, found in periods.items()}


def measure(admin_url: str, count: int) -> dict[str, list[Counter[str]]]:
    """The workers connect as the admin user: naming a connection (CLIENT SETNAME) is not in the
    crawler ACL."""
    prefix = f"scale{uuid.uuid4().hex[:6]}"
    admin = redis.Redis.from_url(admin_url)
    workers = idle_workers(admin_url, prefix, count)
    try:
        keys = QueueKeys.of(prefix, "staged")
        wait_until(lambda: admin.zcard(keys.alive) == count, 60, f"{count} workers registered")
        wait_until(
            lambda: blocked(admin, prefix) == count, 60, f"{count} workers blocked waiting for work"
        )
        names = names_by_address(admin, prefix)
        assert len(set(names.values())) == count
        host, port = (
            admin.connection_pool.connection_kwargs["host"],
            admin.connection_pool.connection_kwargs["port"],
        )
        monitor = Monitor(port, host)

        def enough() -> bool:
            found = tick_costs(bytes(monitor.data), names)
            return len(found) == count and all(
                len(periods) >= PERIODS for periods in found.values()
            )

        wait_until(enough, 60, f"{PERIODS} heartbeat periods of every worker")
        raw = monitor.stop(admin)
        # the same connections (an idle worker opens none)
        names.update(names_by_address(admin, prefix))
        return tick_costs(raw, names)
    finally:
        stop(workers)
        admin.close()


def test_one_idle_tick_costs_the_same_commands_with_2_and_with_6_workers(admin_url: str) -> None:
    costs = {count: measure(admin_url, count) for count in (2, 6)}
    seen: dict[int, set[tuple[tuple[str, int], ...]]] = {}
    for count, by_worker in costs.items():
        assert len(by_worker) == count
        seen[count] = {
            tuple(sorted(period.items()))
            for periods in by_worker.values()
            for period in periods[:PERIODS]
        }
    # Every worker, every period, both cluster sizes: one and the same list of commands.
    assert seen[2] == seen[6], seen
    assert len(seen[2]) == 1, seen[2]
    (tick,) = seen[2]
    commands_per_tick = dict(tick)
    # A heartbeat (the script and the 6 commands it runs: TIME, ZADD of the beat and of its
    # deadline, HDEL, HLEN of its own in-flight record, ZRANGEBYSCORE ... LIMIT of the deadlines
    # passed), one look at the queues and the in-flight counter (the queue_look script: LLEN + ZCARD
    # per stage, GET), one blocking wait for work (BLPOP). No HLEN of other workers, no polling.
    assert commands_per_tick == {
        "evalsha": 2,
        "lua:time": 1,
        "lua:zadd": 2,
        "lua:hdel": 1,
        "lua:hlen": 1,
        "lua:zrangebyscore": 1,
        "lua:llen": 2,
        "lua:zcard": 2,
        "lua:get": 1,
        "blpop": 1,
    }, commands_per_tick


def test_an_idle_worker_takes_queued_work_at_once_not_at_its_next_heartbeat(admin_url: str) -> None:
    """A worker blocked in Redis is woken by the push itself, not by its next heartbeat (every 10 s
    with REDISLOCK_TTL 30) or a poll: it fetches the page before that heartbeat is due."""
    prefix = f"wake{uuid.uuid4().hex[:6]}"
    admin = redis.Redis.from_url(admin_url)
    keys = QueueKeys.of(prefix, "staged")
    with CrawlSite(delay=0) as site:
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 1},
            "REDISLOCK_TTL": 30,
            "REDISLOCK_IDLE_CLOSE": "None",
            "MAX_IDLE_TIME_BEFORE_CLOSE": 0,
            "REDISLOCK_KEY_PREFIX": prefix,
            "REDISLOCK_PARAMS": {"client_name": f"{prefix}-0"},
        }
        worker = staged_worker(admin_url, site.url, "", settings)
        try:
            wait_until(lambda: admin.zcard(keys.alive) == 1, 60, "the worker registered")
            wait_until(
                lambda: blocked(admin, prefix) == 1, 60, "the worker blocked waiting for work"
            )
            names = names_by_address(admin, prefix)
            kwargs = admin.connection_pool.connection_kwargs
            monitor = Monitor(kwargs["port"], kwargs["host"])
            pushed = time.monotonic()
            seed_one(admin_url, prefix, f"{site.url}/a/0")
            wait_until(
                lambda: site.hits["/a/0"] == 1,
                timeout=9,
                what="the page fetched before the next heartbeat",
            )
            fetched_after = time.monotonic() - pushed
            raw = monitor.stop(admin)
        finally:
            stop([worker])
            admin.close()
    pop = script_sha("queue_pop")
    sent = [
        text(args[1]) if text(args[0]).lower() == "evalsha" else text(args[0]).lower()
        for _, source, args in commands(raw)
        if names.get(source)
    ]
    assert pop in sent, sent
    before = sent[: sent.index(pop)]
    # Woken by the BLPOP it was blocked in: one look at the queue, the stage taken (its slot, a beat
    # naming the stage for people), the pop. No second wait, no heartbeat period went by.
    assert "blpop" not in before and before.count(script_sha("queue_look")) == 1, (
        f"{fetched_after:.2f} s: {before}"
    )


def seed_one(url: str, prefix: str, page: str) -> None:
    async def push() -> None:
        client = redis.asyncio.Redis.from_url(url)
        queues = StageQueues(client, "staged", ["a"], key_prefix=prefix, worker="seeder")
        request = scrapy.Request(page, meta={"redislock_stage": "a"})
        await queues.push("a", "", requestformat.dumps(request.to_dict()))
        await client.aclose()

    asyncio.run(push())
