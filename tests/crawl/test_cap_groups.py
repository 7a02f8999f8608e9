"""Caps belong to their spider (REDISLOCK_GROUP): real crawls of two spiders with the same stage
names side by side against one site and one redis-server, on both fronts. By default each keeps its
own cap; with one group named in both, they share one cap, and the process whose limit was
overwritten says so in its log. The site counts what is in flight (request front: spider ``plan``
fetches ``/shopfull/...``, spider ``othershop`` ``/othershop/...``; worker front: spider ``staged``
``/detail/...``, spider ``otherstaged`` ``/other/detail/...``)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import redis

from scrapy_redislock._redis import text
from scrapy_redislock.lock.permit import LockKeys, group_prefix
from scrapy_redislock.workers.queue import QueueKeys
from testing.crawlproc import ROOT, Crawl, leftover, staged_worker
from testing.site import CrawlSite, most_at_once, served

pytestmark = [pytest.mark.integration, pytest.mark.crawl]
OTHER_SHOP = ROOT / "testing" / "spiders" / "othershopspider.py"
OTHER_WORKER = ROOT / "testing" / "spiders" / "otherworkerspider.py"
# the first spider has more pages than it can fetch while the second runs (at most 10 s); it is
# stopped (SIGTERM: a graceful close) once the second is done, so that the two overlap on any machine
FIRST_PAGES = 400


def shop_settings(redis_url: str, limit: int, **extra: Any) -> dict[str, Any]:
    # REDISLOCK_GROUP None: left out, the default (the spider's name), not the harness's ''
    return {
        "REDISLOCK_URL": redis_url,
        "REDISLOCK_STAGES": {"detail": limit},
        "CONCURRENT_REQUESTS": 16,
        "REDISLOCK_GROUP": None,
        **extra,
    }


def limit_in_redis(client: redis.Redis, group: str, stage: str) -> int | None:
    value = client.hget(LockKeys.of(group_prefix("redislock", group), stage).meta, "limit")
    return None if value is None else int(text(value))


def side_by_side(
    site: CrawlSite, redis_url: str, tmp_path: Path, **extra: Any
) -> tuple[Crawl, Crawl]:
    """Spider ``plan`` (detail = 3) crawling, then spider ``othershop`` (detail = 10) started
    beside it once the first has requests in flight."""
    first = Crawl(
        site.url, f"detail@shopfull:{FIRST_PAGES}", shop_settings(redis_url, 3, **extra), tmp_path
    ).start()
    assert site.wait_for(lambda: site.in_flight["shopfull"] > 0, timeout=60), first.tail()
    second = Crawl(
        site.url,
        "detail@othershop:80",
        shop_settings(redis_url, 10, **extra),
        tmp_path,
        spider=OTHER_SHOP,
    ).start()
    return first, second


def stop(first: Crawl, second: Crawl) -> None:
    """The second crawls to its end; the first, still crawling, is then closed gracefully."""
    second.wait(timeout=120)
    assert first.code is None, first.tail()  # it was still running
    first.signal(signal.SIGTERM)
    first.wait(timeout=120)
    assert second.code == 0 and second.stats["finish_reason"] == "finished", second.tail()
    assert first.code == 0 and first.stats["finish_reason"] == "shutdown", first.tail()


def test_two_spiders_with_the_same_stage_names_keep_their_own_caps(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    with CrawlSite(delay=0.25) as site:
        first, second = side_by_side(site, redis_url, tmp_path)
        stop(first, second)
        shopfull, othershop = served(site, "shopfull"), served(site, "othershop")
    assert len(othershop) == 80
    # they ran side by side: the first was fetching before and after the second's pages
    assert min(r.arrived for r in shopfull) < min(r.arrived for r in othershop)
    assert max(r.answered for r in shopfull) > max(r.answered for r in othershop)
    assert most_at_once(shopfull, 3) == (3, 0.0)  # its own cap, while the other ran at 10
    most_other, above = most_at_once(othershop, 10)
    assert 3 < most_other <= 10 and above == 0.0
    assert limit_in_redis(redis_client, "plan", "detail") == 3
    assert limit_in_redis(redis_client, "othershop", "detail") == 10
    assert limit_in_redis(redis_client, "", "detail") is None  # nothing under the 0.x names
    assert "changed in Redis" not in first.output + second.output
    assert "group 'plan'" in first.output and "group 'othershop'" in second.output
    assert leftover(redis_client) == 0


def test_one_group_named_by_both_spiders_shares_one_cap_and_both_say_the_change(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    with CrawlSite(delay=0.25) as site:
        first, second = side_by_side(site, redis_url, tmp_path, REDISLOCK_GROUP="shops")
        # the first process hears of the other's limit at its next renewal (it waits: it renews
        # every ttl/3 = 1 s), without a Redis command of its own
        assert first.wait_for_output(
            "Limit of stage 'detail' (group 'shops') changed in Redis from 3 to 10 by another "
            "process or an operator; it holds for this process too (its REDISLOCK_STAGES says 3)",
            timeout=90,
        ), first.tail()
        stop(first, second)
        both = served(site, "shopfull", "othershop")
    assert len([r for r in both if r.stage == "othershop"]) == 80
    most, above = most_at_once(both, 10)  # one cap of 10 over both spiders' requests
    assert most <= 10 and above == 0.0
    assert (
        "Limit of stage 'detail' changed from 3 to 10 in Redis (group 'shops'; the newest "
        "process's settings win" in second.output
    )
    assert first.output.count("changed in Redis from 3 to 10") == 1  # once per change
    assert limit_in_redis(redis_client, "shops", "detail") == 10
    assert limit_in_redis(redis_client, "plan", "detail") is None
    assert limit_in_redis(redis_client, "othershop", "detail") is None
    assert leftover(redis_client) == 0


@pytest.mark.parametrize("group", [None, "shops"], ids=["own caps", "one shared cap"])
def test_worker_spiders_with_the_same_stage_names_share_worker_slots_only_in_one_group(
    redis_url: str, redis_client: redis.Redis, group: str | None
) -> None:
    """Worker front: one worker of spider ``staged`` and one of ``otherstaged``, each spider's
    ``detail`` capped at 1 worker (one request at a time each). Each spider has its own queues
    (scrapy-redis's per-spider keys); the worker slots follow the group: by default both work on
    ``detail`` at once, in one group only one of them does at a time. The first has more pages than
    it fetches in the test; it is closed gracefully (SIGTERM) once the second is running."""
    settings = {
        "REDISLOCK_WORKER_STAGES": {"detail": 1},
        "CONCURRENT_REQUESTS": 1,
        "REDISLOCK_IDLE_CLOSE": 1,
        "REDISLOCK_GROUP": group,
    }
    second_alive = QueueKeys.of("redislock", "otherstaged").alive
    with CrawlSite(delay=0.1) as site:
        first = staged_worker(redis_url, site.url, "detail:600", settings)
        assert site.wait_for(lambda: site.in_flight["detail"] > 0, timeout=60)
        second = staged_worker(
            redis_url, f"{site.url}/other", "detail:30", settings, spider=OTHER_WORKER
        )
        if group is None:  # the second works beside the first, to its end
            assert site.wait_for(lambda: site.done("other") == 30, timeout=90)
        else:  # the second waits for the one worker slot the first holds
            assert site.wait_for(lambda: bool(redis_client.zcard(second_alive)), timeout=90)
        assert first.poll() is None  # the first still works
        first.send_signal(signal.SIGTERM)
        outputs = [process.communicate(timeout=120)[0] for process in (first, second)]
        both = served(site, "detail", "other")
    assert [first.returncode, second.returncode] == [0, 0], [o[-3000:] for o in outputs]
    assert len([r for r in both if r.stage == "other"]) == 30
    most, _ = most_at_once(both, 1)
    assert most == (2 if group is None else 1), outputs[1][-3000:]
    if group is None:
        assert "group 'staged'" in outputs[0] and "group 'otherstaged'" in outputs[1]
    assert leftover(redis_client) == 0
