"""What every layer needs of Redis and nothing else: decoding replies, checking arguments, loading
Lua, backing off.

Imports neither Scrapy nor Twisted and reads no settings. Lua scripts live as package data, one file
per script, in a ``scripts`` folder beside the code that runs them (:func:`load_scripts`), so each
part loads only its own.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import itertools
import math
import re
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis
import redis.asyncio
import redis.exceptions
from redis.backoff import EqualJitterBackoff
from redis.crc import key_slot

from scrapy_redislock.errors import InvalidArgument

# A client of one Redis (standalone, Sentinel) or of a Redis Cluster: what the project connects
# with.
RedisClient = redis.Redis | redis.RedisCluster
AsyncRedisClient = redis.asyncio.Redis | redis.asyncio.RedisCluster


def text(value: Any) -> Any:
    """Decode bytes replies, so clients with or without decode_responses look alike."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list | tuple):
        return [text(v) for v in value]
    return value


# C0 and C1 controls, DEL, and the Unicode marks that reorder or hide text (bidi overrides, line
# separators): what a name read from Redis must not carry to a terminal or a log.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")


def printable(value: object, keep: str = "") -> str:
    """``str(value)`` with every control character escaped (ESC as ``\\x1b``), but those in
    ``keep`` (e.g. "\\n" for whole lines of output): anything a crawler wrote to Redis (a stage,
    holder, host, spider, worker or queue name, a dead letter) may carry terminal escape sequences;
    everything printed to a terminal or a log goes through here."""
    return _CONTROLS.sub(
        lambda m: m.group() if m.group() in keep else m.group().encode("unicode_escape").decode(),
        str(value),
    )


def check_name(name: object, what: str = "name") -> str:
    if not isinstance(name, str) or not name or "{" in name or "}" in name:
        raise InvalidArgument(f"{what} must be a non-empty string without braces, got {name!r}")
    return name


def hash_tag(key: str) -> str:
    """A hash tag for ``key``'s Redis Cluster slot: what Redis Cluster hashes of it (its hash tag,
    the first ``{...}`` with something inside, else the whole key). A key of ours that a script
    uses beside a key the user named (a scrapy-redis queue, a start-URL feed) is tagged with this,
    so that both are in one hash slot. A whole key with a ``}`` would end our tag early (``{a}b}``
    hashes ``a``): the smallest number that hashes to the key's slot instead."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    if end > start + 1:
        return key[start + 1 : end]
    if "}" not in key:
        return key
    return _slot_tag(key_slot(key.encode()))


@functools.cache
def _slot_tag(slot: int) -> str:
    """The smallest number, as text, in Redis Cluster slot ``slot`` (found within about 100,000)."""
    return next(str(n) for n in itertools.count() if key_slot(str(n).encode()) == slot)


# The most slots a lock (stage, key, worker stage) may have. A lock is one Redis stream entry per slot
# and a resize adds or deletes one entry per slot, inside one script that blocks the whole server: at
# 1000, a resize from 3 to the maximum and back holds a concurrent PING up about 10 ms at worst (measured
# on a loaded 2-core machine, docs/security.md); 10,000 held it over 100 ms. A stage that needs more
# concurrency than this is not capped (limit None). The Lua scripts refuse more too (MAX_LIMIT in
# lock/scripts/_lib.lua, kept equal by a test).
MAX_LIMIT = 1000


def check_limit(limit: object, what: str = "limit") -> int:
    """A limit: an integer from 0 to MAX_LIMIT; InvalidArgument naming ``what`` and the value."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= MAX_LIMIT:
        shown = (
            repr(limit) if not isinstance(limit, int) or abs(limit) < 10**40 else "a huge integer"
        )
        raise InvalidArgument(f"{what} must be an integer from 0 to {MAX_LIMIT}, got {shown}")
    return limit


def check_ttl(ttl: object, what: str = "ttl") -> float:
    if (
        isinstance(ttl, bool)
        or not isinstance(ttl, int | float)
        or not math.isfinite(ttl)
        or ttl < 0.001
    ):
        raise InvalidArgument(f"{what} must be a number of seconds >= 0.001, got {ttl!r}")
    return float(ttl)


def check_flag(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{what} must be True or False, got {value!r}")
    return value


def check_timeout(timeout: object, what: str = "timeout") -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
        raise InvalidArgument(f"{what} must be None or a number >= 0, got {timeout!r}")
    return float(timeout)


@functools.cache
def load_scripts(package: str, names: tuple[str, ...], lib: str | None = None) -> dict[str, str]:
    """Lua sources by name from ``<package>/scripts/``, each with ``<lib>.lua`` in front of it when
    given."""
    folder = resources.files(package) / "scripts"
    prelude = (folder / f"{lib}.lua").read_text(encoding="utf-8") + "\n" if lib else ""
    return {name: prelude + (folder / f"{name}.lua").read_text(encoding="utf-8") for name in names}


# -- scripts as Redis functions ---------------------------------------------------------------------
# A role that may SCRIPT LOAD may run any Lua (SCRIPT LOAD "while true do end", then EVALSHA): the
# least-privilege roles (cli/acl.py) have neither, only FCALL of the functions an admin loaded
# (``load-functions``: FUNCTION LOAD of :func:`function_library`, which Redis keeps in RDB and AOF and
# replicates, as it does not keep scripts). A client runs EVALSHA as before, and FCALL once EVALSHA is
# refused to its user (:class:`ProjectScript`): no command more for anyone else.

FUNCTION_PREFIX = "redislock_"
LOAD_FUNCTIONS = "python -m scrapy_redislock load-functions --url <an admin's URL>"


def function_name(source: str) -> str:
    """The function that runs one script: ``redislock_<sha1 of its source>``, the sha EVALSHA uses,
    so a function is exactly its source (another version of the project has other names)."""
    return FUNCTION_PREFIX + hashlib.sha1(source.encode("utf-8")).hexdigest()


# A script's first line may give Redis 7's script flags (``allow-oom``: it runs while Redis is out of
# memory); Redis 6.2 cannot compile it, and its callers run the script without it (without_flags).
FLAGS_LINE = "#!lua flags="


def script_flags(source: str) -> list[str]:
    """The flags of a script's first line (none without one)."""
    if not source.startswith(FLAGS_LINE):
        return []
    return source[len(FLAGS_LINE) : source.index("\n")].split(",")


def without_flags(source: str) -> str:
    """The script without its flags line (for Redis 6.2)."""
    return source[source.index("\n") + 1 :] if source.startswith(FLAGS_LINE) else source


def function_library(sources: Iterable[str]) -> tuple[str, str]:
    """(library name, FUNCTION LOAD text) of the scripts: one function per script, its body the
    script's (KEYS and ARGV as the function's arguments) and its flags the script's; the library is
    named after them all."""
    named = sorted({function_name(source): source for source in sources}.items())
    tag = hashlib.sha1("".join(name for name, _ in named).encode()).hexdigest()[:16]
    library = f"{FUNCTION_PREFIX}{tag}"
    parts = [f"#!lua name={library}"]
    for name, source in named:
        flags = ", ".join(f"'{flag}'" for flag in script_flags(source))
        parts.append(
            f"redis.register_function{{function_name='{name}', callback=function(KEYS, ARGV)\n"
            f"{without_flags(source)}\nend, flags={{{flags}}}}}"
        )
    return library, "\n".join(parts) + "\n"


def script_refused(exc: BaseException) -> bool:
    """EVALSHA or SCRIPT LOAD refused to this user (ACL)."""
    message = str(exc)
    return isinstance(exc, redis.exceptions.NoPermissionError) and (
        "'evalsha'" in message or "'script|load'" in message or "'script'" in message
    )


def function_missing(exc: BaseException) -> bool:
    """FCALL of a function Redis does not have (not loaded, flushed, a server before 7.0)."""
    message = str(exc)
    return isinstance(exc, redis.exceptions.ResponseError) and (
        "Function not found" in message or "unknown command" in message
    )


def _fcall_refused(exc: BaseException) -> bool:
    return isinstance(exc, redis.exceptions.NoPermissionError) and "'fcall'" in str(exc)


def _not_loaded(
    refused: BaseException, missing: BaseException
) -> redis.exceptions.NoPermissionError:
    return redis.exceptions.NoPermissionError(
        f"this user may not load scripts ({refused}) and the project's functions are not loaded ({missing}): an admin loads them with `{LOAD_FUNCTIONS}`"  # noqa: E501
    )


def is_default_user(client: Any) -> bool:
    """Whether ``client`` connects as Redis's default user (no ``username``, or "default"): one that
    may load scripts unless an admin said otherwise; a named user is an ACL role (or an admin)."""
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    return kwargs.get("username") in (None, "default")


class ScriptMode:
    """How one client runs the project's scripts: ``functions`` True once EVALSHA was refused and
    FCALL worked (then FCALL only, until a function is missing)."""

    def __init__(self) -> None:
        self.functions = False


# redis-py before 5.3 names a command to lend a connection for; later ones warn when given one
_LEND: tuple[str, ...] = (
    ()
    if inspect.signature(redis.asyncio.ConnectionPool.get_connection)
    .parameters["command_name"]
    .default
    is None
    else ("EVALSHA",)
)

_Asked = tuple[tuple[Any, ...], "asyncio.Future[Any]"]


class ScriptBatch:
    """The EVALSHAs one asyncio runner is asked for in one turn of the event loop: the first goes
    at once, as the client sends any command (a stage's release, alone in its turn, waits for
    nothing: sent a turn later, it came back 0.6 ms later and cost a capped stage 0.5% of Scrapy's
    ceiling); the others are written to one connection together at the next turn and their replies
    read in order, one round trip instead of one each. A broad crawl asks for several a turn (the
    takes of the requests one engine pass lets go, the releases of the answers one turn read), and
    a round trip costs the client more CPU than a script's own work. Not a pipeline: redis-py's
    would give one connection error to callers whose replies it had read already, and its retry
    would run their scripts again. Here each caller gets its own reply or error; a connection error
    fails only the callers not answered yet, and nothing is sent twice; a caller cancelled before
    the batch is written sends nothing, and when every caller still waiting is cancelled, the
    connection is dropped as redis-py drops one command's. For a server's or a Sentinel master's
    client of its own connections (a cluster's would split by node)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._open: list[_Asked] | None = None  # this turn's, not written yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sending: set[asyncio.Task[None]] = set()

    def send(self, *args: Any) -> asyncio.Future[Any] | None:
        """The command's reply (or error), sent with the others asked for after it in this turn;
        None for the turn's first, which the caller sends at once."""
        loop = asyncio.get_running_loop()
        if self._open is None or self._loop is not loop:
            self._open, self._loop = [], loop
            loop.call_soon(self._flush, self._open)
            return None
        future: asyncio.Future[Any] = loop.create_future()
        self._open.append((args, future))
        return future

    def _flush(self, batch: list[_Asked]) -> None:
        """The turn is over: what it asked for after its first command goes."""
        if self._open is batch:
            self._open = None
        if batch:
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._sending.add(task)
            task.add_done_callback(functools.partial(self._sent, batch))

    def _sent(self, batch: list[_Asked], task: asyncio.Task[None]) -> None:
        """A batch cancelled or failed before it answered everyone: the rest hear of it."""
        self._sending.discard(task)
        error = None if task.cancelled() else task.exception()
        for _, future in batch:
            if future.done():
                continue
            if error is None:
                future.cancel()
            else:
                future.set_exception(error)

    async def _send(self, batch: list[_Asked]) -> None:
        asked = [(args, future) for args, future in batch if not future.done()]
        if not asked:
            return
        task = asyncio.current_task()

        def gone(future: asyncio.Future[Any]) -> None:
            if task is not None and future.cancelled() and all(f.done() for _, f in asked):
                task.cancel()  # nobody waits for a reply: drop the connection, as for one command

        for _, future in asked:
            future.add_done_callback(gone)
        if len(asked) == 1:
            args, future = asked[0]
            try:
                reply = await self.client.execute_command(*args)
            except Exception as exc:
                _settle(future, exc)
            else:
                _settle(future, reply)
            return
        pool = self.client.connection_pool
        connection = await pool.get_connection(*_LEND)
        try:
            await connection.send_packed_command(
                connection.pack_commands([args for args, _ in asked])
            )
            for _, future in asked:
                try:
                    reply = await connection.read_response()
                except redis.exceptions.ResponseError as exc:
                    _settle(future, exc)
                else:
                    _settle(future, reply)
        except Exception as exc:  # the connection's: every caller not answered yet
            await connection.disconnect()
            for _, future in asked:
                _settle(future, exc)
        except BaseException:
            await connection.disconnect()
            raise
        finally:
            await pool.release(connection)


def _settle(future: asyncio.Future[Any], outcome: Any) -> None:
    """One caller's reply, or its error (an exception); nothing for a caller gone already."""
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class ProjectScript:
    """One of the project's scripts on one client, called like redis-py's Script
    (``script(keys=..., args=...)``; an awaitable on an asyncio client): EVALSHA; after NOSCRIPT,
    SCRIPT LOAD and EVALSHA again; when this user may not run or load scripts, FCALL of its
    function, which an admin loaded (``mode``, shared by the client's scripts, then says FCALL from
    the start).

    A user that may not SCRIPT LOAD (the least-privilege roles) thus runs the functions, and gets
    a clear error naming ``load-functions`` when they are missing; the default user pays one load
    at a script's first run on a server, as with redis-py's Script (a named admin one FCALL more). The steps are one
    generator (:meth:`_steps`) that a blocking and an asyncio driver run."""

    def __init__(
        self, client: Any, source: str, mode: ScriptMode, batch: ScriptBatch | None = None
    ) -> None:
        self.client = client
        self.batch = batch  # an asyncio client's EVALSHAs of one loop turn, sent together
        self.script = source
        self.sha = hashlib.sha1(source.encode("utf-8")).hexdigest()
        self.function = function_name(source)
        self.mode = mode
        self.cluster = hasattr(client, "get_node_from_key")
        self.asyncio = isinstance(client, redis.asyncio.Redis | redis.asyncio.RedisCluster)

    def fcall_args(self, keys: list[Any], args: list[Any]) -> tuple[Any, ...]:
        return ("FCALL", self.function, len(keys), *keys, *args)

    def _fcall(self, keys: list[Any], args: list[Any]) -> Any:
        # a cluster client would ask the server for FCALL's keys (COMMAND GETKEYS) at every call
        route = (
            {"target_nodes": self.client.get_node_from_key(keys[0])}
            if self.cluster and keys
            else {}
        )
        return self.client.execute_command(*self.fcall_args(keys, args), **route)

    def _evalsha(self, keys: list[Any], args: list[Any]) -> Any:
        if self.batch is not None:
            batched = self.batch.send("EVALSHA", self.sha, len(keys), *keys, *args)
            if batched is not None:
                return batched
        return self.client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)

    def _load(self) -> Any:
        return self.client.script_load(self.script)

    def _steps(
        self, keys: list[Any], args: list[Any], *, functions: bool = True
    ) -> Generator[Callable[[], Any], Any, Any]:
        """Yields each command to send (a call that sends it); gets its reply, or its
        ResponseError thrown in; returns the script's reply. After a NOSCRIPT, Redis's default user
        loads the script first, a named user (an ACL role, whose refusals would fill the ACL log)
        tries the functions first. ``functions`` False: from the EVALSHA on, whatever the mode
        (:meth:`_aevalsha` sent it already)."""
        if functions and self.mode.functions:
            try:
                return (yield functools.partial(self._fcall, keys, args))
            except redis.exceptions.ResponseError as exc:
                if not function_missing(exc):
                    raise
                self.mode.functions = False  # flushed, or a restart without persistence
        refused: BaseException | None = None
        missing: BaseException | None = None
        loads_first = is_default_user(self.client)
        try:
            return (yield functools.partial(self._evalsha, keys, args))
        except redis.exceptions.NoScriptError:
            if loads_first:
                try:
                    yield self._load
                    return (yield functools.partial(self._evalsha, keys, args))
                except redis.exceptions.NoPermissionError as exc:
                    if not script_refused(exc):
                        raise
                    refused = exc
        except redis.exceptions.NoPermissionError as exc:
            if not script_refused(exc):
                raise
            refused = exc
        try:
            reply = yield functools.partial(self._fcall, keys, args)
        except redis.exceptions.ResponseError as exc:
            if _fcall_refused(exc) and refused is not None:
                raise refused from None  # this user may run neither: the first refusal names it
            if not (function_missing(exc) or _fcall_refused(exc)):
                raise
            if refused is not None:
                raise _not_loaded(refused, exc) from None
            missing = exc
        else:
            self.mode.functions = True
            return reply
        try:
            yield self._load
        except redis.exceptions.NoPermissionError as exc:
            if script_refused(exc):
                raise _not_loaded(exc, missing) from None
            raise
        return (yield functools.partial(self._evalsha, keys, args))

    def __call__(self, keys: Iterable[Any] = (), args: Iterable[Any] = ()) -> Any:
        if self.asyncio:
            if not self.mode.functions:
                return self._aevalsha(list(keys), list(args))
            return self._adrive(self._steps(list(keys), list(args)))
        steps = self._steps(list(keys), list(args))
        try:
            step = next(steps)
            while True:
                try:
                    reply = step()
                except redis.exceptions.ResponseError as exc:
                    step = steps.throw(exc)
                else:
                    step = steps.send(reply)
        except StopIteration as done:
            return done.value

    async def _aevalsha(self, keys: list[Any], args: list[Any]) -> Any:
        """The steps' first command (EVALSHA, outside the functions' mode) sent at once: a script
        that Redis has, which is every call but a few, costs no generator; after a ResponseError
        the steps go on from that EVALSHA as :meth:`_adrive` would have."""
        try:
            return await self._evalsha(keys, args)
        except redis.exceptions.ResponseError as exc:
            steps = self._steps(keys, args, functions=False)
            next(steps)  # the EVALSHA, sent above
            return await self._adrive(steps, exc)

    @staticmethod
    async def _adrive(
        steps: Generator[Callable[[], Any], Any, Any], thrown: BaseException | None = None
    ) -> Any:
        """Run the steps with an asyncio client; ``thrown``: the error of the command the steps
        gave last, sent already."""
        try:
            step = next(steps) if thrown is None else steps.throw(thrown)
            while True:
                try:
                    reply = await step()
                except redis.exceptions.ResponseError as exc:
                    step = steps.throw(exc)
                else:
                    step = steps.send(reply)
        except StopIteration as done:
            return done.value


# Where redis-py's and asyncio's connection internals live: an AttributeError or TypeError raised
# there is a connection closed under a command by another task (redis-py races during a failover,
# e.g. "'NoneType' object has no attribute 'writelines'"; redis-py issue 3546), not a bug of ours.
_CONNECTION_CODE = (
    "/redis/connection.py",
    "/redis/asyncio/connection.py",
    "/redis/asyncio/cluster.py",
    "/redis/cluster.py",
    "/asyncio/streams.py",
    "/asyncio/selector_events.py",
)


def as_connection_error(exc: BaseException) -> redis.exceptions.ConnectionError | None:
    """A ConnectionError standing for ``exc`` when it is an AttributeError or TypeError raised
    inside a connection's code (a connection closed under the command); None for any other
    error."""
    if not isinstance(exc, AttributeError | TypeError):
        return None
    tb, innermost = exc.__traceback__, None
    while tb is not None:
        innermost, tb = tb, tb.tb_next
    path = "" if innermost is None else innermost.tb_frame.f_code.co_filename.replace("\\", "/")
    if not path.endswith(_CONNECTION_CODE):
        return None
    error = redis.exceptions.ConnectionError(f"the connection closed under the command ({exc!r})")
    error.__cause__ = exc
    return error


@dataclass
class Backoff:
    """Seconds to wait before the next retry after an error: about ``first``, doubled each failure
    up to ``most``, with redis-py's equal jitter (each delay between half and all of that), so that
    the workers an outage stopped together do not all retry in the same instant.

    One object per thing that retries; :meth:`reset` after a success.
    """

    first: float = 0.1
    most: float = 5.0
    failures: int = 0

    def next(self) -> float:
        """The delay to wait now; the following one is about twice as long (at most ``most``)."""
        delay = EqualJitterBackoff(self.most, self.first).compute(self.failures)
        self.failures = min(self.failures + 1, 64)  # 2 ** 64 * first is past any ``most``
        return float(delay)

    def reset(self) -> None:
        self.failures = 0
