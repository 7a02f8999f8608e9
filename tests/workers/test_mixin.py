"""Worker slots per stage: real ``scrapy crawl`` / ``scrapy runspider`` workers against a real Redis
and a local site.

The acceptance scenario (the scaled-down use case) runs through the example project's runner, which
watches Redis and the shop site from outside while five workers crawl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
import scrapy
from scrapy.settings import Settings
from scrapy.utils.test import get_crawler

from example_project.run import CAPS, Phase, arguments, run_phase
from scrapy_redislock.crawl import requestformat
from scrapy_redislock.errors import ConfigError
from scrapy_redislock.workers.queue import StageQueues
from scrapy_redislock.workers.scheduler import StageWorkerScheduler
from testing.crawlproc import settings_args, staged_worker
from testing.site import CrawlSite, ShopSite
from testing.spiders.workerspider import StagedSpider
from testing.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "example_project"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

crawl = [pytest.mark.integration, pytest.mark.crawl]


def demo_args(output: Path, *extra: str) -> argparse.Namespace:
    """The example's arguments; its feeds and logs go to ``output``, one directory per test (two
    crawls sharing the example's output directory would overwrite each other's feeds)."""
    fixed = ["--workers", "5", "--concurrency", "2", "--quiet", "--timeout", "150"]
    return arguments([*fixed, "--output", str(output), *extra])


def finish(process: subprocess.Popen[str], timeout: float = 60) -> str:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output[-3000:]
    return output


def stat(output: str, name: str) -> int:
    found = re.search(rf"'{re.escape(name)}': (\d+)", output)
    return int(found.group(1)) if found else 0


def seed(redis_url: str, spider: str, stages: list[str], plan: dict[str, list[str]]) -> None:
    """Put requests straight into the stage queues in Redis, as other workers would have."""

    async def push() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        queues = StageQueues(client, spider, stages, worker="seeder")
        for stage, urls in plan.items():
            for url in urls:
                request = scrapy.Request(url, meta={"redislock_stage": stage})
                await queues.push(stage, "", requestformat.dumps(request.to_dict()))
        await client.aclose()

    asyncio.run(push())


def diagnosis(site: ShopSite, phase: Phase, output: Path) -> str:
    """What a crawl that missed pages leaves to go on: which, what was left in Redis, and what the
    workers warned of."""
    missing = sorted(site.expected_paths() - set(site.hits))
    warned = [
        f"{log.name}: {line}"
        for log in sorted(output.glob("*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if " WARNING: " in line
        or " ERROR: " in line
        or re.search(r"'redislock/workers/(requeued|reclaimed|redis_errors|unqueueable)", line)
    ]
    return "\n".join(
        [f"missing {len(missing)}: {missing[:20]}", f"left in Redis: {phase.leftover}", *warned]
    )


def held_slots(client: redis.Redis) -> int:
    total = 0
    for key in client.scan_iter("redislock:{workers:*}:slots"):
        total += int(client.xpending(key, "holders")["pending"])
    return total


# -- the acceptance scenario -----------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.crawl
def test_acceptance_caps_hold_every_page_once_workers_exit_0_nothing_left(
    redis_url: str, admin_url: str, tmp_path: Path
) -> None:
    """10 list pages x 20 details x 5 comment pages, 30 ms pages, 5 workers, caps 1/3/None."""
    with ShopSite(lists=10, details=20, comments=5, delay=0.03) as site:
        args = demo_args(tmp_path, "--ttl", "3", "--idle-close", "1.5")
        phase = run_phase("slots", "shop", admin_url, site, args, worker_url=redis_url)
        assert phase.exit_codes == [0] * 5
        for stage, cap in CAPS.items():
            if cap is None:
                continue
            # From Redis (the slot holders and what each worker reports, sampled) and from the site
            # (which workers had requests of the stage in flight at the same moment, exactly).
            assert 1 <= phase.max_workers_redis[stage] <= cap, phase.max_workers_redis
            assert 1 <= phase.max_workers_site[stage] <= cap, phase.max_workers_site
            assert phase.max_in_flight[stage] <= cap * 2, phase.max_in_flight
        assert phase.max_workers_site["detail"] >= 2, "the detail cap of 3 was never used"
        assert phase.max_workers_site["comments"] >= 2
        # Every page exactly once, every item once.
        assert set(site.hits) == site.expected_paths(), diagnosis(site, phase, tmp_path)
        assert sorted(set(site.hits.values())) == [1]
        assert phase.items == site.totals
        assert not any(phase.leftover.values()), phase.leftover
        # All three kinds of data flow from the start: the first comment comes with most details still
        # to come (an order, not a speed: a loaded machine stretches the start-up, not the order).
        # Plain scrapy-redis goes through the stages in order and leaves none.
        first_comment = phase.first_item["comments"]
        details_after = sum(t > first_comment for t in phase.timeline["detail"])
        assert details_after > len(phase.timeline["detail"]) / 3, (first_comment, phase.timeline)


@pytest.mark.integration
@pytest.mark.crawl
@pytest.mark.faults
def test_kill_9_a_detail_worker_slot_taken_over_within_ttl_plus_2_and_crawl_completes(
    redis_url: str, admin_url: str, tmp_path: Path
) -> None:
    ttl = 2.0
    with ShopSite(lists=6, details=40, comments=2, delay=0.1) as site:
        args = demo_args(
            tmp_path, "--ttl", str(ttl), "--idle-close", "1.5", "--kill-one-after", "0.8"
        )
        phase: Phase = run_phase("kill", "shop", admin_url, site, args, worker_url=redis_url)
        assert phase.victim is not None, "no worker held a detail slot to kill"
        assert phase.taken_over_after is not None, "the killed worker's slot never came back"
        assert phase.taken_over_by == "live worker", (
            "the detail work ran out before the takeover could be seen"
        )
        assert phase.taken_over_after <= ttl + 2, phase.taken_over_after
        assert phase.exit_codes.count(-signal.SIGKILL) == 1
        assert sorted(c for c in phase.exit_codes if c != -signal.SIGKILL) == [0] * 4
        # The crawl completed: every page fetched; the dead worker's popped requests were put back
        # and fetched again by the others: what it had taken (up to twice CONCURRENT_REQUESTS) and
        # finished ones whose acknowledgement had not reached Redis (on a starved CPU, a few more).
        assert set(site.hits) == site.expected_paths()
        logs = "".join(log.read_text() for log in tmp_path.glob("*.log"))
        put_back = sum(map(int, re.findall(r"put (\d+) of its requests back", logs)))
        assert phase.duplicates <= put_back, (phase.duplicates, put_back)
        assert phase.max_workers_site["detail"] <= 3 and phase.max_workers_site["list"] <= 1
        assert not any(phase.leftover.values()), phase.leftover


# -- switching stages, preference, a plain scrapy.Spider -------------------------------------------


@pytest.mark.integration
@pytest.mark.crawl
@pytest.mark.parametrize("preference", [["b", "a"], ["a", "b"]])
def test_a_lone_worker_takes_stages_in_preference_order_and_switches_when_one_runs_dry(
    redis_url: str, redis_client: redis.Redis, preference: list[str]
) -> None:
    with CrawlSite(delay=0.02) as site:
        seed(
            redis_url,
            "staged",
            ["a", "b"],
            {s: [f"{site.url}/{s}/{n}" for n in range(8)] for s in "ab"},
        )
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 1, "b": 1},
            "REDISLOCK_STAGE_PREFERENCE": preference,
        }
        output = finish(staged_worker(redis_url, site.url, "", settings))
        first, second = preference
        assert len(site.arrivals[first]) == len(site.arrivals[second]) == 8
        assert max(site.arrivals[first]) < min(site.arrivals[second]), "stages were mixed"
        assert stat(output, f"redislock/workers/{first}/taken") == 1
        assert stat(output, f"redislock/workers/{second}/taken") == 1
        assert f"left stage '{first}'" in output
        assert held_slots(redis_client) == 0


@pytest.mark.integration
@pytest.mark.crawl
def test_plain_spiders_share_the_work_through_the_dupefilter_and_respect_the_caps(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Three plain scrapy.Spider workers all yield the same start requests; each page is fetched
    once."""
    with CrawlSite(delay=0.03) as site:
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 1, "b": 2, "c": None},
            "REDISLOCK_IDLE_CLOSE": 1.5,
            # a worker that a loaded machine starts after the others have finished still finds their
            # dupefilter (with scrapy-redis's default, False, the last one out had cleared it, and
            # the late worker fetched every page again)
            "SCHEDULER_PERSIST": True,
        }
        workers = [staged_worker(redis_url, site.url, "a:10,b:20,c:30", settings) for _ in range(3)]
        outputs = [finish(w) for w in workers]
        assert sorted(site.hits.values()) == [1] * 60
        assert site.max_in_flight["a"] <= 1 * 2 and site.max_in_flight["b"] <= 2 * 2
        # one copy of each got in
        assert sum(stat(o, "redislock/workers/a/enqueued") for o in outputs) == 10
        assert sum(stat(o, "redislock/workers/a/duplicates") for o in outputs) == 20
        assert held_slots(redis_client) == 0


@pytest.mark.integration
@pytest.mark.crawl
def test_scheduler_persist_false_one_workers_close_keeps_the_others_queues(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """scrapy-redis deletes the shared queue and dupefilter when any worker closes; here the last
    one out does."""
    with CrawlSite(delay=0.1) as site:
        settings = {"REDISLOCK_WORKER_STAGES": {"a": None}, "SCHEDULER_PERSIST": False}
        seed(redis_url, "staged", ["a"], {"a": [f"{site.url}/a/{n}" for n in range(80)]})
        # Started together, so that a loaded machine slows both start-ups alike: the staying worker
        # needs 8 s for the 80 pages, the early one a few pages' time after its start-up.
        stayer = staged_worker(redis_url, site.url, "", {**settings, "CONCURRENT_REQUESTS": 1})
        early = staged_worker(redis_url, site.url, "", {**settings, "CLOSESPIDER_PAGECOUNT": 3})
        early_output = finish(early)
        assert "closespider_pagecount" in early_output
        assert "cleared the queues" not in early_output
        assert redis_client.llen("redislock:{staged}:queue:a") > 0, (
            "the early worker's close deleted the queue"
        )
        finish(stayer)
        assert sorted(site.hits.values()) == [1] * 80
        # the last worker out cleared the crawl state
        assert redis_client.keys("redislock:{staged}:*") == []


# -- scrapy-redis on Scrapy 2.19: start URLs, idling, the reactor thread ---------------------------


def shop_worker(spider: str, redis_url: str, audit: Path, **settings: Any) -> subprocess.Popen[str]:
    """A `scrapy crawl` worker of the example project, with the reactor-thread audit."""
    merged = {
        "REDIS_URL": redis_url,
        "EXTENSIONS": {"testing.spiders.reactoraudit.ReactorThreadAudit": 0},
        "REACTOR_AUDIT_FILE": str(audit),
        **settings,
    }
    command = [sys.executable, "-m", "scrapy", "crawl", spider, *settings_args(merged)]
    return subprocess.Popen(
        command, cwd=EXAMPLE, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.fixture
def small_shop() -> Iterator[ShopSite]:
    with ShopSite(lists=2, details=3, comments=1, delay=0.01) as site:
        yield site


@pytest.mark.integration
@pytest.mark.crawl
def test_an_idle_worker_takes_start_urls_pushed_later_at_once_without_blocking_the_reactor(
    redis_url: str, redis_client: redis.Redis, small_shop: ShopSite, tmp_path: Path
) -> None:
    """Idles like a RedisSpider (REDISLOCK_IDLE_CLOSE None: never closes by itself), but reads start
    URLs with redis.asyncio as they come, not at the next idle signal (the engine's 5 s heartbeat
    when idle)."""
    redis_client.flushdb()
    audit = tmp_path / "audit.json"
    worker = shop_worker(
        "shop", redis_url, audit, REDISLOCK_IDLE_CLOSE="None", MAX_IDLE_TIME_BEFORE_CLOSE=0
    )
    try:
        wait_until(lambda: redis_client.zcard("redislock:{shop}:alive"), 60, "the worker to open")
        time.sleep(1.0)  # idle
        assert worker.poll() is None and not small_shop.hits
        for i in range(2):
            pages = sum(small_shop.hits.values())
            redis_client.rpush("shop:start_urls", json.dumps({"url": small_shop.list_urls()[i]}))
            latency = wait_until(lambda i=i: f"/list/{i}" in small_shop.hits, 10, f"list page {i}")
            assert latency < 1.0, f"start URL {i} waited {latency:.2f} s"
            wait_until(
                lambda p=pages: sum(small_shop.hits.values()) == p + 1 + 3 + 3,
                10,
                "the list's pages",
            )
            time.sleep(2.5 if i == 0 else 0)  # longer than scrapy-redis's idle timeouts: still open
            assert worker.poll() is None
    finally:
        worker.send_signal(signal.SIGINT)  # Ctrl-C: a graceful close
    output, _ = worker.communicate(timeout=30)
    assert worker.returncode == 0, output[-3000:]
    assert set(small_shop.hits) == small_shop.expected_paths()
    assert held_slots(redis_client) == 0 and redis_client.zcard("redislock:{shop}:alive") == 0
    assert json.loads(audit.read_text())["blocking_calls"] == 0


@pytest.mark.integration
@pytest.mark.crawl
def test_control_plain_scrapy_redis_does_block_the_reactor(
    admin_url: str, redis_client: redis.Redis, small_shop: ShopSite, tmp_path: Path
) -> None:
    """The audit of the test above does see blocking calls: plain scrapy-redis makes them on every
    idle signal."""
    redis_client.flushdb()
    audit = tmp_path / "audit.json"
    redis_client.rpush("shop_baseline:start_urls", json.dumps({"url": small_shop.list_urls()[0]}))
    # plain scrapy-redis
    worker = shop_worker("shop_baseline", admin_url, audit, MAX_IDLE_TIME_BEFORE_CLOSE=1)
    output, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0, output[-3000:]
    assert len(small_shop.hits) == 1 + 3 + 3
    calls = json.loads(audit.read_text())
    assert calls["blocking_calls"] > 0, calls


# -- faults and configuration ----------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.crawl
@pytest.mark.faults
def test_a_worker_that_loses_its_slot_gives_its_unstarted_requests_back(
    redis_url: str, admin_url: str, redis_client: redis.Redis
) -> None:
    """An operator's reset of the stage lock: the holder finds its lease lost at the next renewal,
    stops taking requests of that stage, hands back what it had taken ahead, and takes a slot again;
    nothing is fetched twice."""
    # 10 s of pages: work is left after the reset command's start-up (seconds on a loaded machine)
    with CrawlSite(delay=0.2) as site:
        seed(redis_url, "staged", ["a"], {"a": [f"{site.url}/a/{n}" for n in range(100)]})
        worker = staged_worker(
            redis_url, site.url, "", {"REDISLOCK_WORKER_STAGES": {"a": 1}, "REDISLOCK_TTL": 1.5}
        )
        wait_until(lambda: len(site.hits) >= 4, 60, "the crawl to start")
        reset = subprocess.run(
            [
                sys.executable,
                "-m",
                "scrapy_redislock",
                "reset",
                "workers:a",
                "--force",  # its holder is alive: that is the point
                "--yes",
                "--url",
                admin_url,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert reset.returncode == 0, reset.stderr
        assert len(site.hits) < 100, "the crawl ended before the reset"
        output = finish(worker)
        assert "lost its slot of stage 'a'" in output
        assert stat(output, "redislock/workers/a/taken") >= 2
        twice = sorted(path for path, hits in site.hits.items() if hits > 1)
        assert not twice, (twice, stat(output, "redislock/workers/presumed_dead"), output[-3000:])
        assert len(site.hits) == 100
        assert held_slots(redis_client) == 0


class NoStages(StagedSpider):
    name = "nostages"


class BadPreference(StagedSpider):
    name = "badpreference"
    worker_stages = {"a": 1}
    stage_preference = ["a", "z"]


class BadCap(StagedSpider):
    name = "badcap"
    worker_stages = {"a": -1}


@pytest.mark.parametrize(
    ("spidercls", "settings", "message"),
    [
        (NoStages, {}, "needs worker_stages"),
        (BadPreference, {}, "REDISLOCK_STAGE_PREFERENCE names unknown stages ['z']"),
        (BadCap, {}, "REDISLOCK_WORKER_STAGES['a'] must be an integer from 0 to 1000 or None"),
        (
            NoStages,
            {"REDISLOCK_WORKER_STAGES": {"a": 1}, "REDISLOCK_IDLE_CLOSE": "soon"},
            "REDISLOCK_IDLE_CLOSE",
        ),
        (
            NoStages,
            {"REDISLOCK_WORKER_STAGES": {"a": 1}, "MAX_IDLE_TIME_BEFORE_CLOSE": "x"},
            "MAX_IDLE_TIME",
        ),
        (
            NoStages,
            {"REDISLOCK_WORKER_STAGES": {"a": 1}, "SCHEDULER_QUEUE_CLASS": "x.Y"},
            "QUEUE_CLASS = 'x.Y'",
        ),
    ],
)
def test_bad_configuration_is_refused_with_the_setting_named(
    spidercls: type[scrapy.Spider], settings: dict[str, Any], message: str
) -> None:
    crawler = get_crawler(spidercls, settings)
    with pytest.raises(ConfigError) as error:
        StageWorkerScheduler.from_crawler(crawler)
    assert message in str(error.value)


def test_the_mixin_sets_the_scheduler_and_its_attributes_are_settings_the_command_line_overrides() -> (
    None
):
    crawler = get_crawler(BadPreference, {"SCHEDULER": "scrapy.core.scheduler.Scheduler"})
    assert crawler.settings["SCHEDULER"] == "scrapy_redislock.StageWorkerScheduler"
    assert crawler.settings.getdict("REDISLOCK_WORKER_STAGES") == {"a": 1}
    assert crawler.settings.getlist("REDISLOCK_STAGE_PREFERENCE") == ["a", "z"]
    settings = Settings()
    settings.set("REDISLOCK_WORKER_STAGES", {"a": 3}, priority="cmdline")  # scrapy crawl -s ...
    BadPreference.update_settings(settings)
    assert settings.getdict("REDISLOCK_WORKER_STAGES") == {"a": 3}


@pytest.mark.integration
@pytest.mark.crawl
def test_without_the_asyncio_reactor_the_worker_refuses_to_start(redis_url: str) -> None:
    with CrawlSite(delay=0) as site:
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 1},
            "TWISTED_REACTOR": "twisted.internet.epollreactor.EPollReactor",
        }
        worker = staged_worker(redis_url, site.url, "a:3", settings)
        output, _ = worker.communicate(timeout=60)
        assert worker.returncode != 0
        assert "StageWorkerMixin needs asyncio" in output
        assert not site.hits


@pytest.mark.integration
@pytest.mark.crawl
@pytest.mark.faults
def test_a_stalled_worker_is_taken_for_dead_then_goes_on(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """SIGSTOP for longer than the TTL: the other worker requeues the stalled one's requests and
    uses its slot; on SIGCONT the stalled worker learns it was taken for dead, drops what it had
    taken ahead and carries on."""
    with CrawlSite(delay=0.05) as site:
        seed(redis_url, "staged", ["a"], {"a": [f"{site.url}/a/{n}" for n in range(120)]})
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 2},
            "REDISLOCK_TTL": 1.5,
            "REDISLOCK_IDLE_CLOSE": 2,
        }
        workers = [staged_worker(redis_url, site.url, "", settings) for _ in range(2)]

        def both_working() -> bool:
            # both registered and holding requests (on a starved machine one may still be starting
            # when 20 pages are done: stopped then, it has nothing to be taken for dead with)
            alive = redis_client.zrange("redislock:{staged}:alive", 0, -1)
            return len(alive) == 2 and all(
                redis_client.exists(f"redislock:{{staged}}:inflight:{name.decode()}")
                for name in alive
            )

        wait_until(lambda: len(site.hits) >= 20 and both_working(), 60, "both workers to work")
        workers[0].send_signal(signal.SIGSTOP)
        time.sleep(1.5 + 1.5)
        workers[0].send_signal(signal.SIGCONT)
        stalled, other = (finish(w) for w in workers)
        assert "taken for dead" in stalled
        assert stat(other, "redislock/workers/requeued") >= 1
        assert set(site.hits) == {f"/a/{n}" for n in range(120)}
        # Fetched twice: exactly what the stalled worker had started (downloads, responses waiting
        # for their callback, finished requests not yet acknowledged: under a starved CPU, more
        # than CONCURRENT_REQUESTS); what it had only taken ahead it dropped. On a starved CPU a
        # worker may also miss its TTL on its own, at the same cost: counted from both logs. And
        # at most once more each download the stall held past its slot's lease: its timeout (the
        # lease as last confirmed) fired first on waking, and RetryMiddleware sent it again. That
        # one is a third fetch only if the first attempt reached the site before the stop; one
        # still connecting (a loaded CI machine) never did, and its retry is its first hit.
        requeued = stat(stalled, "redislock/workers/requeued") + stat(
            other, "redislock/workers/requeued"
        )
        dropped = sum(map(int, re.findall(r"dropped (\d+) requests taken ahead", stalled + other)))
        retried = stat(stalled, "retry/count") + stat(other, "retry/count")
        warnings = [line for line in (stalled + other).splitlines() if "WARNING" in line]
        twice = requeued - dropped
        assert twice <= sum(site.hits.values()) - 120 <= twice + retried, warnings
        assert site.max_in_flight["a"] <= 2 * 2 + 2
        assert held_slots(redis_client) == 0 and redis_client.zcard("redislock:{staged}:alive") == 0


def answered(site: CrawlSite, path: str) -> int:
    """Requests for ``path`` the site answered in full."""
    with site.lock:
        return sum(1 for record in site.served if record.path.startswith(path))


@pytest.mark.integration
@pytest.mark.crawl
@pytest.mark.faults
def test_a_request_with_no_stage_survives_a_sigkill_of_the_worker_that_yielded_it(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Issue 39 (f08): a request that names no stage is fetched by the worker whose callback yielded
    it, but it is in Redis with its fingerprint (that worker's in-flight record). SIGKILLed while
    fetching it, its worker loses nothing: the next worker gives it back to its home stage's queue
    and fetches it. Before the fix its fingerprint was in the shared dupefilter, the request only
    in the dead worker's memory, its parent acknowledged: nobody fetched it again."""
    with CrawlSite(delay=0.05) as site:
        # a lease longer than the 4 s page: a capped download is cut where its slot's lease ends
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 1},
            "REDISLOCK_IDLE_CLOSE": 2,
            "REDISLOCK_TTL": 6,
        }
        args = {"unstaged": "/other/1?sleep=4"}
        first = staged_worker(redis_url, site.url, "a:1", settings, args)
        wait_until(lambda: site.hits["/other/1"] >= 1, 60, "the request with no stage to start")
        first.kill()
        first.communicate()
        assert site.hits["/a/0"] == 1 and not answered(site, "/other/1")
        # its fingerprint is in the shared dupefilter, the request in the dead worker's record
        records = list(redis_client.scan_iter("redislock:{staged}:inflight:*"))
        assert [redis_client.hlen(record) for record in records] == [1], "not in Redis"
        second = staged_worker(redis_url, site.url, "a:1", settings, args)
        output = finish(second, timeout=90)
        assert stat(output, "redislock/workers/requeued") == 1
        assert site.hits["/a/0"] == 1  # the parent: acknowledged, filtered as a duplicate
        assert site.hits["/other/1"] == 2  # fetched again by the second worker
        assert redis_client.keys("redislock:{staged}:inflight*") == []
        assert held_slots(redis_client) == 0


@pytest.mark.integration
@pytest.mark.crawl
@pytest.mark.faults
def test_requests_popped_by_a_call_whose_reply_was_lost_go_back_at_the_next_beat(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A failover after the pop script ran (or a cluster client running it again) leaves requests in
    a worker's in-flight record that it never received. Here the test runs that pop itself for the
    live worker and drops the reply: the worker's next beat finds more in its record than it knows
    of and gives those back; every page is fetched exactly once and the worker exits."""
    with CrawlSite(delay=0.05) as site:
        seed(redis_url, "staged", ["a"], {"a": [f"{site.url}/a/{n}" for n in range(120)]})
        settings = {
            "REDISLOCK_WORKER_STAGES": {"a": 1},
            "REDISLOCK_TTL": 1.5,
            "REDISLOCK_IDLE_CLOSE": 2,
        }
        worker = staged_worker(redis_url, site.url, "", settings)
        wait_until(lambda: len(site.hits) >= 10, 60, "the crawl to start")
        (worker_id,) = [w.decode() for w in redis_client.zrange("redislock:{staged}:alive", 0, -1)]

        async def lost_pop() -> int:
            client = redis.asyncio.Redis.from_url(redis_url)
            popped = await StageQueues(client, "staged", ["a"], worker=worker_id).pop("a", 5)
            await client.aclose()
            return len(popped or [])

        assert asyncio.run(lost_pop()) == 5
        output = finish(worker)
        assert "popped by a call whose reply was lost" in output
        assert stat(output, "redislock/workers/reclaimed") == 5
        assert set(site.hits) == {f"/a/{n}" for n in range(120)} and set(site.hits.values()) == {1}
        assert redis_client.keys("redislock:{staged}:inflight*") == []


@pytest.mark.integration
@pytest.mark.crawl
def test_a_start_url_entry_that_makes_no_request_costs_itself_not_its_batch(
    redis_url: str, redis_client: redis.Redis, small_shop: ShopSite, tmp_path: Path
) -> None:
    """Three entries of the start-URL feed, read in one batch, the second a URL with no scheme: the
    two good ones are crawled, the bad one is said at ERROR with the entry, counted, and the crawl
    does not finish cleanly (exit status 1). The spider's make_request_from_data raised for the
    whole batch: all three were lost, with a traceback only."""
    redis_client.flushdb()
    bad = json.dumps({"url": "shop.test/list/9"})
    good = [json.dumps({"url": url}) for url in small_shop.list_urls()]
    redis_client.rpush("shop:start_urls", good[0], bad, good[1])
    worker = shop_worker("shop", redis_url, tmp_path / "audit.json", REDISLOCK_IDLE_CLOSE=1)
    output, _ = worker.communicate(timeout=60)
    assert set(small_shop.hits) == small_shop.expected_paths(), output[-3000:]
    assert f"Start URL entry {bad.encode()!r} from shop:start_urls made no request" in output
    assert "'redislock/workers/start_urls_unusable': 1" in output
    assert "'finish_reason': 'redislock_start_urls_lost'" in output
    assert worker.returncode == 1
