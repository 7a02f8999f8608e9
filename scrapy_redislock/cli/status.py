"""Everything an operator sees of Redis in one read: every stage lock and every worker-mixin spider.

``status``, the dashboard and ``/metrics`` all call :func:`read_all` (one SCAN of the prefix, then
one MULTI/EXEC per lock and per spider, each a consistent snapshot).
"""

from __future__ import annotations

import fnmatch
import time
from dataclasses import asdict
from typing import Any

from scrapy_redislock._redis import RedisClient
from scrapy_redislock.lock.status import KEY_LOCK_PREFIX, StageStatus, grouped_keys, stage_status
from scrapy_redislock.workers.status import (
    DeadLetters,
    SpiderStatus,
    spider_status,
    spiders_in,
    worker_ttl,
)


def read_all(
    client: RedisClient, prefix: str, default_ttl: float
) -> tuple[list[StageStatus], list[SpiderStatus]]:
    """Every stage lock (of every cap group) and every StageWorkerMixin spider under the prefix,
    found with one SCAN.

    ``default_ttl`` makes a worker dead when no worker slot lock says its ttl (see
    :func:`worker_ttl`).
    """
    grouped = grouped_keys(client, prefix, "*")
    locks = sorted(
        place for place, rests in grouped.items() if ":meta" in rests or ":light" in rests
    )
    found = (stage_status(client, prefix, tag, group) for group, tag in locks)
    stages = [status for status in found if status is not None]
    ttl = worker_ttl(stages, default_ttl)
    ungrouped = {tag: rests for (group, tag), rests in grouped.items() if not group}
    spiders = [
        spider_status(client, prefix, name, ttl, keys)
        for name, keys in sorted(spiders_in(ungrouped).items())
    ]
    return stages, spiders


def split_keys(
    found: list[StageStatus], pattern: str | None = None
) -> tuple[list[StageStatus], list[StageStatus]]:
    """(the fixed stages, the locks of keys met at run time): keys matching ``pattern`` (a glob on
    the key, e.g. ``*.example.com``; None: all), busiest first (held + waiting), then by name."""
    stages = [s for s in found if not s.stage.startswith(KEY_LOCK_PREFIX)]
    keys = [
        s
        for s in found
        if s.stage.startswith(KEY_LOCK_PREFIX)
        and (pattern is None or fnmatch.fnmatchcase(s.stage[len(KEY_LOCK_PREFIX) :], pattern))
    ]
    keys.sort(key=lambda s: (-(s.held + s.waiters), s.stage, s.group))
    return stages, keys


def snapshot(
    stages: list[StageStatus],
    prefix: str,
    url: str,
    spiders: list[SpiderStatus] | None = None,
    dead: list[DeadLetters] | None = None,
    keys: list[StageStatus] | None = None,
) -> dict[str, Any]:
    """Everything ``status --json`` prints (``url`` must already be masked); ``keys``: the key
    locks, apart."""
    return {
        "url": url,
        "prefix": prefix,
        "time": round(time.time(), 3),
        "stages": [s.to_json() for s in stages],
        **({"keys": [s.to_json() for s in keys]} if keys is not None else {}),
        "spiders": [s.to_json() for s in spiders or []],
        "dead_letters": [asdict(d) for d in dead or []],
    }
