"""KeyLocks: one lock per key met at run time (REDISLOCK_STAGE_KEY: a domain, ...), made on first
use and removed from Redis once idle.

A :class:`~scrapy_redislock.crawl.stagelocks.StageLocks` whose stages are keys: acquire, release,
renewal (the request front runs it, in the process's one renewal loop), Redis errors, reports of
why a key waits and close all work as for stages. What differs:

- a key's lock (named ``key:<key>``) is made when a request of the key first needs it, with the
  key's limit (REDISLOCK_KEY_LIMITS, else REDISLOCK_KEY_LIMIT); the first process to create it in
  Redis sets the limit;
- a key whose lock this process neither holds nor waits for at two renewal ticks in a row is
  *retired*: one script frees and unregisters this process, and deletes the lock's keys when no
  other process holds, waits or is registered (``lock/scripts/retire.lua``). A busy key costs one
  maintain per tick, an idle one nothing: nothing runs per key that nobody uses, and 10,000 domains
  crawled leave no keys behind;
- its command clients are the request stages' registry's; every blocking wait shares one connection
  pool of its own (a pool per key would open connections per domain);
- on close every key is retired, not only released.

It owns the cluster-wide delays and rate windows of stages, keys and scopes
(:class:`~scrapy_redislock.crawl.delays.Delays`), which run over its runner and end with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from scrapy_redislock.crawl.adaptive import Adaptation
from scrapy_redislock.crawl.delays import Delays
from scrapy_redislock.crawl.engine import one_per_crawler
from scrapy_redislock.crawl.renewer import gather_bounded
from scrapy_redislock.crawl.stagelocks import SlotPermit, StageLock, StageLocks
from scrapy_redislock.lock.aio import AsyncCountingLock
from scrapy_redislock.lock.base import CommandRunner, waiting_client
from scrapy_redislock.lock.status import KEY_LOCK_PREFIX

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

    from scrapy_redislock.crawl.settings import RedisLockSettings
    from scrapy_redislock.lock.core import Clock

logger = logging.getLogger(__name__)
# what is counted per key (the rest adds up over every key)
PER_KEY = frozenset({"timeouts", "lost", "unusable", "lease_bounded"})


__all__ = ["KEY_LOCK_PREFIX", "KeyLocks"]


class KeyLocks(StageLocks):
    """The keys of one crawler (see the module docstring); ``of(crawler, settings)`` is the shared
    instance."""

    retire_on_close = True
    watch_limits = False  # a key's limit is its own (KeyLocks.limit), never logged per key
    fan_out = 8  # renewals and retirements of many keys share the client's pool: a few at once

    def __init__(
        self,
        crawler: Crawler,
        settings: RedisLockSettings,
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(
            crawler,
            settings,
            {},
            lock_prefix=KEY_LOCK_PREFIX,
            stats_prefix="redislock/keys",
            # the request stages' clients (keys on the first master of a quorum)
            deployment=StageLocks.of(crawler, settings, clock=clock).deployment.share(),
            clock=clock,
        )
        self._waiting = waiting_client(self.client)
        # one runner for every key's lock and the delays (its scripts registered once)
        self.runner = CommandRunner(self.client, self._waiting)
        # the stages', keys' and scopes' delays and rate windows: they end with the runner's clients
        self.delays = Delays(
            self.runner,
            self.key_prefix,
            self.stats,
            randomize=settings.keys.randomize_delay,
            clock=clock,
        )
        # keys seen idle at the last tick: retired at the next if still idle
        self._idle: set[str] = set()
        self._taking: Counter[str] = Counter()  # take() and acquire() calls under way, per key
        if settings.adaptive.needed:
            self.adaptation = Adaptation(
                self.client,
                settings,
                self._key_ceiling,
                key_prefix=self.key_prefix,
                light=True,
                stats=self.stats,
            )
        self._retiring: asyncio.Task[None] | None = None

    @classmethod
    def of(
        cls,
        crawler: Crawler,
        settings: RedisLockSettings,
        *,
        attr: str = "_redislock_key_locks",
        clock: Clock = time.monotonic,
    ) -> KeyLocks:
        return one_per_crawler(crawler, attr, lambda: cls(crawler, settings, clock))

    @property
    def renews(self) -> bool:
        """Keys' locks are made at run time: there may be one to renew at any tick."""
        return True

    async def start(self) -> None:
        """PING, and free the slots if the reactor shuts down first; keys have no limits to publish
        (each is set when its lock is made)."""
        await self.client.ping()
        self._watch_shutdown()
        self.started = True

    def limit(self, key: str) -> int | None:
        """The key's limit as this process takes it on its light path: its cap, or an adaptive
        key's minimum (where its controller starts; the controller's limit, once it has one, is in
        Redis and wins)."""
        policy = self.settings.policy_of(key)
        if policy.limit is not None and policy.adaptive:
            return min(policy.limit, self.settings.adaptive.adaptive_min)
        return policy.limit

    @property
    def renew_interval(self) -> float:
        """The stages' minimum over the locks, without walking them: every key's lock is made with
        REDISLOCK_TTL (:meth:`lock_for`), whose interval is a third of it, at most 1 s (the
        middleware reads it for every request). With no lock yet too: one made just after a round
        must be renewed within its lease."""
        return min(self.settings.ttl, 3.0) / 3

    def _key_ceiling(self, name: str) -> int | None:
        """The configured cap of an adaptive key's lock ``key:<key>``: its controller's maximum."""
        if not name.startswith(KEY_LOCK_PREFIX):
            return None
        policy = self.settings.policy_of(name.removeprefix(KEY_LOCK_PREFIX))
        return policy.limit if policy.adaptive else None

    def count(self, stage: str, what: str) -> None:
        """A fault is counted per key (``redislock/keys/<key>/{timeouts,lost,unusable,
        lease_bounded}``); the rest (``reused``) adds up over every key: a broad crawl meets
        thousands."""
        if what in PER_KEY:
            super().count(stage, what)
        else:
            self.stats.inc_value(f"{self.stats_prefix}/{what}")

    def record_grant(self, stage: str, waited: float) -> None:
        """Count one key or scope slot got after ``waited`` seconds, over every key."""
        self.stats.inc_value(f"{self.stats_prefix}/acquired")
        self.stats.inc_value(f"{self.stats_prefix}/wait_time_total", waited)
        self.stats.max_value(f"{self.stats_prefix}/wait_time_max", waited)

    def lock_for(self, key: str) -> str:
        """Make the key's lock object if this process has none (no Redis command: it is set up on
        first acquire)."""
        if key not in self.locks:
            limit = self.limit(key)
            assert limit is not None
            self.limits[key] = limit
            lock = AsyncCountingLock(
                self.client,
                f"{KEY_LOCK_PREFIX}{key}",
                limit=limit,
                ttl=self.settings.ttl,
                key_prefix=self.key_prefix,
                identity={"spider": self.spider_name, "waiting": 0, "limit": limit},
                durable=self.settings.durable,
                maintain_loop=False,
                waiting=self._waiting,
                light=True,
                runner=self.runner,
                clock=self.clock,
            )
            if self.runner.may_evict is not None:
                # what its first acquire would ask the runner (MayEvict), which knows it already:
                # a driver step less for each key met
                lock.core.light_path = not self.runner.may_evict
            self.locks[key] = lock
            self._stage_by_lock[lock.name] = key
        self._idle.discard(key)
        return key

    @contextlib.contextmanager
    def _using(self, name: str) -> Iterator[None]:
        """A take or wait for the key ``name`` goes on: its lock is made if this process has none
        (or retired it since), and not retired meanwhile (a wait may sleep out a Redis error or a
        pause, its lock then idle)."""
        self._taking[name] += 1
        try:
            self.lock_for(name)
            yield
        finally:
            self._taking[name] -= 1
            if not self._taking[name]:
                del self._taking[name]

    def may_be_free(self, name: str) -> bool:
        """False: a key's or scope's first take is its request's (StageScheduler's hand-out, or
        ScopeThrottle), so its line's waits join the line in Redis at once."""
        return False

    def renewal_due(self, stage: str, lock: StageLock) -> bool:
        """Keys serve many short requests: a permit younger than the renewal interval is renewed at
        the next tick (its lease lasts longer than that), so a key whose requests all end within an
        interval costs no renewal."""
        return lock.renewal_due() or bool(self.waiting(stage))

    async def tick(self, demand: Mapping[str, int] | None = None) -> None:
        """The stages' tick (renew what is held or waited for), then retire keys idle at two ticks
        in a row."""
        await super().tick(demand)
        if self.closed or (self._retiring is not None and not self._retiring.done()):
            return  # the last batch is still being retired: look again at the next tick
        idle = {
            key
            for key, lock in self.locks.items()
            if not lock.busy and not self.waiting(key) and key not in self._taking
        }
        retired = [self._forget(key) for key in idle & self._idle]
        self._idle = idle - self._idle
        if retired:  # in a task of its own: the renewal loop does not wait for it
            self.stats.inc_value(f"{self.stats_prefix}/retired_idle", len(retired))
            self._retiring = asyncio.get_running_loop().create_task(self._retire(retired))

    def _forget(self, key: str) -> StageLock:
        """This process is done with ``key``'s lock object (its retirement in Redis, if any, is the
        caller's)."""
        lock = self.locks.pop(key)
        self.limits.pop(key, None)
        self._stage_by_lock.pop(lock.name, None)
        self.reports.forget(key)
        # retiring unregisters this process: no waiting count left in Redis
        self._sent_waiting.pop(key, None)
        self._idle.discard(key)
        return lock

    def released(self, permit: SlotPermit) -> None:
        """A slot went back: a key's lock that only ever had light grants (no stream set up, no
        registration: nothing in Redis to retire) and now holds and waits for nothing is dropped at
        once, not two ticks later (a broad crawl meets each domain once or a few times: objects that
        live for a tick or two grow the garbage collector's oldest generation)."""
        key = self._stage_by_lock.get(permit.name)
        if key is None:
            return
        lock = self.locks.get(key)
        if (
            lock is not None
            and not lock.busy
            and not lock.queued
            and not self.waiting(key)
            and key not in self._taking
        ):
            self._forget(key)
            self.stats.inc_value(f"{self.stats_prefix}/retired_idle")

    async def _retire(self, locks: list[StageLock]) -> None:
        results = await gather_bounded([lock.aclose(retire=True) for lock in locks], self.fan_out)
        failed = [
            lock.name
            for lock, result in zip(locks, results, strict=True)
            if isinstance(result, BaseException)
        ]
        if failed:  # those locks stay in Redis; whoever uses such a key next retires it
            logger.debug(
                "Could not retire %d key lock(s), e.g. %r: %s", len(failed), failed[0], results
            )

    async def close(self) -> None:
        self.delays.close()  # on every path here: the spider's close, a forced shutdown
        try:
            await super().close()
        finally:
            if self._waiting is not None:  # the keys' one waiting pool (None with a cluster client)
                await self._waiting.aclose()

    async def _free_all(self, pending: set[asyncio.Task[Any]]) -> None:
        """The last batch of retirements ends first (inside close's ``finally``, which gives the
        clients back however close ends)."""
        if self._retiring is not None:
            await asyncio.wait({self._retiring}, timeout=5.0)
        await super()._free_all(pending)
