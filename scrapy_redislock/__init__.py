"""Distributed crawl stage throttling for Scrapy: fair, leased counting locks in Redis."""

from scrapy_redislock.crawl.stages import stage
from scrapy_redislock.errors import (
    AcquireTimeout,
    ConfigError,
    InvalidArgument,
    KeyFunctionError,
    LockConnectionError,
    LockError,
    LockLost,
    NotReplicated,
    Paused,
    QuorumNotReached,
    RequestFormatError,
    ThrottlingDisabled,
    UnknownStage,
)
from scrapy_redislock.lock import (
    AsyncCountingLock,
    AsyncLock,
    AsyncQuorumCountingLock,
    BlockingLock,
    CountingLock,
    LockKeys,
    LockPermit,
    Permit,
    QuorumCountingLock,
    QuorumLockFactory,
    QuorumPermit,
    safe_quorum,
)


def __getattr__(name: str) -> object:
    """Scrapy glue is imported on first use, so the lock alone needs no Scrapy import."""
    if name == "Addon":
        from scrapy_redislock.requests.addon import Addon

        return Addon
    if name == "StageLockMiddleware":
        from scrapy_redislock.requests.middleware import StageLockMiddleware

        return StageLockMiddleware
    if name == "StageScheduler":
        from scrapy_redislock.requests.scheduler import StageScheduler

        return StageScheduler
    if name == "StageWorkerMixin":
        from scrapy_redislock.workers.mixin import StageWorkerMixin

        return StageWorkerMixin
    if name == "LeaseRanOut":
        from scrapy_redislock.crawl.stagelocks import LeaseRanOut

        return LeaseRanOut
    if name == "RedisClient":
        from scrapy_redislock.crawl.connection import RedisClient

        return RedisClient
    if name == "StageWorkerScheduler":
        from scrapy_redislock.workers.scheduler import StageWorkerScheduler

        return StageWorkerScheduler
    raise AttributeError(f"module 'scrapy_redislock' has no attribute {name!r}")


__all__ = [
    "AcquireTimeout",
    "Addon",
    "AsyncCountingLock",
    "AsyncLock",
    "AsyncQuorumCountingLock",
    "BlockingLock",
    "ConfigError",
    "CountingLock",
    "InvalidArgument",
    "KeyFunctionError",
    "LeaseRanOut",
    "LockConnectionError",
    "LockError",
    "LockKeys",
    "LockLost",
    "LockPermit",
    "NotReplicated",
    "Paused",
    "Permit",
    "QuorumCountingLock",
    "QuorumLockFactory",
    "QuorumNotReached",
    "QuorumPermit",
    "RedisClient",
    "RequestFormatError",
    "StageLockMiddleware",
    "StageScheduler",
    "StageWorkerMixin",
    "StageWorkerScheduler",
    "ThrottlingDisabled",
    "UnknownStage",
    "safe_quorum",
    "stage",
]
__version__ = "1.0.0"
