"""Which request of this process holds which slot: the permit hand-off's bookkeeping, with no Redis.

A slot goes with its request object (never in ``meta``, which retries and redirects copy): handed
by the scheduler (:meth:`PermitLedger.hand`) or got by the middleware's own wait
(:meth:`PermitLedger.hold`), until :meth:`PermitLedger.finish`. A scheduler may hand an error
instead (the middleware fails the request with it, once). Requests that left the downloader without
passing back through the middleware are found by :meth:`PermitLedger.sweep`: missing from the
downloader at two looks in a row (the engine adds a request to the downloader in the same call that
takes it from the scheduler, so one look would do; two cost nothing).

Used by :class:`~scrapy_redislock.requests.requestslots.RequestSlots`, whose one record per request
holds its stage's, key's and scopes' slots; unit-tested without Redis.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from typing import Generic, TypeVar

R = TypeVar("R", bound=Hashable)
P = TypeVar("P")


class PermitLedger(Generic[R, P]):
    """Request -> the slot it goes with (or the error it fails with); see the module docstring."""

    def __init__(self) -> None:
        self._out: dict[R, P | BaseException] = {}
        self._suspects: set[R] = set()

    def hand(self, request: R, outcome: P | BaseException) -> None:
        """The scheduler lets ``request`` go with this slot (or fails it with this error)."""
        self._out[request] = outcome

    def hold(self, request: R, permit: P) -> None:
        """``request`` got ``permit`` itself (it waited in the middleware)."""
        self._out[request] = permit

    def peek(self, request: R) -> P | BaseException | None:
        return self._out.get(request)

    def forget(self, request: R) -> None:
        self._out.pop(request, None)

    def permit_of(self, request: R) -> P | None:
        outcome = self._out.get(request)
        return None if outcome is None or isinstance(outcome, BaseException) else outcome

    def holding(self) -> list[R]:
        """The requests that hold a slot now."""
        return [r for r, outcome in self._out.items() if not isinstance(outcome, BaseException)]

    def finish(self, request: R) -> P | None:
        """``request`` is done: the slot it held, to be freed by the caller (None if it held
        none)."""
        outcome = self._out.pop(request, None)
        return None if outcome is None or isinstance(outcome, BaseException) else outcome

    def sweep(self, active: Collection[R] | None) -> list[P]:
        """Finish the requests missing from ``active`` (the downloader's requests) now and at the
        last sweep; their slots, to be freed by the caller. Nothing while there is no downloader
        (None)."""
        if active is None:
            return []
        gone = {request for request in self._out if request not in active}
        left, self._suspects = gone & self._suspects, gone
        return [permit for request in left if (permit := self.finish(request)) is not None]

    def clear(self) -> None:
        self._out.clear()
        self._suspects.clear()


__all__ = ["PermitLedger"]
