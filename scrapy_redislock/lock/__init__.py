"""The lock: a fair, leased counting lock in Redis, with no Scrapy and no Twisted.

A sans-IO core (:mod:`.core`, :mod:`.protocol`) and two thin fronts over it: :class:`CountingLock`
(blocking,
:mod:`.sync`) and :class:`AsyncCountingLock` (asyncio, :mod:`.aio`); :mod:`.quorum` holds one lock
on q of N independent masters (:class:`QuorumCountingLock`, :class:`AsyncQuorumCountingLock`,
:class:`QuorumLockFactory`). Lua scripts are package data in ``scripts/``.
"""

from scrapy_redislock.lock.aio import AsyncCountingLock
from scrapy_redislock.lock.core import LockKeys, Permit
from scrapy_redislock.lock.quorum import (
    AsyncQuorumCountingLock,
    QuorumCountingLock,
    QuorumLockFactory,
    QuorumPermit,
    safe_quorum,
)
from scrapy_redislock.lock.sync import CountingLock

__all__ = [
    "AsyncCountingLock",
    "AsyncQuorumCountingLock",
    "CountingLock",
    "LockKeys",
    "Permit",
    "QuorumCountingLock",
    "QuorumLockFactory",
    "QuorumPermit",
    "safe_quorum",
]
