"""A site's Retry-After pauses that host for every process (REDISLOCK_RETRY_AFTER), in real crawls:
3 `scrapy runspider` processes against a local site answering on 2 host names and a real
redis-server.

Once all three crawl, the site answers one request of host 1 ``429 Too Many Requests`` with
``Retry-After: 3``. The process that gets it pauses host 1's starts in Redis until 3 s later on
Redis's clock; every process's next request of host 1 (its take of the key's slot is refused, or
its start is held) waits until then. The site sees no request of host 1 during the pause, except
those already on their way when the pause reached Redis; host 2 goes on (under StageScheduler, where
host 1's requests wait queued); host 1 resumes after it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis

from scrapy_redislock.lock.delay import delay_keys
from testing.capacity import CapacitySite
from testing.crawlproc import Crawl, leftover

pytestmark = [pytest.mark.integration, pytest.mark.crawl]
PROCESSES = 3
PAUSE = 3.0
# requests of host 1 already on their way when the pause reached Redis (their slots taken before)
# may still arrive this long after it: 0.25 s on a quiet machine; one arrived 0.40 s after it at a
# load average of 11 on 2 cores. Past this bound, 2 of the pause's 3 s must see none.
ON_THEIR_WAY = 1.0


def pause_landed(client: redis.Redis, name: str, timeout: float = 30) -> float:
    """When the pause of ``name`` (host 1's key or scope, ``key:<name>``, or the stage) reached Redis, on this process's
    ``time.monotonic()`` (the site's clock): the pause's end on Redis's clock, which is this
    machine's. A key's is the pause mark of its light path (its delay gate also holds bookings,
    which a key with a delay makes); a stage's, its gate."""
    keys = delay_keys("redislock", name)
    deadline = time.monotonic() + timeout
    while True:
        if name.startswith("key:"):
            mark = client.zscore(keys.light, "~pause")  # ms
            until = None if mark is None else mark * 1000
        else:
            until = client.get(keys.gate)
        if until is not None:
            return int(until) / 1e6 - PAUSE - (time.time() - time.monotonic())
        assert time.monotonic() < deadline, "no pause reached Redis"
        time.sleep(0.01)


BY_KEY = {"REDISLOCK_STAGE_KEY": "domain", "REDISLOCK_KEY_LIMIT": 4, "REDISLOCK_RETRY_AFTER": True}
# the host as a scope of its own (as a proxy would be), with REDISLOCK_RETRY_AFTER off: the scope's
# entry in REDISLOCK_SCOPES asks for the pause
BY_STAGE = {"REDISLOCK_STAGES": {"detail": {"limit": 8, "retry_after": True}}}
# a key with no cap: a delay (REDISLOCK_DELAY), or a rate window (its REDISLOCK_SCOPES entry)
BY_DELAYED_KEY = {
    "REDISLOCK_STAGE_KEY": "domain",
    "REDISLOCK_DELAY": 0.01,
    "REDISLOCK_RETRY_AFTER": True,
}
BY_RATED_KEY = {
    "REDISLOCK_STAGE_KEY": "domain",
    "REDISLOCK_SCOPES": {"127.0.0.*": {"rate": "200/1"}},
    "REDISLOCK_RETRY_AFTER": True,
}
BY_SCOPE = {
    "REDISLOCK_SCOPES": {"via:*": {"limit": 4, "retry_after": True}},
    "REDISLOCK_SCOPES_OF": "testing.spiders.crawlspider.host_scope",
}


@pytest.mark.parametrize(
    ("scheduler", "paused"),
    [
        ("scrapy_redislock.StageScheduler", "key"),
        (None, "key"),
        ("scrapy_redislock.StageScheduler", "scope"),
        ("scrapy_redislock.StageScheduler", "stage"),
        ("scrapy_redislock.StageScheduler", "delayed-key"),
        ("scrapy_redislock.StageScheduler", "rated-key"),
    ],
    ids=["key-scheduler", "key-middleware", "scope", "stage", "delayed-key", "rated-key"],
)
def test_a_retry_after_pauses_the_host_for_every_process(
    scheduler: str | None, paused: str, redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The host's key pauses with REDISLOCK_RETRY_AFTER; a scope pauses when its REDISLOCK_SCOPES
    entry says ``retry_after``, a stage when its REDISLOCK_STAGES policy does (the global setting
    off): then both hosts pause, the stage being theirs. A key with no cap pauses too when it has
    a delay or a rate window (its stage, not capped, has no start to hold)."""
    settings: dict[str, Any] = {
        "REDISLOCK_URL": redis_url,
        "SCHEDULER": scheduler,
        "REDISLOCK_STAGES": {"detail": None},
        **{
            "key": BY_KEY,
            "scope": BY_SCOPE,
            "stage": BY_STAGE,
            "delayed-key": BY_DELAYED_KEY,
            "rated-key": BY_RATED_KEY,
        }[paused],
        "CONCURRENT_REQUESTS": 8,
    }
    with CapacitySite(hosts=2, capacity=16, base=0.05) as site:
        crawls = [
            Crawl(site.url_of(1), "detail:200", settings, tmp_path, args={"hosts": "2", "first": str(1000 * i)})
            for i in range(PROCESSES)
        ]  # fmt: skip
        for crawl in crawls:
            crawl.start()
        host1, host2 = site.hosts["127.0.0.1"], site.hosts["127.0.0.2"]
        # every process crawls host 1 before the 429 is set up
        assert site.wait_for(lambda: len(host1.arrivals) >= 40, timeout=60)
        site.too_many("127.0.0.1", PAUSE)
        assert site.wait_for(lambda: host1.answers[429] == 1, timeout=30)
        name = {"scope": "key:via:127.0.0.1", "stage": "detail"}.get(paused, "key:127.0.0.1")
        landed = pause_landed(redis_client, name)
        for crawl in crawls:
            crawl.wait(timeout=120)
            assert crawl.stats.get("finish_reason") == "finished", crawl.tail()
        with site.condition:
            refused_at = host1.refused[0]
            during = [t - refused_at for t in host1.arrivals if refused_at < t < landed + PAUSE]
            after = [t for t in host1.arrivals if t > landed + PAUSE]
            other = [t for t in host2.arrivals if refused_at < t < refused_at + PAUSE]
            other_during = [
                t - refused_at for t in host2.arrivals if refused_at < t < landed + PAUSE
            ]
    stragglers = [t for t in during if t > landed - refused_at + ON_THEIR_WAY]
    print(
        f"the pause reached Redis {landed - refused_at:.3f} s after the 429; arrivals at host 1"
        f" from the 429 to the pause's end: {[round(t, 3) for t in during]}"
    )
    assert stragglers == [], during
    assert after, "host 1 never resumed"
    if paused == "stage":  # host 2's requests are of the paused stage too
        assert [t for t in other_during if t > landed - refused_at + ON_THEIR_WAY] == []
    elif scheduler and paused == "key":
        # host 2 went on meanwhile; with the middleware alone host 1's held requests wait in the
        # downloader and may take all of CONCURRENT_REQUESTS (docs/key-caps.md), as a request's
        # other scopes do under StageScheduler too (docs/scopes.md)
        assert len(other) > 10
    paused = sum(crawl.stats.get("redislock/retry_after/pauses", 0) for crawl in crawls)
    assert paused == 1
    assert leftover(redis_client) == 0
