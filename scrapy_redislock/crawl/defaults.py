"""Default values of every REDISLOCK_* setting, in one place.

Scrapy glue reads them through :func:`scrapy_redislock.crawl.settings.read_settings`.
"""

from __future__ import annotations

from typing import Any

# Off switch of the request front (StageLockMiddleware, StageScheduler): with False the crawl needs
# no Redis, requests without a stage go out, and a request that has a stage fails with
# ThrottlingDisabled (stat redislock/throttling_off) instead of going out unthrottled; never
# NotConfigured. The worker front (StageWorkerMixin) does not read it.
REDISLOCK_ENABLED = True
# Redis URL: redis://, rediss://, unix://, redis+sentinel://h1:26379,h2:26379/service[/db],
# redis+cluster://h1:7000,... (see docs/high-availability.md), or a list of independent masters'
# URLs for a quorum lock (request front only); when unset: scrapy-redis's REDIS_URL / REDIS_HOST +
# REDIS_PORT, then redis://localhost:6379/0.
REDISLOCK_URL: str | list[str] | None = None
# With REDISLOCK_URL a list of N independent masters (the request front's quorum lock): masters a
# slot needs; None = the safe quorum of each stage (the smallest q > N*limit/(limit+1)); a value
# must be >= that and <= N.
REDISLOCK_QUORUM: int | None = None
# Seconds a starting process waits (with back-off, and a warning each try) for Redis to be
# reachable, e.g. during a failover, before it closes with redislock_redis_unavailable; 0 = close at
# once.
REDISLOCK_CONNECT_TIMEOUT = 30.0
# Extra keyword arguments for the redis client (when unset: scrapy-redis's REDIS_PARAMS).
REDISLOCK_PARAMS: dict[str, Any] | None = None
# Max requests in flight per stage, cluster-wide; None = unlimited.
REDISLOCK_STAGES: dict[str, int | None] = {}
# Max workers per stage, cluster-wide (StageWorkerMixin); None = unlimited.
REDISLOCK_WORKER_STAGES: dict[str, int | None] = {}
# Lease seconds; renewed every third of it while held.
REDISLOCK_TTL = 30.0
# True only if Redis loses no acknowledged write: AOF with appendfsync always, and no failover to a
# replica that may lag. A restart of Redis then keeps every lock as it was; by default (False) the
# first script after any restart (from a snapshot, AOF, or a promoted replica) reserves every slot
# for one lease, so that holders re-adopt theirs before anybody new gets one (docs/failures.md).
REDISLOCK_DURABLE = False
# Prefix of every Redis key of the locks and the worker queues.
REDISLOCK_KEY_PREFIX = "redislock"
# Stage of requests that name none (None: such requests are not throttled).
REDISLOCK_DEFAULT_STAGE: str | None = None
# Callback name -> stage, for requests that do not set meta["redislock_stage"].
REDISLOCK_CALLBACK_STAGES: dict[str, str] = {}
# Seconds a request may wait for a slot before it fails with AcquireTimeout; None = forever.
REDISLOCK_WAIT_TIMEOUT: float | None = None
# Order in which a worker takes stages that have work and a free slot (StageWorkerMixin).
REDISLOCK_STAGE_PREFERENCE: list[str] = []
# The scheduler that StageScheduler wraps.
REDISLOCK_SCHEDULER_INNER = "scrapy.core.scheduler.Scheduler"
# Requests per capped stage and process that may wait for a slot in the downloader, first in this
# process's line in Redis (StageScheduler); the stage's other requests wait in the inner scheduler,
# in its order.
REDISLOCK_WAITERS_PER_STAGE = 2
# Seconds a slot granted by Redis may pass straight from a finished request to a queued one of the
# same stage in the same process (StageScheduler), before it goes back to Redis's
# first-come-first-served line; 0 = always to Redis.
REDISLOCK_LOCAL_REUSE = 0.25
# A worker (StageWorkerMixin) closes after this many seconds with no work anywhere; None = idle
# forever.
REDISLOCK_IDLE_CLOSE: float | None = None
# A stage met at run time: "domain", "download_slot" (Scrapy's slot key), or a function (request,
# spider) -> key or None (an object or its dotted path); None = no keys. Each key is capped and
# delayed on its own.
REDISLOCK_STAGE_KEY: Any = None
# Max requests in flight per key, cluster-wide; None = no cap (a delay alone).
REDISLOCK_KEY_LIMIT: int | None = None
# Per-key overrides of REDISLOCK_KEY_LIMIT: {key: limit or None}.
REDISLOCK_KEY_LIMITS: dict[str, int | None] = {}
# Seconds between two request starts of the same key, across every process (on Redis's clock); 0 =
# none.
REDISLOCK_DELAY = 0.0
# Per-stage or per-key overrides of REDISLOCK_DELAY: {stage or key: seconds} (a stage name wins over
# a key).
REDISLOCK_DELAYS: dict[str, float] = {}
# Each gap a random 0.5 to 1.5 times the delay, as Scrapy's RANDOMIZE_DOWNLOAD_DELAY does.
REDISLOCK_RANDOMIZE_DELAY = False

# Settings of earlier versions, and why they went: named in the error a crawl that still sets one
# gets.
REMOVED = {
    "REDISLOCK_PARK_LIMIT": "StageScheduler no longer parks requests in memory: they wait in the "
    "inner scheduler, "
    "in its order, and at most REDISLOCK_WAITERS_PER_STAGE per stage wait for a slot in the "
    "downloader",
}

SETTINGS = {name: value for name, value in dict(globals()).items() if name.startswith("REDISLOCK_")}
