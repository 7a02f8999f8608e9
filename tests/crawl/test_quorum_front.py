"""The request front on a quorum of independent masters (REDISLOCK_URL as a list), in-process with
get_crawler and three real redis-servers: settings errors, the permit hand-off, the start with a
master down, why a stage waits, and close freeing every grant on every master. The real crawls are
in test_quorum_crawl.py."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import redis
from scrapy import Spider
from scrapy.settings import Settings
from scrapy.utils.test import get_crawler

from scrapy_redislock.cli.target import CliError, resolve_target
from scrapy_redislock.crawl.settings import read_settings
from scrapy_redislock.errors import ConfigError, InvalidArgument
from scrapy_redislock.lock.quorum import AsyncQuorumCountingLock, QuorumPermit
from scrapy_redislock.workers.mixin import StageWorkerMixin
from scrapy_redislock.workers.scheduler import StageWorkerScheduler
from testing.crawlproc import leftover
from testing.inprocess import front, request
from testing.redis_server import RedisServer
from testing.waiting import until

MASTERS = 3


def urls(servers: list[RedisServer]) -> list[str]:
    return [server.url for server in servers]


def held_on(servers: list[RedisServer]) -> list[int]:
    """Grants held on each master."""
    counts = []
    for server in servers:
        with redis.Redis(port=server.port) as client:
            counts.append(leftover(client))
    return counts


# -- settings --------------------------------------------------------------------------------------

URLS = ["redis://127.0.0.1:7001/0", "redis://127.0.0.1:7002/0", "redis://127.0.0.1:7003/0"]


def test_a_list_of_masters_is_read_with_its_quorum() -> None:
    checked = read_settings(Settings({"REDISLOCK_URL": URLS, "REDISLOCK_STAGES": {"detail": 1}}))
    assert checked.redis.masters == tuple(URLS) and checked.redis.quorum is None
    assert checked.redis.safe_url == "[" + ", ".join(URLS) + "]"
    as_json = read_settings(
        Settings({"REDISLOCK_URL": '["redis://a:1/0", "redis://b:2/0"]', "REDISLOCK_QUORUM": "2"})
    )
    # as -s gives them
    assert as_json.redis.masters == ("redis://a:1/0", "redis://b:2/0") and as_json.redis.quorum == 2
    # one master: the plain lock
    assert read_settings(Settings({"REDISLOCK_URL": URLS[:1]})).redis.masters == ()


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"REDISLOCK_QUORUM": 2, "REDISLOCK_STAGES": {"detail": 3}},
         "REDISLOCK_QUORUM = 2 is below the safe quorum 3 of stage 'detail'"),
        ({"REDISLOCK_QUORUM": 4}, "REDISLOCK_QUORUM must be an integer from 1 to 3 (the masters), "
                                  "got 4"),
        ({"REDISLOCK_QUORUM": "two"}, "REDISLOCK_QUORUM must be an integer from 1 to 3 (the "
                                      "masters), got 'two'"),
        ({"REDISLOCK_QUORUM": True}, "REDISLOCK_QUORUM must be an integer"),
        ({"REDISLOCK_URL": "redis://h:1/0", "REDISLOCK_QUORUM": 2},
         "REDISLOCK_QUORUM is set (2) but REDISLOCK_URL names one Redis"),
        ({"REDISLOCK_URL": [*URLS[:2], "redis+cluster://h1:7000,h2:7001"]}, "REDISLOCK_URL lists a "
                                                                            "Redis Cluster"),
        ({"REDISLOCK_URL": [URLS[0], URLS[0]]}, "REDISLOCK_URL lists 'redis://127.0.0.1:7001/0' "
                                                "twice"),
        ({"REDISLOCK_URL": [URLS[0], "http://x"]}, "REDISLOCK_URL is not a valid redis URL"),
        ({"REDISLOCK_URL": "[not json"}, "REDISLOCK_URL must be a redis URL or a list of them"),
        ({"REDISLOCK_URL": None, "REDIS_URL": URLS}, "REDIS_URL must be one redis URL"),
        ({"REDISLOCK_STAGE_KEY": "domain"}, "REDISLOCK_URL lists 3 masters (a quorum lock) but "
                                            "REDISLOCK_STAGE_KEY"),
        ({"REDISLOCK_DELAYS": {"detail": 1}}, "but REDISLOCK_DELAYS is set"),
    ],
)  # fmt: skip
def test_bad_quorum_settings_name_the_setting_and_the_value(
    settings: dict[str, Any], says: str
) -> None:
    merged = {"REDISLOCK_URL": URLS, "REDISLOCK_STAGES": {"detail": 1}, **settings}
    with pytest.raises(ConfigError) as caught:
        read_settings(Settings({k: v for k, v in merged.items() if v is not None}))
    assert says in str(caught.value), str(caught.value)


class WorkerSpider(StageWorkerMixin, Spider):
    name = "workers"
    worker_stages = {"detail": 1}


def test_the_worker_front_refuses_a_list_of_masters() -> None:
    crawler = get_crawler(WorkerSpider, {"REDISLOCK_URL": URLS})
    with pytest.raises(
        ConfigError, match=r"the worker front needs one Redis \(its queues live there\); a list of"
    ):
        StageWorkerScheduler(crawler)


# -- in-process, on three real masters -------------------------------------------------------------


@pytest.mark.integration
def test_quorum_permits_flow_through_the_hand_off_and_close_frees_every_master(
    masters: list[RedisServer],
) -> None:
    """L=2 over 3 masters (safe quorum 3): a stage lock is a quorum lock; its permit is handed,
    taken, passed on to a queued request locally (no Redis command) and released; close frees every
    grant on every master."""

    async def scenario() -> None:
        # the local hand-off of a slot younger than REDISLOCK_LOCAL_REUSE: 2 s, not the default
        # 0.25, so that a loaded machine's slow steps below do not age the permit out of it
        async with front(urls(masters), {"detail": 2}, REDISLOCK_LOCAL_REUSE=2.0) as f:
            lock = f.locks.locks["detail"]
            assert isinstance(lock, AsyncQuorumCountingLock) and lock.quorum == 3
            with pytest.raises(InvalidArgument, match="its quorum depends on the limit"):
                await lock.set_limit(1)  # q=3 was computed for L=2
            assert f.scheduler is not None
            for n in range(3):
                f.scheduler.enqueue_request(request("detail", n))
            first = await f.next_request()  # with a slot the stage's wait got in the scheduler
            await f.send(first)
            permit = f.slots.take(first)
            assert isinstance(permit, QuorumPermit) and len(permit.grants) == 3
            second = await f.next_request()
            await f.send(second)
            await until(lambda: held_on(masters) == [2, 2, 2])
            f.middleware.process_response(first, None)  # type: ignore[arg-type]
            third = f.scheduler.next_request()  # the freed slot passed on locally, in the same call
            assert third is not None and f.slots.take(third) is permit
            assert f.crawler.stats.get_value("redislock/detail/reused") == 1
            assert held_on(masters) == [2, 2, 2]
            f.middleware.process_response(second, None)  # type: ignore[arg-type]
            await until(lambda: held_on(masters) == [1, 1, 1])
            # a renewal tick (ttl 3: every second) renews the quorum permit
            await asyncio.sleep(1.2)
            assert not permit.lost
        assert held_on(masters) == [0, 0, 0]

    asyncio.run(scenario())


@pytest.mark.integration
def test_the_start_needs_a_quorum_of_masters_and_names_those_that_do_not_answer(
    masters: list[RedisServer], caplog: pytest.LogCaptureFixture, dead_url: Callable[[], str]
) -> None:
    """L=1 over 3 masters (q=2): one master unreachable, the front starts and says which; two, it
    cannot start."""
    dead = dead_url()

    async def scenario() -> None:
        async with front([*urls(masters[:2]), dead], {"detail": 1}, scheduler=False) as f:
            permit = await f.locks.acquire("detail", 5)
            assert isinstance(permit, QuorumPermit) and sorted(permit.grants) == [0, 1]
            await f.locks.release(permit)

    with caplog.at_level(logging.WARNING):
        asyncio.run(scenario())
    assert (
        f"Quorum lock: 2 of 3 masters answer, 2 needed; not answering: master 2 ({dead}): "
        in caplog.text
    )
    assert held_on(masters[:2]) == [0, 0]

    async def too_few() -> None:
        crawler_urls = [masters[0].url, dead, dead_url()]
        with pytest.raises(AssertionError):
            async with front(
                crawler_urls, {"detail": 1}, scheduler=False, REDISLOCK_CONNECT_TIMEOUT=1
            ):
                pass

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        asyncio.run(too_few())
    assert "1 of 3 masters answer, 2 needed; master 1 (" in caplog.text
    assert "Cannot reach Redis at [redis://127.0.0.1:" in caplog.text


@pytest.mark.integration
def test_why_a_quorum_stage_waits_is_said_per_master(masters: list[RedisServer]) -> None:
    """L=1 over 3 masters, the slot held: the report names each master's holder, or that it is
    unreachable."""

    async def scenario() -> None:
        async with front(urls(masters), {"detail": 1}, scheduler=False) as f:
            assert not await f.locks.reports.why("detail")
            permit = await f.locks.acquire("detail", 5)
            reason = await f.locks.reports.why("detail")
            why = str(reason)
            assert why.startswith(
                "0 of 3 masters have a free slot, 2 needed; master 0 (redis://"
            ), why
            assert why.count("all 1 slots held: 1 by ") == 3, why
            assert reason.calm  # held by a live holder on every master: said at INFO
            masters[2].kill()
            reason = await f.locks.reports.why("detail")
            why = str(reason)
            assert "master 2 (" in why and "unreachable" in why, why
            assert not reason.calm  # a master unreachable: a warning
            await f.locks.release(permit)
            reason = await f.locks.reports.why("detail")
            assert not reason and reason.kind == "free"  # two masters free: a quorum

    try:
        asyncio.run(scenario())
    finally:
        masters[2].start()


def test_the_command_line_refuses_a_list_of_masters_clearly() -> None:
    """status / set-limit / release / reset work on one Redis: a list from the settings or the
    environment is refused with exit status 2 and what to do; --url of one master still works."""
    no_url = argparse.Namespace(url=None, prefix=None)
    for settings, env in (
        (Settings({"REDISLOCK_URL": URLS}), {}),
        (None, {"REDISLOCK_URL": json.dumps(URLS)}),
    ):
        with pytest.raises(CliError) as caught:
            resolve_target(no_url, env, settings)
        assert caught.value.code == 2
        assert "(a quorum lock): the command line works on one Redis at a time; give --url" in str(
            caught.value
        )
    one = resolve_target(
        argparse.Namespace(url=URLS[1], prefix=None), {}, Settings({"REDISLOCK_URL": URLS})
    )
    assert one.url == URLS[1]
    done = subprocess.run(
        [sys.executable, "-m", "scrapy_redislock", "status"],
        env={**os.environ, "REDISLOCK_URL": json.dumps(URLS)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "lists several masters (a quorum lock)" in done.stderr, (
        done.stderr
    )
