"""One interface for the four lock classes: what code above the lock layer may rely on.

:class:`~scrapy_redislock.lock.sync.CountingLock` and
:class:`~scrapy_redislock.lock.quorum.QuorumCountingLock` are :class:`BlockingLock`\\ s,
:class:`~scrapy_redislock.lock.aio.AsyncCountingLock` and
:class:`~scrapy_redislock.lock.quorum.AsyncQuorumCountingLock` are :class:`AsyncLock`\\ s; their
permits are :class:`LockPermit`\\ s. mypy checks the four classes against these protocols (see the
end of :mod:`scrapy_redislock.lock`), and ``tests/lock/test_interface.py`` compares their signatures
at run time, so a method added to one lock and not the others fails the build.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Protocol, TypeVar

from scrapy_redislock.lock.permit import LockKeys

P = TypeVar("P", bound="LockPermit")


class LockPermit(Protocol):
    """A granted slot, on one Redis (:class:`~scrapy_redislock.lock.permit.Permit`) or on a quorum
    of masters (:class:`~scrapy_redislock.lock.quorum.QuorumPermit`)."""

    name: str
    owner: str
    acquired_at: float
    valid_until: float
    holds: int
    lost: bool
    released: bool

    def usable(self, now: float) -> bool: ...

    @property
    def token(self) -> str: ...


class LockView(Protocol[P]):
    """What both kinds of lock show without I/O."""

    @property
    def name(self) -> str: ...

    @property
    def owner(self) -> str: ...

    @property
    def ttl(self) -> float: ...

    @property
    def renew_interval(self) -> float: ...

    @property
    def keys(self) -> LockKeys: ...

    @property
    def held(self) -> list[P]: ...

    @property
    def busy(self) -> bool: ...

    @property
    def queued(self) -> bool: ...

    def renewal_due(self) -> bool: ...

    def annotate(self, **fields: Any) -> None: ...


class BlockingLock(LockView[P], Protocol[P]):
    """A counting lock for threads: every call blocks until Redis answers."""

    def acquire(self, timeout: float | None = None) -> P: ...

    def try_acquire(self) -> P | None: ...

    def release(self, permit: P) -> bool: ...

    def renew(self, permit: P) -> None: ...

    def maintain(self, permits: list[P] | None = None) -> list[P]: ...

    def set_limit(self, limit: int) -> int | None: ...

    def get_limit(self) -> int | None: ...

    def close(self, retire: bool = False) -> int: ...

    def __enter__(self) -> P: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


class AsyncLock(LockView[P], Protocol[P]):
    """The same lock for asyncio: every call that talks to Redis is a coroutine."""

    async def acquire(self, timeout: float | None = None) -> P: ...

    async def try_acquire(self) -> P | None: ...

    async def release(self, permit: P) -> bool: ...

    async def renew(self, permit: P) -> None: ...

    async def maintain(self, permits: list[P] | None = None) -> list[P]: ...

    async def set_limit(self, limit: int) -> int | None: ...

    async def get_limit(self) -> int | None: ...

    async def aclose(self, retire: bool = False) -> int: ...

    async def __aenter__(self) -> P: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


__all__ = ["AsyncLock", "BlockingLock", "LockPermit", "LockView"]
