"""How a lock operation talks to Redis: the commands it yields, and the drivers that carry them.

A lock operation (see :mod:`scrapy_redislock.lock.core`) is a generator that yields commands and
receives their replies, or has the redis error thrown in. :func:`drive` carries them with a blocking
executor,
:func:`adrive` with a coroutine one; :class:`~scrapy_redislock.lock.base.CommandRunner` is the one
executor both use. No I/O here; imports neither Scrapy nor Twisted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import redis.exceptions

from scrapy_redislock._redis import as_connection_error
from scrapy_redislock.errors import LockConnectionError, LockError


@dataclass(frozen=True)
class RunScript:
    """Run the named Lua script (EVALSHA, falling back to EVAL)."""

    name: str
    keys: tuple[str, ...]
    args: tuple[str | int, ...]


@dataclass(frozen=True)
class ReadGrant:
    """``XREADGROUP GROUP holders <consumer> COUNT 1 BLOCK <ms> STREAMS <key> >`` (0 ms: until
    granted).

    A plain command runs no check of its own, so the runner first sends the ``guard`` script
    (``meta``, ``durable``) on the connection that will read, once per connection and lock: a
    restarted Redis is noticed before it hands out a slot, even to a read that is the first command
    it gets (every restart breaks every connection).
    """

    key: str
    consumer: str
    block_ms: int
    meta: str = ""
    durable: bool = False


@dataclass(frozen=True)
class Call:
    """A plain read-only command (state changes are always scripts)."""

    args: tuple[str | int, ...]


@dataclass(frozen=True)
class WaitReplicas:
    """``HSET key field value`` then ``WAIT replicas timeout_ms``, pipelined over one connection.

    ``WAIT`` counts only what its own connection wrote, and a pooled client promises no connection,
    so a fresh write into the lock's hash slot goes first: a replica that has it has everything its
    master did before, the grant or release included (one replication stream, in order). Replies
    ``[hset reply, replicas acknowledged]``.
    """

    key: str
    field: str
    value: str
    replicas: int
    timeout_ms: int


@dataclass(frozen=True)
class MayEvict:
    """Whether the server may evict keys (``maxmemory-policy`` other than ``noeviction``): asked
    once per client (the runner keeps the answer). Replies a bool."""


Command = RunScript | ReadGrant | Call | WaitReplicas | MayEvict
T = TypeVar("T")
# An operation yields commands, is sent their replies (whatever redis-py decoded: Any) and returns
# its result.
Operation = Generator[Command, Any, T]


@dataclass(frozen=True)
class Finished(Generic[T]):
    """What :func:`step` returns when the operation has ended: its result."""

    value: T


def translate_error(name: str, exc: BaseException) -> BaseException:
    """Name the lock in connection errors; leave everything else as it is."""
    if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError) and not (
        isinstance(exc, LockError)
    ):
        error = LockConnectionError(f"redis lock {name!r}: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error
    return exc


def is_missing_lock(exc: BaseException) -> bool:
    """The lock's stream or group is gone (never created, reset, or Redis lost its data)."""
    message = str(exc)
    return isinstance(exc, redis.exceptions.ResponseError) and (
        message.startswith("NOGROUP") or "NOLOCK" in message
    )


def step(
    op: Operation[T], name: str, reply: Any, error: BaseException | None
) -> Command | Finished[T]:
    """Advance an operation by one reply: the next command, or :class:`Finished` with its result."""
    try:
        command = op.send(reply) if error is None else op.throw(error)
    except StopIteration as stop:
        result: T = stop.value
        return Finished(result)
    except BaseException as exc:
        translated = translate_error(name, exc)
        if translated is exc:
            raise
        raise translated from exc
    return command


def drive(op: Operation[T], execute: Callable[[Command], Any], name: str) -> T:
    """Run an operation with a blocking executor (the blocking lock)."""
    reply: Any = None
    error: BaseException | None = None
    try:
        while True:
            command = step(op, name, reply, error)
            if isinstance(command, Finished):
                return command.value
            reply, error = None, None
            try:
                reply = execute(command)
            except redis.exceptions.RedisError as exc:
                error = exc
            except (AttributeError, TypeError) as exc:
                error = as_connection_error(exc)
                if error is None:
                    raise
    finally:
        op.close()  # interrupted mid-command: run the operation's cleanup now, not at garbage collection


async def adrive(op: Operation[T], execute: Callable[[Command], Awaitable[Any]], name: str) -> T:
    """Run an operation with a coroutine executor (the asyncio lock).

    A cancellation that came while a command was out ends the operation even if the client returned
    a reply: on Python 3.11, ``asyncio.wait_for`` (which redis-py sends through when
    ``socket_timeout`` is set) returns the result of what finished as the cancel came and drops the
    cancel (CPython gh-86296). The reply is then treated as one that came too late: the operation's
    cleanup runs as for a command cut off mid-way.
    """
    task = asyncio.current_task()
    reply: Any = None
    error: BaseException | None = None
    try:
        while True:
            command = step(op, name, reply, error)
            if isinstance(command, Finished):
                return command.value
            reply, error = None, None
            cancels = task.cancelling() if task is not None else 0
            try:
                reply = await execute(command)
            except redis.exceptions.RedisError as exc:
                error = exc
            except (AttributeError, TypeError) as exc:
                error = as_connection_error(exc)
                if error is None:
                    raise
            if task is not None and task.cancelling() > cancels:
                raise asyncio.CancelledError(f"lock {name!r}: cancelled while a command was out")
    finally:
        op.close()  # cancelled mid-command: a cancelled wait must be marked for reconcile before the next maintain
