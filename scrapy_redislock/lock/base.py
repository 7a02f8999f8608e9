"""What the blocking and asyncio locks share: the command runner, argument checks, the core, the
loop's rules; and what all four locks share: the properties read off the core
(:class:`LockShared`), ``with`` and ``async with``.

:class:`LockBase` holds a :class:`~scrapy_redislock.lock.core.LockCore` and says when the
maintenance loop must run; :mod:`~scrapy_redislock.lock.sync` and :mod:`~scrapy_redislock.lock.aio`
only add how they wait and loop.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import redis.asyncio
import redis.exceptions

from scrapy_redislock._redis import (
    ProjectScript,
    ScriptBatch,
    ScriptMode,
    function_missing,
    script_refused,
    text,
    without_flags,
)
from scrapy_redislock.errors import InvalidArgument
from scrapy_redislock.lock.core import ALLOW_OOM, Clock, LockCore, lock_scripts
from scrapy_redislock.lock.permit import GROUP, LockKeys, Permit
from scrapy_redislock.lock.protocol import (
    Call,
    Command,
    MayEvict,
    ReadGrant,
    RunScript,
    WaitReplicas,
)

logger = logging.getLogger(__name__)

LostCallback = Callable[[Permit], object]
P = TypeVar("P")  # the permit type of a lock: Permit, or QuorumPermit
P_co = TypeVar("P_co", covariant=True)


def log_lost(permit: Permit) -> None:
    logger.warning("lease of %s on lock %r was lost", permit.token, permit.name)


# Detect a silently dead server during a long wait within about 25 s.
KEEPALIVE_OPTIONS = {
    getattr(socket, name): value
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))
    if hasattr(socket, name)
}


GUARDED = "redislock_guarded"  # on a waiting connection: the locks whose guard ran on it since it (re)connected
# locks remembered per connection (a broad crawl meets many keys); past it, guard again
GUARDED_MOST = 10_000


def _fresh(connection: Any) -> None:
    setattr(connection, GUARDED, set())


def _on_connect(previous: Callable[[Any], Any] | None) -> Callable[[Any], None]:
    """What a waiting connection runs on every (re)connect: the usual handshake, then it counts as
    unguarded."""

    def on_connect(connection: Any) -> None:
        if previous:
            previous(connection)
        else:
            connection.on_connect()
        _fresh(connection)

    return on_connect


def _aon_connect(previous: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    async def on_connect(connection: Any) -> None:
        result = previous(connection) if previous else connection.on_connect()
        if asyncio.iscoroutine(result):
            await result
        _fresh(connection)

    return on_connect


def waiting_client(client: Any) -> Any:
    """A client like ``client`` on its own pool whose reads never time out, for ``XREADGROUP
    BLOCK``.

    A blocked waiter keeps its place in Redis's FIFO only while it stays blocked: cutting a long
    wait into socket-timeout-sized pieces (redis-py's default is 5 s) would send it to the back of
    the queue each time. Its connections forget which locks were guarded on them whenever they
    connect again (see :class:`ReadGrant`), and the runner does not retry a read on them: a broken
    wait ends, and the lock waits again with a new consumer. Cluster clients have a pool per node;
    for them waits are cut at 80% of the socket timeout (documented). Whoever makes it closes it
    (``close()`` / ``aclose()``), which closes its pool.
    """
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return None
    kwargs = dict(pool.connection_kwargs)
    kwargs.update(
        socket_timeout=None, socket_keepalive=True, socket_keepalive_options=KEEPALIVE_OPTIONS
    )
    hook = _aon_connect if isinstance(pool, redis.asyncio.ConnectionPool) else _on_connect
    kwargs.update(redis_connect_func=hook(kwargs.get("redis_connect_func")))
    kwargs.update(connection_class=pool.connection_class, max_connections=pool.max_connections)
    # a Sentinel pool: it finds the master through the same sentinels
    if hasattr(pool, "sentinel_manager"):
        kwargs.pop("connection_pool", None)  # its own proxy, which the new pool sets to itself
        waiting_pool = type(pool)(
            pool.service_name, pool.sentinel_manager, is_master=pool.is_master, **kwargs
        )
    else:
        waiting_pool = type(pool)(**kwargs)
    waiting = type(client)(connection_pool=waiting_pool)
    # Its pool is its own: closing the client (close() / aclose(), or losing it) disconnects the
    # pool too. A client given a pool leaves it open by default, and every waiting connection would
    # stay open until garbage collection.
    waiting.auto_close_connection_pool = True
    return waiting


def eviction_policy(info: Any) -> str:
    """``maxmemory_policy`` of an ``INFO memory`` reply (a cluster client's: one per node, the
    first that evicts); ``noeviction`` when it is not there."""
    if isinstance(info, bytes | str):
        found = re.search(r"maxmemory_policy:(\S+)", text(info))
        return found.group(1) if found else "noeviction"
    if isinstance(info, dict) and "maxmemory_policy" in info:
        return str(text(info["maxmemory_policy"]))
    if isinstance(info, dict):  # per node
        policies = [eviction_policy(node) for node in info.values()]
        return next((p for p in policies if p != "noeviction"), "noeviction")
    return "noeviction"


def _read_args(command: ReadGrant) -> tuple[Any, ...]:
    return ("XREADGROUP", "GROUP", GROUP, command.consumer, "COUNT", 1, "BLOCK", command.block_ms, "STREAMS",
            command.key, ">")  # fmt: skip


def _get_connection(pool: Any) -> Any:
    try:
        return pool.get_connection()
    except TypeError:  # redis-py before 5.3 wants a command name
        return pool.get_connection("XREADGROUP")


class CommandRunner:
    """Carries lock commands to one redis-py client: the one executor of
    :func:`~scrapy_redislock.lock.protocol.drive` and
    :func:`~scrapy_redislock.lock.protocol.adrive`.

    Called with a command, it starts the redis-py call and returns its result (blocking client) or
    an awaitable (asyncio client). Scripts are registered on first use (EVALSHA, falling back to
    EVAL); blocking reads go to ``waiting_client`` when given (see :func:`waiting_client`), on a
    connection the runner takes from its pool so that the ``guard`` script runs on that very
    connection first (see :class:`ReadGrant`).
    """

    def __init__(self, client: Any, waiting: Any = None) -> None:
        self.client = client
        self.waiting = waiting
        self.cluster = hasattr(client, "get_node_from_key")
        self.asyncio = isinstance(client, redis.asyncio.Redis | redis.asyncio.RedisCluster)
        self.scripts: dict[str, ProjectScript] = {}
        # the scripts' EVALSHAs of one loop turn go out together (not on a cluster, nor on a client
        # of a single connection, which a second would bypass: see ScriptBatch)
        batches = self.asyncio and not self.cluster and getattr(client, "connection", None) is None
        self.batch = ScriptBatch(client) if batches else None
        self.mode = (
            ScriptMode()
        )  # EVALSHA, or FCALL of the functions an admin loaded (see _redis.py)
        self.guard_unloaded = True  # cluster reads: SCRIPT LOAD the guard before the first pipeline
        self.may_evict: bool | None = None  # the server's maxmemory-policy evicts keys (read once)
        # the server takes Lua flags (Redis 7+): ALLOW_OOM's scripts carry ``allow-oom``
        self.flags = True

    def _evicts(self) -> Any:
        """Answer :class:`MayEvict`: ``INFO memory``'s ``maxmemory_policy`` once per runner."""
        if self.may_evict is not None:
            return self._answer(self.may_evict)
        args = ("INFO", "memory")
        if self.asyncio:

            async def read() -> bool:
                try:
                    reply = await self.client.execute_command(*args)
                except redis.exceptions.ResponseError as exc:
                    return self._policy_of(None, exc)
                return self._policy_of(reply, None)

            return read()
        try:
            reply = self.client.execute_command(*args)
        except redis.exceptions.ResponseError as exc:
            return self._policy_of(None, exc)
        return self._policy_of(reply, None)

    def _answer(self, value: Any) -> Any:
        if not self.asyncio:
            return value

        async def now() -> Any:
            return value

        return now()

    def _policy_of(self, reply: Any, error: Exception | None) -> bool:
        if error is not None:
            logger.warning(
                "Could not read Redis's maxmemory-policy (%s): assumed noeviction (docs/failures.md)",
                error,
            )
            self.may_evict = False
            return False
        policy = eviction_policy(reply)
        self.may_evict = policy != "noeviction"
        if self.may_evict:
            logger.warning(
                "Redis may evict keys (maxmemory-policy %s): key locks skip their light path (docs/failures.md)",
                policy,
            )
        return self.may_evict

    def _registered(self, name: str) -> ProjectScript:
        script = self.scripts.get(name)
        if script is None:
            source = lock_scripts()[name]
            if not self.flags:
                source = without_flags(source)
            script = self.scripts[name] = ProjectScript(self.client, source, self.mode, self.batch)
        return script

    def _unflagged(self, name: str, exc: redis.exceptions.ResponseError) -> bool:
        """Whether ``exc`` is a server that cannot compile Lua flags (Redis 6.2): its scripts are
        registered again without them, and the call may be made again."""
        if not (name in ALLOW_OOM and "compiling" in str(exc)):
            return False
        if self.flags:  # once: calls already under way fail the same way and are made again too
            self.flags = False
            for flagged in ALLOW_OOM:
                self.scripts.pop(flagged, None)
        return True

    def _script(self, command: RunScript) -> Any:
        def call() -> Any:
            script = self._registered(command.name)
            return script(keys=command.keys, args=command.args)  # it makes its own lists

        if self.asyncio:
            return self._ascript(command)
        try:
            return call()
        except redis.exceptions.ResponseError as exc:
            if not self._unflagged(command.name, exc):
                raise
        return call()

    async def _ascript(self, command: RunScript) -> Any:
        """:meth:`_script` on an asyncio client (a method, not a closure made per command)."""
        try:
            return await self._registered(command.name)(keys=command.keys, args=command.args)
        except redis.exceptions.ResponseError as exc:
            if not self._unflagged(command.name, exc):
                raise
        return await self._registered(command.name)(keys=command.keys, args=command.args)

    def _guard_args(self, command: ReadGrant) -> tuple[Any, ...]:
        guard = self._registered("guard")
        keys, args = [command.key, command.meta], ["1" if command.durable else "0"]
        if self.mode.functions:
            return guard.fcall_args(keys, args)
        return ("EVALSHA", guard.sha, len(keys), *keys, *args)

    def _guard_here(self, command: ReadGrant) -> Any:
        """The guard through the client (EVALSHA, or FCALL once EVALSHA is refused: this finds
        which); the guard on the waiting connection follows in that mode."""
        return self._registered("guard")(
            keys=[command.key, command.meta], args=["1" if command.durable else "0"]
        )

    def _load_guard(self) -> tuple[Any, ...]:
        """SCRIPT LOAD, as redis-py's scripts do after NOSCRIPT (the crawler ACL role has no
        EVAL)."""
        return ("SCRIPT", "LOAD", self._registered("guard").script)

    def _mode_changed(self, exc: BaseException) -> bool:
        """The guard on a waiting connection failed for the way scripts run: EVALSHA refused to
        this user, or its function gone (then the mode is found again through the client)."""
        if self.mode.functions and function_missing(exc):
            self.mode.functions = False
            return True
        return not self.mode.functions and script_refused(exc)

    @staticmethod
    def _needs_guard(connection: Any, command: ReadGrant) -> bool:
        guarded = getattr(connection, GUARDED, None)
        if guarded is None or len(guarded) >= GUARDED_MOST:
            _fresh(connection)
            return True
        return command.key not in guarded

    def _read(self, command: ReadGrant) -> Any:
        pool = getattr(self.waiting, "connection_pool", None)
        if pool is None:
            return self._read_piped(command)
        return (self._aread_on if self.asyncio else self._read_on)(pool, command)

    def _read_on(self, pool: Any, command: ReadGrant) -> Any:
        connection = _get_connection(pool)
        try:
            if self._needs_guard(connection, command):
                try:
                    connection.send_command(*self._guard_args(command))
                    connection.read_response()
                except redis.exceptions.NoScriptError:
                    try:
                        connection.send_command(*self._load_guard())
                        connection.read_response()
                    except redis.exceptions.NoPermissionError as exc:
                        if not script_refused(exc):
                            raise
                        self._guard_here(command)  # FCALL, or the error naming load-functions
                    connection.send_command(*self._guard_args(command))
                    connection.read_response()
                except redis.exceptions.ResponseError as exc:
                    if not self._mode_changed(exc):
                        raise
                    self._guard_here(command)
                    connection.send_command(*self._guard_args(command))
                    connection.read_response()
                getattr(connection, GUARDED).add(command.key)
            connection.send_command(*_read_args(command))
            return connection.read_response()
        except redis.exceptions.ResponseError:
            raise  # an error reply: the connection is in step
        except (
            OSError,
            ValueError,
        ) as exc:  # its socket closed under it (another thread disconnected the pool)
            connection.disconnect()
            raise redis.exceptions.ConnectionError(f"the wait's connection broke: {exc!r}") from exc
        except BaseException:
            connection.disconnect()  # a reply may still come: nobody must read it as theirs
            raise
        finally:
            pool.release(connection)

    async def _aread_on(self, pool: Any, command: ReadGrant) -> Any:
        connection = await _get_connection(pool)
        try:
            if self._needs_guard(connection, command):
                try:
                    await connection.send_command(*self._guard_args(command))
                    await connection.read_response()
                except redis.exceptions.NoScriptError:
                    try:
                        await connection.send_command(*self._load_guard())
                        await connection.read_response()
                    except redis.exceptions.NoPermissionError as exc:
                        if not script_refused(exc):
                            raise
                        await self._guard_here(command)  # FCALL, or the error naming load-functions
                    await connection.send_command(*self._guard_args(command))
                    await connection.read_response()
                except redis.exceptions.ResponseError as exc:
                    if not self._mode_changed(exc):
                        raise
                    await self._guard_here(command)
                    await connection.send_command(*self._guard_args(command))
                    await connection.read_response()
                getattr(connection, GUARDED).add(command.key)
            await connection.send_command(*_read_args(command))
            return await connection.read_response()
        except redis.exceptions.ResponseError:
            raise
        except BaseException:
            await connection.disconnect(nowait=True)
            raise
        finally:
            await pool.release(connection)

    def _read_piped(self, command: ReadGrant) -> Any:
        """A cluster client has no pool to take a connection from: the guard goes in one pipeline
        with the read (one node, one connection). If the guard did not run (NOSCRIPT after a
        restart: the script is loaded before the next try), a grant the read may have got is not
        used: the error ends the wait as a lost reply does."""

        def pipeline() -> Any:
            pipe = self.client.pipeline(transaction=False)
            pipe.execute_command(*self._guard_args(command))
            pipe.execute_command(*_read_args(command))
            return pipe

        def check(replies: list[Any]) -> Any:
            guard, reply = replies
            if isinstance(guard, Exception):
                self.guard_unloaded = isinstance(guard, redis.exceptions.NoScriptError)
                if self._mode_changed(guard):
                    self.guard_unloaded = True  # found again before the next try
                raise redis.exceptions.ConnectionError(f"guard before the read failed: {guard}")
            if isinstance(reply, Exception):
                raise reply
            return reply

        # Before the first pipeline (and after a NOSCRIPT): SCRIPT LOAD the guard, or, when this
        # user may not, run it through the client once (which finds that it runs FCALL).
        source = self._registered("guard").script
        if self.asyncio:

            async def run() -> Any:
                if self.guard_unloaded:
                    try:
                        if not self.mode.functions:
                            await self.client.script_load(source)
                    except redis.exceptions.NoPermissionError as exc:
                        if not script_refused(exc):
                            raise
                        await self._guard_here(command)
                    self.guard_unloaded = False
                return check(await pipeline().execute(raise_on_error=False))

            return run()
        if self.guard_unloaded:
            try:
                if not self.mode.functions:
                    self.client.script_load(source)
            except redis.exceptions.NoPermissionError as exc:
                if not script_refused(exc):
                    raise
                self._guard_here(command)
            self.guard_unloaded = False
        return check(pipeline().execute(raise_on_error=False))

    def __call__(self, command: Command) -> Any:
        if type(command) is RunScript:  # nearly every command: no other check first
            return self._script(command)
        client = self.client
        if isinstance(command, ReadGrant):
            return self._read(command)
        if isinstance(command, Call):
            return client.execute_command(*command.args)
        if isinstance(command, MayEvict):
            return self._evicts()
        if isinstance(command, WaitReplicas):
            # One connection for both (WAIT counts what its connection wrote); on a cluster, the
            # key's master.
            route = {"target_nodes": client.get_node_from_key(command.key)} if self.cluster else {}
            pipe = client.pipeline(transaction=False)
            pipe.hset(command.key, command.field, command.value)
            pipe.execute_command("WAIT", command.replicas, command.timeout_ms, **route)
            return pipe.execute()
        return self._script(command)


class CoreState(Protocol[P_co]):
    """What :class:`LockShared` reads of a core: a ``LockCore``, or a ``QuorumCore``."""

    name: str
    owner: str
    ttl: float

    @property
    def renew_interval(self) -> float: ...

    @property
    def keys(self) -> LockKeys: ...

    @property
    def held(self) -> Mapping[Any, P_co]: ...


class LockShared(Generic[P]):
    """What all four lock classes read off their core, and how they tell ``on_lost``; a subclass sets
    ``_core``, ``on_lost`` and ``auto_renew``, and names its logger and the whole message logged
    when ``on_lost`` fails."""

    _core: CoreState[P]
    on_lost: Callable[[P], object]
    auto_renew: bool
    _logger: ClassVar[logging.Logger]
    _callback_failed: ClassVar[str]

    @property
    def name(self) -> str:
        """The lock's name (the stage)."""
        return self._core.name

    @property
    def owner(self) -> str:
        """This object's owner token in Redis (a quorum lock's is the same on every master)."""
        return self._core.owner

    @property
    def ttl(self) -> float:
        """Lease seconds (as stored in Redis; a quorum lock's, on each master)."""
        return self._core.ttl

    @property
    def renew_interval(self) -> float:
        """ttl/3, at most 1 s."""
        return self._core.renew_interval

    @property
    def keys(self) -> LockKeys:
        """The lock's Redis keys (a quorum lock's are the same on every master)."""
        return self._core.keys

    @property
    def held(self) -> list[P]:
        """Permits this object holds now."""
        return list(self._core.held.values())

    def _report_lost(self, lost: list[P]) -> None:
        """Call ``on_lost`` for each lost permit; one that raises is logged, the rest still called."""
        for permit in lost:
            try:
                self.on_lost(permit)
            except Exception:
                self._logger.exception(self._callback_failed, self.name)


class LockBase(LockShared[Permit]):
    """What the blocking and asyncio locks share: validation, the core, the scripts, the loop's
    rules (what all four locks share is :class:`LockShared`'s)."""

    client_types: tuple[type, ...] = ()
    _core: LockCore
    _logger = logger
    _callback_failed = "on_lost callback of lock %r failed"

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
        durable: bool = False,
        waiting: Any = None,
        light: bool = False,
        runner: CommandRunner | None = None,
    ) -> None:
        if not isinstance(client, self.client_types):
            expected = " or ".join(f"{t.__module__}.{t.__qualname__}" for t in self.client_types)
            raise InvalidArgument(f"client must be a {expected}, got {type(client).__name__}")
        # ``waiting``: a client made by waiting_client() and shared by many locks (one per key met
        # at run time would each open a pool of their own); its owner closes it.
        self._owns_waiting_client = waiting is None
        self._waiting_client = waiting if waiting is not None else waiting_client(client)
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
            durable=durable,
            light=light,
        )
        #: What drive() / adrive() send the commands through; the quorum lock drives it per master.
        #: ``runner``: one shared by many locks of one client and waiting client (the locks of keys
        #: met at run time: each would register every script again).
        self.runner: Callable[[Command], Any] = runner or CommandRunner(
            client, self._waiting_client
        )
        self.auto_renew = auto_renew
        self.maintain_loop = maintain_loop
        self.on_lost = on_lost or log_lost
        self._idle_ticks = 0  # loop ticks in a row with nothing to do
        # acquire() calls in progress (a wait is served by the loop from its very start)
        self._callers = 0

    @property
    def core(self) -> LockCore:
        """The sans-IO state this lock drives (the quorum lock drives one per master)."""
        return self._core

    @property
    def reported_limit(self) -> int | None:
        """The lock's limit in Redis as its last renewal reported it (None before one)."""
        return self._core.reported_limit

    @property
    def owners_seen(self) -> list[str] | None:
        """The owners its last renewal saw alive (this one among them; None before one, or past
        ROSTER_MAX)."""
        return self._core.registration.roster

    def annotate(self, **fields: Any) -> None:
        """Add fields to this owner's identity in Redis (sent with the next maintain), e.g.
        waiting=3."""
        self._core.identity.update(fields)

    @property
    def busy(self) -> bool:
        """Holds, waits or has an abandoned wait to clean up: what a maintain() is for."""
        return self._callers > 0 or self._core.busy

    @property
    def queued(self) -> bool:
        """Whether this object ever set the lock up or registered in Redis (a light grant does
        neither: lock/light.py): only then can it have a wait's late grant, or a registration, to
        free."""
        return self._core.registration.ever

    def renewal_due(self) -> bool:
        """Whether a maintain() is needed now: a wait or a clean-up in progress, or a permit whose
        lease began more than a renewal interval ago (counted from the ask, not the reply: a reply
        can come late). A younger lease lasts at least two more intervals: the next tick renews it,
        so requests shorter than an interval cost no renewal at all."""
        core = self._core
        if self._callers or core.waits_in_flight or core.consumers.abandoned:
            return True
        oldest = core.clock() - core.renew_interval
        return any(permit.leased_at <= oldest for permit in core.held.values())

    def _loop_needed(self) -> bool:
        """The maintenance loop runs while this object waits, has abandoned waits to clean, or
        auto-renews permits.

        A waiting process reaps expired leases (a dead holder's slot comes back to whoever waits for
        it); a process that neither holds nor waits sends nothing.
        """
        core = self._core
        needed = (
            self._callers
            or core.waits_in_flight
            or core.consumers.abandoned
            or (self.auto_renew and core.held)
        )
        return self.maintain_loop and bool(needed)

    def _loop_idle(self) -> bool:
        """Count a loop tick with nothing to do (a loop stops after two in a row); False when the
        tick has work."""
        if self._loop_needed():
            self._idle_ticks = 0
            return False
        self._idle_ticks += 1
        return True

    def _loop_permits(self) -> list[Permit] | None:
        """What a loop tick renews: every held permit with auto_renew, else none (the caller renews
        its own)."""
        return None if self.auto_renew else []


class ThreadContext(Generic[P]):
    """``with lock as permit``: acquire, and on exit release that permit; one stack per thread, so
    nesting works."""

    _local: threading.local
    acquire: Callable[[], P]
    release: Callable[[P], object]

    def __enter__(self) -> P:
        permit = self.acquire()
        self._local.__dict__.setdefault("stack", []).append(permit)
        return permit

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release(self._local.stack.pop())


class TaskContext(Generic[P]):
    """``async with lock as permit``: the same per asyncio task."""

    _context: dict[asyncio.Task[Any] | None, list[P]]
    acquire: Callable[[], Awaitable[P]]
    release: Callable[[P], Awaitable[object]]

    async def __aenter__(self) -> P:
        permit = await self.acquire()
        self._context.setdefault(asyncio.current_task(), []).append(permit)
        return permit

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task = asyncio.current_task()
        stack = self._context[task]
        permit = stack.pop()
        if not stack:
            del self._context[task]
        await self.release(permit)
