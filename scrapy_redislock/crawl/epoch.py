"""The scripts of ``crawl/scripts/``: the epoch of a crawl's queue in Redis, one script for both
fronts (``scripts/queue_epoch.lua``), made when missing, so that a process that reads another epoch
than the one it saw knows Redis lost the queue. The request front reads it beside a shared
scrapy-redis queue (:mod:`scrapy_redislock.requests.queueloss`), the worker front beside its stage
queues (:mod:`scrapy_redislock.workers.queue`). And the request front's pop of a shared scrapy-redis
queue that the same call again answers with the same request (``scripts/shared_pop.lua``,
:mod:`scrapy_redislock.requests.stagequeue`). Reads no settings.
"""

from __future__ import annotations

from scrapy_redislock._redis import load_scripts

EPOCH_SCRIPT = "queue_epoch"
SHARED_POP_SCRIPT = "shared_pop"
CRAWL_SCRIPTS = (EPOCH_SCRIPT, SHARED_POP_SCRIPT)  # the scripts of ``crawl/scripts/``
# ms a process's record of its last pop of a shared queue (shared_pop.lua) or take of a start-URL feed
# (workers/scripts/feed_take.lua) is kept in Redis: longer than any outage a process comes back from to
# ask again; it goes at the process's close
RECORD_KEPT_MS = 24 * 3600 * 1000

__all__ = ["CRAWL_SCRIPTS", "EPOCH_SCRIPT", "RECORD_KEPT_MS", "SHARED_POP_SCRIPT", "crawl_scripts"]


def crawl_scripts() -> dict[str, str]:
    """The Lua sources of ``crawl/scripts/`` by name (both fronts run them)."""
    return load_scripts("scrapy_redislock.crawl", CRAWL_SCRIPTS)
