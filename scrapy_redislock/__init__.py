"""Distributed crawl stage throttling for Scrapy: fair, leased counting locks in Redis."""

from scrapy_redislock.aio import AsyncCountingLock
from scrapy_redislock.core import LockKeys, Permit
from scrapy_redislock.errors import (
    AcquireTimeout,
    InvalidArgument,
    LockConnectionError,
    LockError,
    LockLost,
    UnknownStage,
)
from scrapy_redislock.lock import CountingLock

__all__ = [
    "AcquireTimeout",
    "AsyncCountingLock",
    "CountingLock",
    "InvalidArgument",
    "LockConnectionError",
    "LockError",
    "LockKeys",
    "LockLost",
    "Permit",
    "UnknownStage",
]
__version__ = "0.1.0"
