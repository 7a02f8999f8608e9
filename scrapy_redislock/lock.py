"""The blocking counting lock: ``CountingLock`` over a ``redis.Redis`` client.

Its logic is in :mod:`scrapy_redislock.core`; this front only carries commands to
Redis and runs the optional renewal thread.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import redis

from scrapy_redislock.core import (
    GROUP,
    Call,
    Clock,
    Command,
    LockCore,
    Operation,
    Permit,
    ReadGrant,
    WaitReplicas,
    drive,
    load_scripts,
)
from scrapy_redislock.errors import AcquireTimeout, InvalidArgument

logger = logging.getLogger(__name__)

LostCallback = Callable[[Permit], object]


def log_lost(permit: Permit) -> None:
    logger.warning("lease of %s on lock %r was lost", permit.token, permit.name)


# Detect a silently dead server during a long wait within about 25 s.
KEEPALIVE_OPTIONS = {
    getattr(socket, name): value
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))
    if hasattr(socket, name)
}


def waiting_client(client: Any) -> Any:
    """A client like ``client`` on its own pool whose reads never time out, for ``XREADGROUP BLOCK``.

    A blocked waiter keeps its place in Redis's FIFO only while it stays blocked: cutting a long wait into
    socket-timeout-sized pieces (redis-py's default is 5 s) would send it to the back of the queue each time.
    Cluster clients have a pool per node; for them waits are cut at 80% of the socket timeout (documented).
    """
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return None
    kwargs = dict(pool.connection_kwargs)
    kwargs.update(socket_timeout=None, socket_keepalive=True, socket_keepalive_options=KEEPALIVE_OPTIONS)
    waiting_pool = type(pool)(connection_class=pool.connection_class, max_connections=pool.max_connections, **kwargs)
    return type(client)(connection_pool=waiting_pool)


class LockFront:
    """What both fronts share: validation, the core, the scripts, read-only properties."""

    client_types: tuple[type, ...] = ()

    def __init__(
        self,
        client: Any,
        name: str,
        limit: int | None = None,
        ttl: float = 30.0,
        *,
        key_prefix: str = "redislock",
        reentrant: bool = False,
        auto_renew: bool = False,
        maintain_loop: bool = True,
        on_lost: LostCallback | None = None,
        identity: Mapping[str, Any] | None = None,
        clock: Clock = time.monotonic,
        replicas: int = 0,
    ) -> None:
        if not isinstance(client, self.client_types):
            expected = " or ".join(f"{t.__module__}.{t.__qualname__}" for t in self.client_types)
            raise InvalidArgument(f"client must be a {expected}, got {type(client).__name__}")
        self._waiting_client = waiting_client(client)
        socket_timeout = None
        if self._waiting_client is None and hasattr(client, "get_connection_kwargs"):
            socket_timeout = client.get_connection_kwargs().get("socket_timeout")
        self._core = LockCore.create(
            name,
            limit,
            ttl,
            key_prefix=key_prefix,
            reentrant=reentrant,
            clock=clock,
            identity=identity,
            max_block=None if not socket_timeout else float(socket_timeout) * 0.8,
            replicas=replicas,
        )
        self._client = client
        self._cluster = hasattr(client, "get_node_from_key")
        self._scripts = {n: client.register_script(src) for n, src in load_scripts().items()}
        self.auto_renew = auto_renew
        self.maintain_loop = maintain_loop
        self.on_lost: LostCallback = on_lost or log_lost
        self._callers = 0  # acquire() calls in progress (a wait is served by the loop from its very start)

    name = property(lambda self: self._core.name, doc="The lock's name (the stage).")
    owner = property(lambda self: self._core.owner, doc="This object's owner token in Redis.")
    ttl = property(lambda self: self._core.ttl, doc="Lease seconds (as stored in Redis).")
    keys = property(lambda self: self._core.keys, doc="The lock's Redis keys.")
    renew_interval = property(lambda self: self._core.renew_interval)

    def annotate(self, **fields: Any) -> None:
        """Add fields to this owner's identity in Redis (sent with the next maintain), e.g. waiting=3."""
        self._core.identity.update(fields)

    @property
    def busy(self) -> bool:
        """Holds, waits or has an abandoned wait to clean up: what a maintain() is for."""
        return self._callers > 0 or self._core.busy

    @property
    def held(self) -> list[Permit]:
        """Permits this object holds now."""
        return list(self._core.held.values())

    def _command(self, command: Command) -> Any:
        """Start the redis-py call for a command (a result, or an awaitable in asyncio)."""
        if isinstance(command, ReadGrant):
            client = self._client if command.block_ms is None else (self._waiting_client or self._client)
            return client.xreadgroup(GROUP, command.consumer, {command.key: ">"}, count=1, block=command.block_ms)
        if isinstance(command, Call):
            return self._client.execute_command(*command.args)
        if isinstance(command, WaitReplicas):
            # One connection for both (WAIT counts what its connection wrote); on a cluster, the key's master.
            route = {"target_nodes": self._client.get_node_from_key(command.key)} if self._cluster else {}
            pipe = self._client.pipeline(transaction=False)
            pipe.hset(command.key, command.field, command.value)
            pipe.execute_command("WAIT", command.replicas, command.timeout_ms, **route)
            return pipe.execute()
        return self._scripts[command.name](keys=list(command.keys), args=list(command.args))

    def _loop_needed(self) -> bool:
        """The maintenance loop runs while this object waits, has abandoned waits to clean, or auto-renews permits.

        A waiting process reaps expired leases (a dead holder's slot comes back to whoever waits for it); a
        process that neither holds nor waits sends nothing.
        """
        core = self._core
        needed = self._callers or core.waits_in_flight or core.abandoned or (self.auto_renew and core.held)
        return self.maintain_loop and bool(needed)

    def _loop_permits(self) -> list[Permit] | None:
        """What a loop tick renews: every held permit with auto_renew, else none (the caller renews its own)."""
        return None if self.auto_renew else []

    def _report_lost(self, lost: list[Permit]) -> None:
        for permit in lost:
            try:
                self.on_lost(permit)
            except Exception:
                logger.exception("on_lost callback of lock %r failed", self.name)


class CountingLock(LockFront):
    """A fair, leased counting lock (semaphore) in Redis, for blocking code.

    ``limit`` slots are shared by every process using the same name and prefix;
    ``limit=1`` is a mutex. ``limit=None`` uses the limit already in Redis.
    ``replicas=N``: each grant and release then waits (``WAIT``, up to ttl/3 and at most 1 s) until N replicas
    have it; a grant they do not acknowledge is given back and NotReplicated raised.
    """

    client_types = (redis.Redis, redis.RedisCluster)

    def __init__(self, client: redis.Redis | redis.RedisCluster, *args: Any, **kwargs: Any) -> None:
        super().__init__(client, *args, **kwargs)
        self._local = threading.local()
        self._renewer: threading.Thread | None = None
        self._loop_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()

    def _run(self, op: Operation) -> Any:
        return drive(op, self._command, self.name)

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
            if self._core.abandoned:
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
        """Renew held permits (default: all), free expired leases of others; returns the lost permits."""
        lost: list[Permit] = self._run(self._core.maintain(permits))
        self._report_lost(lost)
        return lost

    def set_limit(self, limit: int) -> int | None:
        """Change the limit for every process at once; returns the previous limit."""
        return self._run(self._core.set_limit(limit))

    def get_limit(self) -> int | None:
        """The limit in Redis now."""
        return self._run(self._core.get_limit())

    def close(self) -> int:
        """Stop renewing and free every slot this object holds; returns how many."""
        self._stop.set()
        self._wake.set()
        renewer = self._renewer
        if renewer is not None and renewer is not threading.current_thread():
            renewer.join()
        self._renewer = None
        freed = int(self._run(self._core.release_all()))
        if self._waiting_client is not None:
            self._waiting_client.close()
        return freed

    def __enter__(self) -> Permit:
        permit = self.acquire()
        self._local.__dict__.setdefault("stack", []).append(permit)
        return permit

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release(self._local.stack.pop())

    def _start_loop(self) -> None:
        with self._loop_lock:
            if not self.maintain_loop or self._renewer is not None or self._stop.is_set():
                return
            self._renewer = threading.Thread(target=self._loop, name=f"redislock-renew-{self.name}", daemon=True)
            self._renewer.start()

    def _loop(self) -> None:
        """Maintain every ttl/3 (at once when woken) while needed; errors are logged and retried, never dropped."""
        idle_ticks = 0
        while True:
            self._wake.wait(self.renew_interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._loop_lock:
                if not self._loop_needed():
                    idle_ticks += 1
                    if idle_ticks >= 2:
                        self._renewer = None
                        return
                    continue
            idle_ticks = 0
            try:
                self.maintain(self._loop_permits())
            except Exception:
                logger.exception("renewing lock %r failed; retrying in %.1f s", self.name, self.renew_interval)


__all__ = ["AcquireTimeout", "CountingLock", "LockFront", "Permit"]
