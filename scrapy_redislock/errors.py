"""The one exception hierarchy of scrapy_redislock; everything derives from LockError."""

from __future__ import annotations

import redis.exceptions


class LockError(Exception):
    """Base class of every error raised by scrapy_redislock."""


class ConfigError(LockError, ValueError):
    """A REDISLOCK_* setting has a bad value; the message names it and the value.

    Not scrapy's NotConfigured: Scrapy catches that from a middleware and goes on without it,
    which would run the crawl unthrottled. This stops the crawl at start-up instead.
    """


class InvalidArgument(LockError, ValueError):
    """A setting or argument has a bad value; the message names it and the value."""


class AcquireTimeout(LockError, TimeoutError):
    """No slot was granted within the timeout."""


class ThrottlingDisabled(LockError):
    """A request names a stage while REDISLOCK_ENABLED is False: it is failed, never sent
    unthrottled.

    Remove StageLockMiddleware from DOWNLOADER_MIDDLEWARES to crawl such requests unthrottled on
    purpose.
    """


class Paused(LockError):
    """The lock's starts are paused (a Retry-After: :func:`scrapy_redislock.lock.delay.pause_starts`)
    until ``until`` (seconds since the epoch, Redis's clock), ``wait`` seconds from when Redis said
    so. A light lock's acquire and try_acquire raise it; try again after ``wait``."""

    def __init__(self, message: str, until: float, wait: float) -> None:
        super().__init__(message)
        self.until = until
        self.wait = wait


class LockLost(LockError):
    """A permit's lease is gone (expired, reset by an operator, or lost with Redis's data)."""


class NotReplicated(LockError):
    """With ``replicas=N``: fewer than N replicas acknowledged a grant (given back) or a release
    (done)."""


class LockConnectionError(LockError, redis.exceptions.ConnectionError):
    """Redis could not be reached; the message names the lock, the cause is the redis error."""


class QuorumNotReached(LockConnectionError):
    """Fewer masters than the quorum answered a quorum lock's write or read; ``failed`` maps each
    master index that failed to its error, ``needed`` is the quorum."""

    def __init__(self, message: str, failed: dict[int, BaseException], needed: int) -> None:
        super().__init__(message)
        self.failed = failed
        self.needed = needed


class RequestFormatError(LockError, ValueError):
    """A request cannot be queued in the safe format (a field that is not plain data), or a queued
    entry is not a request in that format (pickle, garbage, truncated); the message names the field
    or the problem."""


class KeyFunctionError(LockError):
    """REDISLOCK_STAGE_KEY's function raised for a request, or returned something that is not a key
    (a non-empty string without braces, or None). The request fails with it; the crawl goes on."""


class UnknownStage(LockError, KeyError):
    """A request names a stage that is not configured."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""
