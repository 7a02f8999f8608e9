"""The harness itself: :mod:`testing.processes` on real (tiny Python) processes, and the crawl-state
readers of :mod:`testing.lockstate` on a real Redis."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import redis

from scrapy_redislock import CountingLock
from scrapy_redislock.workers.queue import QueueKeys
from testing.lockstate import (
    held_slots,
    locks_in,
    request_leftovers,
    requests_key,
    slot_holders,
    worker_leftovers,
    worker_lock,
)
from testing.processes import OPENED, CrawlProcesses, NotOpened

# A stand-in for a crawl: logs OPENED once its SIGTERM handler is in place, then waits for signals.
GRACEFUL = (
    "import signal, sys\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
    f"print({OPENED!r}, flush=True)\n"
    "while True: signal.pause()\n"
)
STUBBORN = GRACEFUL.replace("lambda *_: sys.exit(0)", "signal.SIG_IGN")  # deaf to SIGTERM


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_stop_is_graceful_then_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    with CrawlProcesses(cwd=tmp_path) as crawlers:
        graceful = crawlers.start(python(GRACEFUL), tmp_path / "graceful.log")
        stubborn = crawlers.start(python(STUBBORN), tmp_path / "stubborn.log")
        crawlers.wait_opened(timeout=30, interval=0.01)
        assert crawlers.running == [graceful, stubborn] and crawlers.codes == [None, None]
        assert crawlers.stop(timeout=0.5) == [0, -signal.SIGKILL]
    assert crawlers.running == []
    assert graceful.exited_at is not None and graceful.exited_at >= graceful.started_at
    assert (tmp_path / "graceful.log").read_text() == f"{OPENED}\n"


def test_wait_opened_names_the_process_that_exited_early_and_its_log(tmp_path: Path) -> None:
    with CrawlProcesses(cwd=tmp_path) as crawlers:
        crawlers.start(python(GRACEFUL), tmp_path / "0.log")
        early = crawlers.start(
            python("print('no spider'); raise SystemExit(3)"), tmp_path / "1.log"
        )
        with pytest.raises(NotOpened) as raised:
            crawlers.wait_opened(timeout=30, interval=0.01)
        assert raised.value.process is early
        assert f"process 1 exited with 3 before it logged {OPENED!r}" in str(raised.value)
        assert str(tmp_path / "1.log") in str(raised.value)


def test_wait_opened_names_one_still_starting_after_the_timeout(tmp_path: Path) -> None:
    with CrawlProcesses(cwd=tmp_path) as crawlers:
        slow = crawlers.start(python("import signal; signal.pause()"))  # a pipe: no log file
        with pytest.raises(NotOpened) as raised:
            crawlers.wait_opened(timeout=0.2, interval=0.01)
        assert raised.value.process is slow
        assert "1 of 1 processes had not logged" in str(raised.value)
        assert "its output:" in str(raised.value)  # no log: where its output is
        assert crawlers.starting() == [slow]
    assert slow.returncode == -signal.SIGKILL  # the with block killed it


def test_leaving_on_an_error_kills_and_a_pipe_keeps_the_output(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), CrawlProcesses(cwd=tmp_path) as crawlers:
        piped = crawlers.start(python(GRACEFUL.replace("print(", "print('x' * 3); print(")))
        crawlers.wait_opened(timeout=30, interval=0.01)
        raise RuntimeError("boom")
    assert piped.returncode == -signal.SIGKILL
    assert piped.output == f"xxx\n{OPENED}\n"


def test_a_process_that_writes_its_own_log_is_read_from_it(tmp_path: Path) -> None:
    log = tmp_path / "own.log"
    log.write_text(f"{OPENED} (a previous run's)\n")
    code = f"import pathlib; pathlib.Path({str(log)!r}).write_text(\"'item_scraped_count': 7\")"
    with CrawlProcesses(cwd=tmp_path) as crawlers:
        own = crawlers.start(python(code), log, logs_itself=True)
        assert own.wait(timeout=30) == 0
        assert not own.opened() and own.logged_count("item_scraped_count") == 7
        assert own.logged_count("downloader/response_count") == 0
    with pytest.raises(ValueError):
        CrawlProcesses().start(python("pass"), logs_itself=True)


@pytest.mark.integration
def test_held_slots_and_leftovers_read_the_locks_and_queues(
    redis_client: redis.Redis, locks: list[CountingLock]
) -> None:
    detail = CountingLock(redis_client, "detail", 3, 30)
    workers = CountingLock(redis_client, worker_lock("detail"), 1, 30)
    locks.extend([detail, workers])
    detail.acquire(timeout=5)
    detail.acquire(timeout=5)
    held = workers.acquire(timeout=5)
    assert locks_in(redis_client, "redislock") == ["detail", "workers:detail"]
    assert held_slots(redis_client) == 3
    assert held_slots(redis_client, "redislock", ["detail", "missing"]) == 2
    assert [h.split("#")[0] for h in slot_holders(redis_client, "redislock", "workers:detail")] == [
        workers.owner
    ]
    assert slot_holders(redis_client, "redislock", "missing") == []

    redis_client.lpush(requests_key("plain"), b"a request")
    assert request_leftovers(redis_client, "redislock", "plain", []) == {"queued": 1}
    assert request_leftovers(redis_client, "redislock", "plain", ["detail"]) == {
        "held slots": 2,
        "queued": 1,
    }

    keys = QueueKeys.of("redislock", "shop")
    redis_client.rpush(keys.queue("list"), b"r1")
    redis_client.zadd(keys.scored("detail"), {b"r2": 5})
    redis_client.hset(keys.inflight("gone-worker"), "1", b"r3")  # not registered: still counted
    redis_client.zadd(keys.alive, {"w1": 1})
    assert worker_leftovers(redis_client, "redislock", "shop", ["list", "detail", "comments"]) == {
        "held slots": 1,
        "queued": 2,
        "in flight": 1,
        "workers": 1,
    }
    workers.release(held)
    assert worker_leftovers(redis_client, "redislock", "shop", ["detail"])["held slots"] == 0
