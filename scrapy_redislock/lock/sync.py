"""The blocking counting lock: ``CountingLock`` over a ``redis.Redis`` client.

Its logic is in :mod:`scrapy_redislock.lock.core`; this class only carries commands to Redis
(through
:class:`~scrapy_redislock.lock.base.CommandRunner`) and runs the optional maintenance thread.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, TypeVar

import redis

from scrapy_redislock.errors import AcquireTimeout
from scrapy_redislock.lock.base import LockBase, ThreadContext
from scrapy_redislock.lock.permit import Permit
from scrapy_redislock.lock.protocol import Operation, drive

logger = logging.getLogger(__name__)

T = TypeVar("T")


class CountingLock(ThreadContext[Permit], LockBase):
    """A fair, leased counting lock (semaphore) in Redis, for blocking code.

    ``limit`` slots are shared by every process using the same name and prefix; ``limit=1`` is a
    mutex. ``limit=None`` uses the limit already in Redis. ``replicas=N``: each grant and release
    then waits (``WAIT``, up to ttl/3 and at most 1 s) until N replicas have it; a grant they do not
    acknowledge is given back and NotReplicated raised.
    """

    client_types = (redis.Redis, redis.RedisCluster)

    def __init__(self, client: redis.Redis | redis.RedisCluster, *args: Any, **kwargs: Any) -> None:
        super().__init__(client, *args, **kwargs)
        self._local = threading.local()
        self._renewer: threading.Thread | None = None
        self._loop_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()

    def _run(self, op: Operation[T]) -> T:
        return drive(op, self.runner, self.name)

    def acquire(self, timeout: float | None = None) -> Permit:
        """Wait for a slot (first come, first served); AcquireTimeout after ``timeout`` s."""
        with self._loop_lock:
            self._callers += 1
        self._start_loop()  # a waiter reaps expired leases too, or it could wait for a dead holder forever
        try:
            return self._run(self._core.acquire(timeout, holder=threading.get_ident()))
        finally:
            with self._loop_lock:
                self._callers -= 1
            if self._core.consumers.abandoned:
                self._wake.set()  # free what the broken wait may have been handed now, not in a lease

    def try_acquire(self) -> Permit | None:
        """A slot if one is free now (expired leases are freed first), else None."""
        permit = self._run(self._core.acquire(None, blocking=False, holder=threading.get_ident()))
        if permit is not None and self.auto_renew:
            self._start_loop()
        return permit

    def release(self, permit: Permit) -> bool:
        """Give a slot back: True if it was still held, False for a stale permit."""
        return bool(self._run(self._core.release(permit)))

    def renew(self, permit: Permit) -> None:
        """Extend the permit's lease; raises LockLost if the lease is gone."""
        self._run(self._core.renew(permit))

    def maintain(self, permits: list[Permit] | None = None) -> list[Permit]:
        """Renew held permits (default: all), free expired leases of others; returns the lost
        permits."""
        lost: list[Permit] = self._run(self._core.maintain(permits))
        self._report_lost(lost)
        return lost

    def set_limit(self, limit: int) -> int | None:
        """Change the limit for every process at once; returns the previous limit."""
        return self._run(self._core.set_limit(limit))

    def get_limit(self) -> int | None:
        """The limit in Redis now."""
        return self._run(self._core.get_limit())

    def close(self, retire: bool = False) -> int:
        """Stop renewing and free every slot this object holds; returns how many.

        ``retire=True`` also deletes the lock from Redis when nobody else uses it (see
        :meth:`LockCore.retire <scrapy_redislock.lock.core.LockCore.retire>`).
        """
        self._stop.set()
        self._wake.set()
        renewer = self._renewer
        if renewer is not None and renewer is not threading.current_thread():
            renewer.join()
        self._renewer = None
        try:
            if retire:
                freed, _deleted = self._run(self._core.retire())
                return int(freed)
            return int(self._run(self._core.release_all()))
        finally:  # its waiting connections are closed even when Redis could not be told (given ones: their owner's)
            if self._waiting_client is not None and self._owns_waiting_client:
                self._waiting_client.close()

    def _start_loop(self) -> None:
        with self._loop_lock:
            if not self.maintain_loop or self._renewer is not None or self._stop.is_set():
                return
            self._renewer = threading.Thread(
                target=self._loop, name=f"redislock-renew-{self.name}", daemon=True
            )
            self._renewer.start()

    def _loop(self) -> None:
        """Maintain every ttl/3 (at once when woken) while needed; errors are logged and retried,
        never dropped."""
        while True:
            self._wake.wait(self.renew_interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._loop_lock:
                if self._loop_idle():
                    if self._idle_ticks >= 2:
                        self._renewer = None
                        return
                    continue
            try:
                self.maintain(self._loop_permits())
            except Exception:
                logger.exception(
                    "renewing lock %r failed; retrying in %.1f s", self.name, self.renew_interval
                )


__all__ = ["AcquireTimeout", "CountingLock", "Permit"]
