"""What both quorum locks share: argument checks, the core, one lock per master."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from scrapy_redislock._redis import check_limit
from scrapy_redislock.errors import InvalidArgument
from scrapy_redislock.lock.base import LockBase, LockShared
from scrapy_redislock.lock.core import Clock
from scrapy_redislock.lock.quorum.core import (
    ANSWER_WITHIN,
    DRIFT_FACTOR,
    QuorumCore,
)
from scrapy_redislock.lock.quorum.protocol import (
    LeadSilent,
    QuorumPermit,
)

logger = logging.getLogger("scrapy_redislock.lock.quorum")
F = TypeVar("F", bound=LockBase)  # the per-master lock: CountingLock or AsyncCountingLock


class QuorumBase(LockShared[QuorumPermit], Generic[F]):
    """What both quorum locks share: argument checks, the core, one command runner per master (what
    all four locks share is :class:`~scrapy_redislock.lock.base.LockShared`'s)."""

    client_types: tuple[type, ...] = ()
    master_class: type[F]  # set by each quorum lock class
    _core: QuorumCore
    _logger = logger
    _callback_failed = "on_lost callback of quorum lock %r failed"

    def __init__(
        self,
        masters: Sequence[Any],
        name: str,
        limit: int,
        ttl: float = 30.0,
        *,
        key_prefix: str = "redislock",
        quorum: int | None = None,
        reentrant: bool = False,
        drift_factor: float = DRIFT_FACTOR,
        auto_renew: bool = False,
        on_lost: Callable[[QuorumPermit], object] | None = None,
        identity: Mapping[str, Any] | None = None,
        clock: Clock = time.monotonic,
        waiting: Sequence[Any] | None = None,
    ) -> None:
        """``waiting``: per master, the client whose connections block in that master's FIFO (a
        factory shares them between its locks); by default each per-master lock makes its own (see
        ``waiting_client``)."""
        if isinstance(masters, str | bytes) or not isinstance(masters, Sequence) or not masters:
            raise InvalidArgument(
                f"masters must be a non-empty list of redis clients, got {masters!r}"
            )
        expected = " or ".join(f"{t.__module__}.{t.__qualname__}" for t in self.client_types)
        for client in masters:
            if not isinstance(client, self.client_types):
                raise InvalidArgument(
                    f"masters must be {expected} clients, got {type(client).__name__}"
                )
        if len({id(c) for c in masters}) != len(masters):
            raise InvalidArgument(
                "masters lists the same client twice: each master must be an independent server"
            )
        if limit is None:
            raise InvalidArgument(
                "limit must be given for a quorum lock (its quorum depends on it), got None"
            )
        if reentrant and check_limit(limit) != 1:
            raise InvalidArgument(f"reentrant=True needs limit=1 (a mutex), got limit={limit!r}")
        # One ordinary lock per master: its core is what the quorum core drives, its lock waits in
        # that master's FIFO (and reaps dead holders' leases meanwhile), its runner carries the
        # commands. A shared waiting client is the factory's to close; one a lock makes itself, its
        # close() closes.
        shared = list(waiting) if waiting is not None else [None] * len(masters)
        self._locks = [
            self.master_class(
                client,
                name,
                limit,
                ttl,
                key_prefix=key_prefix,
                identity=identity,
                clock=clock,
                waiting=each,
            )
            for client, each in zip(masters, shared, strict=True)
        ]
        self._core = QuorumCore.create(
            [master.core for master in self._locks],
            quorum=quorum,
            reentrant=reentrant,
            drift_factor=drift_factor,
            clock=clock,
        )
        self._masters = list(masters)
        self._runners = [master.runner for master in self._locks]
        # Per master: (when, whether it answered) of the last PING a lead wait sent (see
        # LeadWait.watch).
        self._answered: dict[int, tuple[float, bool]] = {}
        self.auto_renew = auto_renew
        self.on_lost = on_lost or (
            lambda p: logger.warning("quorum permit %s of %r was lost", p.token, p.name)
        )

    @property
    def quorum(self) -> int:
        """Masters a permit needs."""
        return self._core.quorum

    @property
    def masters(self) -> int:
        return len(self._locks)

    @property
    def busy(self) -> bool:
        """Holds, waits or has an abandoned wait to clean up on some master: what a maintain() is
        for."""
        return bool(self._core.held) or any(master.busy for master in self._locks)

    @property
    def queued(self) -> bool:
        """Whether this object ever set the lock up or registered on some master."""
        return any(master.queued for master in self._locks)

    def renewal_due(self) -> bool:
        """Whether a maintain() is needed now: something held, or a master's lock busy (a quorum
        permit's validity is counted from its round, so every tick renews it)."""
        return self.busy

    def _check_limit(self, limit: int) -> None:
        if limit != self._core.limit:
            raise InvalidArgument(
                f"quorum lock {self.name!r}: set_limit({limit!r}) differs from the limit {self._core.limit} it was made with; its quorum depends on the limit: make a new lock object"  # noqa: E501
            )

    def annotate(self, **fields: Any) -> None:
        """Add fields to this owner's identity on every master (sent with the next maintain
        there)."""
        for master in self._locks:
            master.annotate(**fields)

    def _recent_answer(self, index: int) -> bool | None:
        """Whether master ``index`` answered the last PING, if that was less than a renewal interval
        ago."""
        last = self._answered.get(index)
        if last is None or self._core.clock() - last[0] >= self.renew_interval:
            return None
        return last[1]

    def _silent(self, index: int, cause: BaseException | None = None) -> LeadSilent:
        error = LeadSilent(
            f"quorum lock {self.name!r}: master {index} did not answer within {ANSWER_WITHIN} s while a wait was queued there; the wait was given up"  # noqa: E501
        )
        error.__cause__ = cause
        return error
