"""Caps belong to their spider (REDISLOCK_GROUP): real crawls of two spiders with the same stage
names side by side against one site and one redis-server, on both fronts. By default each keeps its
own cap; with one group named in both, they share one cap, and the process whose limit was
overwritten says so in its log. The site counts what is in flight (request front: spider ``plan``
fetches ``/shopfull/...``, spider ``othershop`` ``/othershop/...``; worker front: spider ``staged``
``/detail/...``, spider ``otherstaged`` ``/other/detail/...``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from scrapy_redislock._redis import text
from scrapy_redislock.lock.permit import LockKeys, group_prefix
from testing.crawlproc import ROOT, Crawl, leftover, staged_worker
from testing.site import CrawlSite, most_at_once, served

pytestmark = [pytest.mark.integration, pytest.mark.crawl]
OTHER_SHOP = ROOT / "testing" / "spiders" / "othershopspider.py"
OTHER_WORKER = ROOT / "testing" / "spiders" / "otherworkerspider.py"
FIRST_PAGES = 90  # at 3 in flight and 0.25 s a page: about 7.5 s, so the second starts beside it


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
    beside it once the first has requests in flight; both waited for."""
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


def test_two_spiders_with_the_same_stage_names_keep_their_own_caps(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    with CrawlSite(delay=0.25) as site:
        first, second = side_by_side(site, redis_url, tmp_path)
        second.wait(timeout=120)
        first.wait(timeout=120)
        shopfull, othershop = served(site, "shopfull"), served(site, "othershop")
    for crawl in (first, second):
        assert crawl.code == 0 and crawl.stats["finish_reason"] == "finished", crawl.tail()
    assert len(shopfull) == FIRST_PAGES and len(othershop) == 80
    # they ran side by side: the first was still fetching when the second's first page came
    assert max(r.answered for r in shopfull) > min(r.arrived for r in othershop)
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
            timeout=60,
        ), first.tail()
        second.wait(timeout=120)
        first.wait(timeout=120)
        both = served(site, "shopfull", "othershop")
    for crawl in (first, second):
        assert crawl.code == 0 and crawl.stats["finish_reason"] == "finished", crawl.tail()
    assert len(both) == FIRST_PAGES + 80
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
    ``detail`` at once, in one group only one of them does at a time."""
    settings = {
        "REDISLOCK_WORKER_STAGES": {"detail": 1},
        "CONCURRENT_REQUESTS": 1,
        "REDISLOCK_IDLE_CLOSE": 1,
        "REDISLOCK_GROUP": group,
    }
    with CrawlSite(delay=0.1) as site:
        first = staged_worker(redis_url, site.url, "detail:80", settings)
        assert site.wait_for(lambda: site.in_flight["detail"] > 0, timeout=60)
        second = staged_worker(
            redis_url, f"{site.url}/other", "detail:30", settings, spider=OTHER_WORKER
        )
        outputs = [process.communicate(timeout=120)[0] for process in (first, second)]
        both = served(site, "detail", "other")
    assert [first.returncode, second.returncode] == [0, 0], [o[-3000:] for o in outputs]
    assert len(both) == 80 + 30
    most, _ = most_at_once(both, 1)
    assert most == (2 if group is None else 1), outputs[1][-3000:]
    if group is None:
        assert "group 'staged'" in outputs[0] and "group 'otherstaged'" in outputs[1]
    assert leftover(redis_client) == 0
