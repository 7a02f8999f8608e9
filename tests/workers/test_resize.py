"""Issue 26 (items 2 and 3), measured from the site's side with real ``scrapy runspider`` workers
and a real Redis.

- Lowering a worker stage's limit, or pausing it (limit 0), moves the workers already on it: the
  newest holders give back what they took ahead, let what is in progress finish, free their slot and
  take another stage or wait, within about one renewal interval (each renewal's reply carries the
  limit). Raising it lets workers on again.
- A SIGKILLed worker's requests are fetched again within seconds (a worker with work promises its
  next beat within 5 s, not a ttl), ``requeue`` and ``release`` put them back at once, and
  ``status`` shows the worker dead as soon as its promise has passed.
- A busy worker on a starved CPU is not taken for dead.

The figures in docs/worker-caps.md come from these tests, printed with ``-s``::

    .venv/bin/python -m pytest tests/workers/test_resize.py -s -n 0 -k "lowering or pausing or fetched_again"

Each worker names itself in its User-Agent, so the site knows which workers have requests of a stage
in flight (``site.workers_in_flight``, ``site.served``).
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from scrapy_redislock.cli.main import main as cli
from scrapy_redislock.cli.status import read_all
from scrapy_redislock.workers.queue import QueueKeys
from testing.crawlproc import staged_worker
from testing.site import CrawlSite
from testing.waiting import wait_until
from tests.workers.test_mixin import held_slots, seed, stat

pytestmark = [pytest.mark.integration, pytest.mark.crawl]

SPIDER = "staged"
KEYS = QueueKeys.of("redislock", SPIDER)
DELAY = 0.1  # seconds a page takes
CONCURRENCY = 2  # CONCURRENT_REQUESTS of each worker: 20 pages/s per worker


class Worker:
    """A ``scrapy runspider`` worker whose output is read as it comes (a full pipe would stall
    it)."""

    def __init__(
        self, redis_url: str, site: CrawlSite, name: str, settings: dict[str, Any]
    ) -> None:
        self.name = name
        merged = {"USER_AGENT": name, "CONCURRENT_REQUESTS": CONCURRENCY, **settings}
        self.process = staged_worker(redis_url, site.url, "", merged)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        # closed at the end of the output (an open pipe is a ResourceWarning)
        with self.process.stdout:
            for line in self.process.stdout:
                self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def worker_id(self, client: redis.Redis) -> str | None:
        """Its id in Redis (host:pid:random), once it registered."""
        for raw in client.zrange(KEYS.alive, 0, -1):
            name = raw.decode()
            if name.rsplit(":", 2)[1] == str(self.process.pid):
                return name
        return None

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)

    def finish(self, timeout: float = 90) -> int:
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(
                f"worker {self.name} did not exit:\n{self.output[-3000:]}"
            ) from None
        self.reader.join(timeout=10)
        return self.process.returncode


@contextlib.contextmanager
def workers(
    redis_url: str, site: CrawlSite, count: int, settings: dict[str, Any]
) -> Iterator[list[Worker]]:
    started = [Worker(redis_url, site, f"w{n}", settings) for n in range(count)]
    try:
        yield started
    finally:
        for worker in started:
            if worker.process.poll() is None:
                worker.process.kill()
                worker.process.wait()


def set_limit(url: str, limit: int) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert cli(["set-limit", "workers:a", str(limit), "--url", url], stdout=out, stderr=err) == 0, (
        err.getvalue()
    )


def run_cli(url: str, *args: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    code = cli([*args, "--url", url], stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    return out.getvalue() + err.getvalue()


def all_fetching(site: CrawlSite, count: int) -> Callable[[], bool]:
    """Every worker has requests of stage a in flight at once: each has started and holds a slot."""
    return lambda: len(site.workers_in_flight["a"]) >= count


def pages(site: CrawlSite, count: int) -> list[str]:
    return [f"{site.url}/a/{n}" for n in range(count)]


def one_worker_since(site: CrawlSite, since: float, run: int = 20) -> tuple[str, float] | None:
    """(the worker, when the others' last request of stage a left the site) once only one worker has
    fetched pages of stage a for ``run`` pages in a row since then (None until then)."""
    with site.lock:
        after = [r for r in site.served if r.stage == "a" and r.answered > since]
    if not after:
        return None
    last = after[-1].worker
    others = [r.answered for r in after if r.worker != last]
    cut = max(others, default=since)
    alone = [r for r in after if r.worker == last and r.arrived > cut]
    return (last, cut) if len(alone) >= run else None


def stage_a_quiet_since(site: CrawlSite, since: float) -> float | None:
    """When the last request of stage a left the site, if none is in flight now (else None)."""
    with site.lock:
        if site.in_flight.get("a"):
            return None
        answered = [r.answered for r in site.served if r.stage == "a"]
    return max([since, *answered])


def check_every_page_once(site: CrawlSite, count: int) -> None:
    assert set(site.hits) == {f"/a/{n}" for n in range(count)}
    assert set(site.hits.values()) == {1}, {p: n for p, n in site.hits.items() if n != 1}


# -- a worker stage lowered or paused under its workers (item 2) -----------------------------------


@pytest.mark.parametrize("ttl", [30.0, 3.0])
def test_lowering_a_worker_stage_moves_the_newest_workers_off_it_at_the_next_renewal(
    redis_url: str, admin_url: str, redis_client: redis.Redis, ttl: float
) -> None:
    """3 workers on stage a (cap 3), lowered to 1: within about a renewal interval (ttl/3, at most 1
    s) only one worker fetches pages of a (the site sees it); raised to 3 again, the others come
    back; every page once."""
    # 15 s of work for 3 workers: before issue 26 they all stayed on a until it was empty
    count = 900
    with CrawlSite(delay=DELAY) as site:
        seed(redis_url, SPIDER, ["a"], {"a": pages(site, count)})
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 3},
            "REDISLOCK_TTL": ttl,
            "REDISLOCK_IDLE_CLOSE": 2,
        }
        with workers(redis_url, site, 3, settings) as running:
            wait_until(all_fetching(site, 3), 90, "3 workers fetching pages of stage a")
            lowered = time.monotonic()
            set_limit(admin_url, 1)
            wait_until(lambda: one_worker_since(site, lowered), 30, "one worker alone on stage a")
            stayer, cut = one_worker_since(site, lowered)  # type: ignore[misc]
            took_effect = cut - lowered
            wait_until(lambda: held_slots(redis_client) == 1, 10, "one slot held")
            raised = time.monotonic()
            set_limit(admin_url, 3)
            wait_until(
                lambda: len(site.workers_in_flight["a"]) >= 2,
                ttl / 3 + 10,
                "a second worker back on a",
            )
            back_after = time.monotonic() - raised
            codes = [worker.finish() for worker in running]
        outputs = [worker.output for worker in running]
        print(
            f"\n[figure] ttl {ttl:g} s: lowered 3 -> 1, workers on the stage down to 1 (site) "
            f"after {took_effect:.2f}"
            f" s; raised to 3, a second worker back after {back_after:.2f} s"
        )
        assert codes == [0, 0, 0], outputs
        assert took_effect <= min(ttl / 3, 1.0) + 2.0, took_effect
        assert back_after <= ttl / 3 + 3.0, back_after
        assert sum(stat(o, "redislock/workers/a/yielded") for o in outputs) == 2
        assert sum("leaves stage 'a': its limit is 1 now" in o for o in outputs) == 2
        assert stayer not in [
            w.name for w, o in zip(running, outputs, strict=True) if "leaves stage 'a'" in o
        ]
        # what the leavers had taken ahead went back to the front of the queue
        check_every_page_once(site, count)
        assert held_slots(redis_client) == 0


@pytest.mark.parametrize("ttl", [30.0, 3.0])
def test_pausing_a_worker_stage_stops_its_fetching_at_the_next_renewal_and_loses_nothing(
    redis_url: str, admin_url: str, redis_client: redis.Redis, ttl: float
) -> None:
    """Limit 0: every holder leaves within about a renewal interval; nothing of the stage is fetched
    while it is paused, though every worker looks at the queue again; nothing queued is lost; raised
    again, the crawl ends with every page fetched exactly once."""
    count = 900
    with CrawlSite(delay=DELAY) as site:
        seed(redis_url, SPIDER, ["a"], {"a": pages(site, count)})
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 3},
            "REDISLOCK_TTL": ttl,
            "REDISLOCK_IDLE_CLOSE": 2,
        }
        with workers(redis_url, site, 3, settings) as running:
            wait_until(all_fetching(site, 3), 90, "3 workers fetching pages of stage a")
            paused = time.monotonic()
            set_limit(admin_url, 0)
            wait_until(
                lambda: (
                    held_slots(redis_client) == 0 and stage_a_quiet_since(site, paused) is not None
                ),
                30,
                "every slot of a freed and nothing of a in flight",
            )
            took_effect = stage_a_quiet_since(site, paused) - paused  # type: ignore[operator]
            fetched = site.count("a")
            seconds, micros = redis_client.time()
            quiet_ms = int(seconds) * 1000 + int(micros) // 1000
            # Still paused after every worker has beaten (and looked at the queues) again at its own
            # pace since then.
            wait_until(
                lambda: (
                    len(beats := redis_client.zrange(KEYS.alive, 0, -1, withscores=True)) == 3
                    and all(score > quiet_ms + ttl / 3 * 1000 / 2 for _, score in beats)
                    and not redis_client.hlen(KEYS.working)
                ),
                ttl / 3 * 2 + 10,
                "every worker to beat again with no stage",
            )
            assert site.count("a") == fetched, "pages of a paused stage were fetched"
            assert int(redis_client.get(KEYS.in_flight) or 0) == 0
            # nothing queued lost
            assert redis_client.llen(KEYS.queue("a")) == count - len(site.hits)
            set_limit(admin_url, 3)
            codes = [worker.finish() for worker in running]
        outputs = [worker.output for worker in running]
        print(
            f"\n[figure] ttl {ttl:g} s: paused (limit 0), stage a's last request done after "
            f"{took_effect:.2f} s"
        )
        assert codes == [0, 0, 0], outputs
        assert took_effect <= min(ttl / 3, 1.0) + 2.0, took_effect
        assert sum(stat(o, "redislock/workers/a/yielded") for o in outputs) == 3
        check_every_page_once(site, count)
        assert held_slots(redis_client) == 0


# -- a SIGKILLed worker (item 3) -------------------------------------------------------------------


def inflight_paths(client: redis.Redis, worker: str) -> set[str]:
    """The pages of the requests in a worker's in-flight record (stage, newline, the request as
    JSON)."""
    paths = set()
    for value in client.hvals(KEYS.inflight(worker)):
        url = json.loads(value.split(b"\n", 1)[1])["url"]
        paths.add("/" + url.split("/", 3)[3])
    return paths


@pytest.mark.faults
@pytest.mark.parametrize("ttl", [30.0, 3.0])
def test_a_killed_workers_requests_are_fetched_again_within_seconds_not_a_ttl(
    redis_url: str, redis_client: redis.Redis, ttl: float
) -> None:
    """SIGKILL of one of 3 busy workers: the others requeue its in-flight requests once its promised
    beat is late (5 s with work, the ttl if shorter) and fetch them; before issue 26 that took the
    ttl (30 s by default)."""
    count = 1500
    with CrawlSite(delay=DELAY) as site:
        seed(redis_url, SPIDER, ["a"], {"a": pages(site, count)})
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 3},
            "REDISLOCK_TTL": ttl,
            "REDISLOCK_IDLE_CLOSE": 2,
        }
        with workers(redis_url, site, 3, settings) as running:
            wait_until(all_fetching(site, 3), 90, "3 workers fetching pages of stage a")
            victim = running[0]
            victim_id = victim.worker_id(redis_client)
            assert victim_id is not None
            victim.kill()
            killed = time.monotonic()
            victim.process.wait()
            lost = inflight_paths(redis_client, victim_id)
            assert lost, "the killed worker had nothing in flight"

            def fetched_again() -> float | None:
                with site.lock:
                    again = {
                        r.path: r.answered
                        for r in site.served
                        if r.arrived > killed and r.worker != "w0"
                    }
                return max(again[p] for p in lost) if lost <= set(again) else None

            wait_until(fetched_again, 3 * ttl, "the killed worker's requests fetched again")
            refetched_after = fetched_again() - killed  # type: ignore[operator]
            codes = [worker.finish() for worker in running[1:]]
        outputs = [worker.output for worker in running[1:]]
        print(
            f"\n[figure] ttl {ttl:g} s: SIGKILL -> the killed worker's {len(lost)} requests "
            "fetched again after "
            f"{refetched_after:.2f} s"
        )
        assert codes == [0, 0], outputs
        assert refetched_after <= min(ttl, 5.0) + 3.0, refetched_after
        assert sum(stat(o, "redislock/workers/requeued") for o in outputs) == len(lost)
        assert set(site.hits) == {f"/a/{n}" for n in range(count)}
        # at least once; twice only what it had taken
        assert sum(site.hits.values()) - count <= len(lost)


@pytest.mark.faults
def test_status_shows_killed_workers_dead_within_seconds_and_requeue_and_release_put_their_requests_back(
    redis_url: str, admin_url: str, redis_client: redis.Redis
) -> None:
    """Both workers SIGKILLed (nobody left to reap them): ``status`` shows them dead once their
    promised beat is late (5 s), not after the ttl (30 s); ``requeue`` puts one's requests back at
    once, ``release`` of the other's slot does the same for it; a new worker then finishes the
    crawl."""
    count = 600
    with CrawlSite(delay=DELAY) as site:
        seed(redis_url, SPIDER, ["a"], {"a": pages(site, count)})
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 2},
            "REDISLOCK_TTL": 30,
            "REDISLOCK_IDLE_CLOSE": 2,
        }
        with workers(redis_url, site, 2, settings) as running:
            wait_until(all_fetching(site, 2), 90, "2 workers fetching pages of stage a")
            ids = [worker.worker_id(redis_client) for worker in running]
            for worker in running:
                worker.kill()
            killed = time.monotonic()
            for worker in running:
                worker.process.wait()
            in_flight = {w: redis_client.hlen(KEYS.inflight(w)) for w in ids if w}
            assert len(in_flight) == 2 and all(in_flight.values()), in_flight

            def shown_dead() -> bool:
                (spider,) = read_all(redis_client, "redislock", 30.0)[1]
                return spider.dead == 2 and spider.alive == 0

            wait_until(shown_dead, 30, "status to show both workers dead")
            dead_after = time.monotonic() - killed
            print(
                "\n[figure] ttl 30 s: both workers SIGKILLed, shown dead by status after "
                f"{dead_after:.2f} s"
            )
            # their deadline (5 s with work), not the ttl (30 s)
            assert dead_after <= 5.0 + 2.0, dead_after
            status = json.loads(run_cli(admin_url, "status", "--json"))
            (spider,) = status["spiders"]
            assert {(w["worker"], w["alive"]) for w in spider["workers"]} == {
                (w, False) for w in in_flight
            }
            assert all(w["deadline_in"] < 0 and w["grace"] >= 5.0 for w in spider["workers"])
            text = run_cli(admin_url, "status")
            assert "0 worker(s) alive, 2 dead" in text and all(
                f"dead: {w} " in text for w in in_flight
            )

            first, second = (str(w) for w in ids)
            queued = redis_client.llen(KEYS.queue("a"))
            said = run_cli(admin_url, "requeue", first.rsplit(":", 1)[0], "--yes")  # by host:pid
            assert f"requeued {in_flight[first]} in-flight request(s) of worker {first}" in said, (
                said
            )
            assert redis_client.llen(KEYS.queue("a")) == queued + in_flight[first]
            assert (
                not redis_client.exists(KEYS.inflight(first))
                and redis_client.zscore(KEYS.alive, first) is None
            )
            said = run_cli(admin_url, "release", "workers:a", second.rsplit(":", 1)[0], "--yes")
            assert (
                "released 1 slot(s)" in said
                and f"requeued {in_flight[second]} in-flight request(s)" in said
            ), said
            assert redis_client.llen(KEYS.queue("a")) == queued + sum(in_flight.values())
            assert int(redis_client.get(KEYS.in_flight) or 0) == 0
            assert redis_client.zcard(KEYS.alive) == 0
        # the requeued requests, and the rest
        with workers(redis_url, site, 1, settings) as (last,):
            assert last.finish() == 0, last.output
        assert set(site.hits) == {f"/a/{n}" for n in range(count)}
        assert sum(site.hits.values()) - count <= sum(in_flight.values())


# -- a starved CPU (safety of the short deadline) --------------------------------------------------


def _burn(stop: Any) -> None:
    while not stop.is_set():
        for _ in range(10_000):
            pass


@pytest.mark.faults
def test_busy_workers_on_a_starved_cpu_are_not_taken_for_dead(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Two CPU burners per core while 2 workers crawl (ttl 30: 5 s deadlines with work): nobody is
    taken for dead, nothing is requeued, every page is fetched exactly once."""
    count = 400
    stop = multiprocessing.Event()
    burners = [
        multiprocessing.Process(target=_burn, args=(stop,), daemon=True)
        for _ in range(2 * os.cpu_count())
    ]
    with CrawlSite(delay=0.02) as site:
        seed(redis_url, SPIDER, ["a"], {"a": pages(site, count)})
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 2},
            "REDISLOCK_TTL": 30,
            "REDISLOCK_IDLE_CLOSE": 2,
        }
        for burner in burners:
            burner.start()
        try:
            with workers(redis_url, site, 2, settings) as running:
                codes = [worker.finish(timeout=180) for worker in running]
        finally:
            stop.set()
            for burner in burners:
                burner.join(timeout=10)
        outputs = [worker.output for worker in running]
        assert codes == [0, 0], outputs
        for output in outputs:
            assert stat(output, "redislock/workers/presumed_dead") == 0
            assert stat(output, "redislock/workers/requeued") == 0
        check_every_page_once(site, count)
        assert held_slots(redis_client) == 0


# -- what the pulses cost Redis --------------------------------------------------------------------


def command_calls(client: redis.Redis) -> dict[str, int]:
    """Commands Redis ran so far by name (INFO commandstats: scripts' own commands included), INFO
    and CONFIG RESETSTAT (the test's) excluded."""
    stats = client.info("commandstats")
    skip = ("cmdstat_info", "cmdstat_config|resetstat")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items() if k not in skip}


def cost_per_second(
    client: redis.Redis, worker: str, span: float = 20.0
) -> tuple[float, dict[str, float]]:
    """Commands per second Redis runs from just after one beat of a worker to its first beat at
    least ``span`` seconds later (whole periods of its periodic work), on Redis's own clock; the
    test's reads (one ZSCORE a poll) excluded. Also per command, per second."""
    polls = 0

    def beat() -> float:
        nonlocal polls
        polls += 1
        return float(client.zscore(KEYS.alive, worker) or 0)

    before = beat()
    while (start := beat()) == before:
        time.sleep(0.002)
    client.config_resetstat()
    polls = 0
    while (end := beat()) - start < span * 1000:
        time.sleep(0.002)
    calls = command_calls(client)
    calls["zscore"] = calls.get("zscore", 0) - polls
    seconds = (end - start) / 1000
    return sum(calls.values()) / seconds, {
        name: round(n / seconds, 2) for name, n in sorted(calls.items()) if n
    }


def test_what_an_idle_and_a_working_worker_cost_redis_per_second() -> None:
    """Periodic commands only, ttl 30: an idle worker (nothing queued: a beat, a look and a wait
    every 10 s) and a working one (a capped stage whose pages never answer: its slot's renewals, and
    its beats). Printed with -s; bounded so that a change of the periodic work shows."""
    from testing.redis_server import RedisServer

    with (
        RedisServer() as server,
        CrawlSite(delay=120) as site,
        redis.Redis(port=server.port) as client,
    ):
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 1},
            "REDISLOCK_TTL": 30,
            "REDISLOCK_IDLE_CLOSE": "None",
            "MAX_IDLE_TIME_BEFORE_CLOSE": 0,
            "DOWNLOAD_TIMEOUT": 600,
        }
        with workers(server.url, site, 1, settings) as (worker,):
            wait_until(lambda: worker.worker_id(client), 60, "the worker to register")
            worker_id = str(worker.worker_id(client))
            wait_until(
                lambda: any(c["cmd"] == "blpop" for c in client.client_list()),
                30,
                "the worker to wait for work",
            )
            idle, idle_by = cost_per_second(client, worker_id)
            seed(server.url, SPIDER, ["a"], {"a": pages(site, 10)})
            wait_until(
                lambda: site.in_flight.get("a") == CONCURRENCY,
                30,
                "the worker fetching pages that never end",
            )
            working, working_by = cost_per_second(client, worker_id)
        print(f"\n[figure] ttl 30 s: idle worker {idle:.2f} commands/s {idle_by}")
        print(f"[figure] ttl 30 s: working worker (periodic) {working:.2f} commands/s {working_by}")
        assert idle < 1.5, idle_by
        assert working < 30, working_by
