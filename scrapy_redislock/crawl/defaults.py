"""Every REDISLOCK_* setting in one table: name, default, kind of value, and what it does.

:func:`scrapy_redislock.crawl.settings.read_settings` reads the table in one loop (the kind names
the parser, one per kind of value) and then applies a few rules across settings;
``docs/settings.md``'s table is generated from it (``docs/_ext/settings_reference.py``). A setting
whose default is None also takes None spelled as ``-s NAME=None`` (or ``none``, ``null``, nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    """One setting: ``kind`` names its parser in :mod:`scrapy_redislock.crawl.settings`."""

    name: str
    default: Any
    kind: str
    doc: str

    @property
    def field(self) -> str:
        """Its attribute on the checked settings object (REDISLOCK_KEY_LIMIT -> key_limit)."""
        return self.name.removeprefix("REDISLOCK_").lower()


TABLE: tuple[Setting, ...] = (
    Setting(
        "REDISLOCK_ENABLED",
        True,
        "bool",
        "Off switch of the request front (StageLockMiddleware, StageScheduler): with False the "
        "crawl needs no Redis, requests without a stage go out, and a request that has a stage "
        "fails with ThrottlingDisabled (stat redislock/throttling_off) instead of going out "
        "unthrottled; never NotConfigured. The worker front (StageWorkerMixin) does not read it.",
    ),
    Setting(
        "REDISLOCK_URL",
        None,
        "url",
        "Redis URL: redis://, rediss://, unix://, redis+sentinel://h1:26379,h2:26379/service[/db], "
        "redis+cluster://h1:7000,... (see docs/high-availability.md), or a list of independent "
        "masters' URLs for a quorum lock (request front only); when unset: scrapy-redis's "
        "REDIS_URL / REDIS_HOST + REDIS_PORT, then redis://localhost:6379/0.",
    ),
    Setting(
        "REDISLOCK_QUORUM",
        None,
        "quorum",
        "With REDISLOCK_URL a list of N independent masters (the request front's quorum lock): "
        "masters a slot needs; None = the safe quorum of each stage (the smallest q > "
        "N*limit/(limit+1)); a value must be >= that and <= N.",
    ),
    Setting(
        "REDISLOCK_CONNECT_TIMEOUT",
        30.0,
        "seconds",
        "Seconds a starting process waits (with back-off, and a warning each try) for Redis to be "
        "reachable, e.g. during a failover, before it closes with redislock_redis_unavailable; 0 = "
        "close at once.",
    ),
    Setting(
        "REDISLOCK_PARAMS",
        None,
        "client_params",
        "Extra keyword arguments for the redis client (when unset: scrapy-redis's REDIS_PARAMS), "
        "over our own: socket_connect_timeout 10, health_check_interval 30, protocol 2.",
    ),
    Setting(
        "REDISLOCK_STAGES",
        {},
        "stage_policies",
        "Max requests in flight per stage, cluster-wide (at most 1000, MAX_LIMIT); None = unlimited. "
        "Or a stage's whole policy, as an entry of REDISLOCK_SCOPES: {'limit': N, 'delay': seconds, "
        "'rate': 'N/T', 'adaptive': bool, 'retry_after': bool} (docs/scopes.md).",
    ),
    Setting(
        "REDISLOCK_WORKER_STAGES",
        {},
        "stage_limits",
        "Max workers per stage, cluster-wide (StageWorkerMixin; at most 1000, MAX_LIMIT); None = "
        "unlimited.",
    ),
    Setting("REDISLOCK_TTL", 30.0, "ttl", "Lease seconds; renewed every third of it while held."),
    Setting(
        "REDISLOCK_DURABLE",
        False,
        "bool",
        "True only if Redis loses no acknowledged write: AOF with appendfsync always, and no "
        "failover to a replica that may lag. A restart of Redis then keeps every lock as it was; "
        "by default (False) the first script after any restart (from a snapshot, AOF, or a "
        "promoted replica) reserves every slot for one lease, so that holders re-adopt theirs "
        "before anybody new gets one (docs/failures.md).",
    ),
    Setting(
        "REDISLOCK_ALLOW_EVICTION",
        False,
        "bool",
        "True to run on a Redis whose maxmemory-policy may evict keys (volatile-* or allkeys-*). "
        "By default the crawl refuses to start on one: an evicted lock key gives a slot twice. "
        "Set maxmemory-policy noeviction, or keep the locks on a Redis of their own "
        "(docs/failures.md).",
    ),
    Setting(
        "REDISLOCK_KEY_PREFIX",
        "redislock",
        "name",
        "Prefix of every Redis key of the locks and the worker queues.",
    ),
    Setting(
        "REDISLOCK_GROUP",
        "%(spider)s",
        "group",
        "The cap group of this crawl's locks (stage caps, worker slots, key caps): processes share "
        "a cap only within one group. Default: the spider's name, so two spiders with the same "
        "stage names keep their own caps; the same name in several spiders' settings makes them "
        "share (%(spider)s is replaced by the spider's name). '' = no group: the key names of 0.x, "
        "shared by every spider that sets '' (docs/request-caps.md, coming from 0.x).",
    ),
    Setting(
        "REDISLOCK_DEFAULT_STAGE",
        None,
        "stage_name",
        "Stage of requests that name none (None: such requests are not throttled).",
    ),
    Setting(
        "REDISLOCK_CALLBACK_STAGES",
        {},
        "callback_stages",
        'Callback name -> stage, for requests that do not set meta["redislock_stage"].',
    ),
    Setting(
        "REDISLOCK_WAIT_TIMEOUT",
        None,
        "positive_seconds",
        "Seconds a request may wait for a slot before it fails with AcquireTimeout (with "
        "StageScheduler, a wait in Redis for the queued requests of a stage, key or scope that runs "
        "this long fails the next of them); None = forever.",
    ),
    Setting(
        "REDISLOCK_ALLOWED_SCHEMES",
        "http,https",
        "schemes",
        "URL schemes a worker fetches from its queue (StageWorkerMixin): a list, or names separated by "
        "commas; a queued request of another scheme (file:, data:, s3:, ...) goes to the dead-letter "
        "list.",
    ),
    Setting(
        "REDISLOCK_STAGE_PREFERENCE",
        [],
        "stage_names",
        "Order in which a worker takes stages that have work and a free slot (StageWorkerMixin).",
    ),
    Setting(
        "REDISLOCK_SCHEDULER_INNER",
        "scrapy.core.scheduler.Scheduler",
        "scheduler",
        "The scheduler that StageScheduler wraps.",
    ),
    Setting(
        "REDISLOCK_WAITERS_PER_STAGE",
        2,
        "positive_int",
        "Waits per capped stage and process in Redis's line for the stage's requests queued in "
        "StageScheduler (each blocks one connection; none opens while this many slots are kept for "
        "them; over scrapy-redis's shared queue one); the requests wait in the inner scheduler, in "
        "its order, taking none of CONCURRENT_REQUESTS.",
    ),
    Setting(
        "REDISLOCK_LOCAL_REUSE",
        0.25,
        "seconds",
        "Seconds a slot granted by Redis may pass straight from a finished request to a waiting or "
        "queued one of the same stage, key or scope in the same process, before it goes back to "
        "Redis's first-come-first-served line; 0 = always to Redis.",
    ),
    Setting(
        "REDISLOCK_IDLE_CLOSE",
        None,
        "seconds",
        "A worker (StageWorkerMixin) closes after this many seconds with no work anywhere; None = "
        "idle forever.",
    ),
    Setting(
        "REDISLOCK_STAGE_KEY",
        None,
        "key_function",
        'A stage met at run time: "domain", "download_slot" (Scrapy\'s slot key), or a function '
        "(request, spider) -> key or None (an object or its dotted path); None = no keys. Each key "
        "is capped and delayed on its own.",
    ),
    Setting(
        "REDISLOCK_KEY_LIMIT",
        None,
        "key_limit",
        "Max requests in flight per key, cluster-wide (at most 1000, MAX_LIMIT); None = no cap (a "
        "delay alone).",
    ),
    Setting(
        "REDISLOCK_KEY_LIMITS",
        {},
        "key_limits",
        "Per-key overrides of REDISLOCK_KEY_LIMIT: {key: limit or None}.",
    ),
    Setting(
        "REDISLOCK_DELAY",
        0.0,
        "delay",
        "Seconds between two request starts of the same key, across every process (on Redis's "
        "clock), at most 86400; 0 = none.",
    ),
    Setting(
        "REDISLOCK_DELAYS",
        {},
        "delays",
        "Per-stage or per-key overrides of REDISLOCK_DELAY: {stage or key: seconds} (a stage name "
        "wins over a key).",
    ),
    Setting(
        "REDISLOCK_RANDOMIZE_DELAY",
        False,
        "bool",
        "Each gap a random 0.5 to 1.5 times the delay, as Scrapy's RANDOMIZE_DOWNLOAD_DELAY does.",
    ),
    Setting(
        "REDISLOCK_SCOPES",
        {},
        "scopes",
        "Throttling scopes (docs/scopes.md): {scope name or glob pattern: {'limit': N, 'delay': "
        "seconds, 'rate': 'N/T', 'adaptive': bool, 'retry_after': bool}}, each held for the whole "
        "cluster; a request's scopes are its key, meta['redislock_scopes'] and what "
        "REDISLOCK_SCOPES_OF gives.",
    ),
    Setting(
        "REDISLOCK_SCOPES_OF",
        None,
        "scope_function",
        '"proxy" (proxy:<host>:<port> of meta["proxy"]) or a function (request, spider) -> scope '
        "names (an object or its dotted path): scopes of every request beside its stage and key.",
    ),
    Setting(
        "REDISLOCK_CRAWL_DELAY",
        False,
        "bool",
        "Obey robots.txt Crawl-delay for the whole cluster: a site's key keeps at least its "
        "Crawl-delay between two starts (needs ROBOTSTXT_OBEY; the key is the domain unless "
        "REDISLOCK_STAGE_KEY says otherwise).",
    ),
    Setting(
        "REDISLOCK_ADAPTIVE",
        (),
        "adaptive",
        "Limits that follow the site, one controller per lock for the whole cluster "
        '(docs/adaptive.md): capped stages by name, and/or "keys" for every key of '
        "REDISLOCK_STAGE_KEY; True = every capped stage and the keys. The configured cap is the "
        "ceiling.",
    ),
    Setting(
        "REDISLOCK_ADAPTIVE_MIN",
        1,
        "positive_limit",
        "The lowest limit an adaptive stage or key goes to, and where a new one starts.",
    ),
    Setting(
        "REDISLOCK_ADAPTIVE_WINDOW",
        1.0,
        "positive_seconds",
        "Seconds of one adaptive window (on Redis's clock): every process's observations of a "
        "lock are merged over it, then its limit moves once.",
    ),
    Setting(
        "REDISLOCK_RETRY_AFTER",
        False,
        "bool",
        "A 429 or 503 answer with Retry-After pauses the request's key when it is throttled (a cap, "
        "a delay, a Crawl-delay or a rate window; else its capped stage) "
        "for every process until then, on Redis's clock; a 429 without it for "
        "REDISLOCK_RETRY_AFTER_DEFAULT (docs/adaptive.md).",
    ),
    Setting(
        "REDISLOCK_RETRY_AFTER_DEFAULT",
        5.0,
        "seconds",
        "Seconds a 429 without Retry-After pauses its key or stage (0: no pause); a 503 without it "
        "pauses nothing (the adaptive limit backs off).",
    ),
)

#: name -> default, in the table's order.
SETTINGS: dict[str, Any] = {setting.name: setting.default for setting in TABLE}
