"""The scripts of ``crawl/scripts/``: the epoch of a crawl's queue in Redis, one script for both
fronts (``scripts/queue_epoch.lua``), made when missing, so that a process that reads another epoch
than the one it saw knows Redis lost the queue. The request front reads it beside a shared
scrapy-redis queue (:mod:`scrapy_redislock.requests.queueloss`), the worker front beside its stage
queues (:mod:`scrapy_redislock.workers.queue`). And the request front's pop of a shared scrapy-redis
queue that the same call again answers with the same request (``scripts/shared_pop.lua``,
:mod:`scrapy_redislock.requests.stagequeue`), and the names of the keys those two keep beside a shared
queue (:class:`SharedQueueKeys`). Reads no settings.
"""

from __future__ import annotations

from dataclasses import dataclass

from scrapy_redislock._redis import hash_tag, load_scripts

EPOCH_SCRIPT = "queue_epoch"
SHARED_POP_SCRIPT = "shared_pop"
CRAWL_SCRIPTS = (EPOCH_SCRIPT, SHARED_POP_SCRIPT)  # the scripts of ``crawl/scripts/``
# ms a process's record of its last pop of a shared queue (shared_pop.lua) or take of a start-URL feed
# (workers/scripts/feed_take.lua) is kept in Redis: longer than any outage a process comes back from to
# ask again; it goes at the process's close
RECORD_KEPT_MS = 24 * 3600 * 1000

__all__ = [
    "CRAWL_SCRIPTS",
    "EPOCH_SCRIPT",
    "RECORD_KEPT_MS",
    "SHARED_POP_SCRIPT",
    "SharedQueueKeys",
    "crawl_scripts",
]


def crawl_scripts() -> dict[str, str]:
    """The Lua sources of ``crawl/scripts/`` by name (both fronts run them)."""
    return load_scripts("scrapy_redislock.crawl", CRAWL_SCRIPTS)


@dataclass(frozen=True)
class SharedQueueKeys:
    """Redis keys the request front keeps beside a shared scrapy-redis queue (in the queue's Redis,
    under REDISLOCK_KEY_PREFIX, so that a scan of the queue's own keys never meets them)."""

    epoch: str  # the queue's epoch (crawl/scripts/queue_epoch.lua)

    @classmethod
    def of(cls, prefix: str, queue_key: str) -> SharedQueueKeys:
        """``<prefix>:shared:{<the spider's queue key>}:epoch``."""
        return cls(epoch=f"{prefix}:shared:{{{queue_key}}}:epoch")

    @staticmethod
    def popped(prefix: str, sub_queue_key: str, process: str) -> str:
        """``<prefix>:shared:{<a sub-queue's hash tag>}:popped:<process>:<its key>``: a process's
        last pop of that sub-queue (crawl/scripts/shared_pop.lua), in the sub-queue's hash slot:
        tagged with what Redis Cluster hashes of its key (the tag a Cluster deployment gives it,
        ``{%(spider)s}:requests``, else the whole key: :func:`~scrapy_redislock._redis.hash_tag`)."""
        return f"{prefix}:shared:{{{hash_tag(sub_queue_key)}}}:popped:{process}:{sub_queue_key}"
