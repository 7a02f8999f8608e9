"""The lock: a fair, leased counting lock in Redis, with no Scrapy and no Twisted.

A sans-IO core (:mod:`.core`, :mod:`.protocol`) and two thin lock classes over it: :class:`CountingLock`
(blocking, :mod:`.sync`) and :class:`AsyncCountingLock` (asyncio, :mod:`.aio`); :mod:`.quorum`
holds one lock on q of N independent masters (:class:`QuorumCountingLock`,
:class:`AsyncQuorumCountingLock`, :class:`QuorumLockFactory`). All four share one interface
(:mod:`.interface`: :class:`BlockingLock`, :class:`AsyncLock`). Lua scripts are package data in
``scripts/``.
"""

from typing import TYPE_CHECKING

from scrapy_redislock.lock.aio import AsyncCountingLock
from scrapy_redislock.lock.interface import AsyncLock, BlockingLock, LockPermit
from scrapy_redislock.lock.permit import LockKeys, Permit
from scrapy_redislock.lock.quorum import (
    AsyncQuorumCountingLock,
    QuorumCountingLock,
    QuorumLockFactory,
    QuorumPermit,
    safe_quorum,
)
from scrapy_redislock.lock.sync import CountingLock

if TYPE_CHECKING:
    # mypy checks that the four lock classes implement the one interface.
    _blocking: tuple[type[BlockingLock[Permit]], type[BlockingLock[QuorumPermit]]] = (
        CountingLock,
        QuorumCountingLock,
    )
    _async: tuple[type[AsyncLock[Permit]], type[AsyncLock[QuorumPermit]]] = (
        AsyncCountingLock,
        AsyncQuorumCountingLock,
    )

__all__ = [
    "AsyncCountingLock",
    "AsyncLock",
    "AsyncQuorumCountingLock",
    "BlockingLock",
    "CountingLock",
    "LockKeys",
    "LockPermit",
    "Permit",
    "QuorumCountingLock",
    "QuorumLockFactory",
    "QuorumPermit",
    "safe_quorum",
]
