"""KeptSlots: slots got for a name's queued requests before one of them left the scheduler, kept
for the next request of the name (oldest first). One copy for every name a request is capped by:
:class:`~scrapy_redislock.requests.requestslots.RequestSlots` keeps its stages' (a finished
request's slot passed on, a grant to a wait for the queued requests),
:class:`~scrapy_redislock.requests.keyline.KeyLine` its keys' and scopes' (a wait's grant); both
keep the error a wait ran out with, which the name's next queued request fails with.

A kept slot that can no longer go with a request (lost, or past its lease on this process's clock:
:meth:`StageLocks.usable <scrapy_redislock.crawl.stagelocks.StageLocks.usable>`, which counts and
logs it) is dropped when it is taken or pruned, and goes back to Redis. Reads no setting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Generic, TypeVar

from scrapy_redislock.crawl.stagelocks import SlotPermit

if TYPE_CHECKING:
    from scrapy_redislock.crawl.stagelocks import StageLocks

# what is kept: slots (a stage's), or slots and wait errors (a key's or scope's)
Kept = TypeVar("Kept", SlotPermit, SlotPermit | BaseException)


class KeptSlots(Generic[Kept]):
    """Per name, the slots (and wait errors) kept for its next queued requests, oldest first."""

    def __init__(self, locks: StageLocks) -> None:
        self.locks = locks  # the registry the slots came from, and go back to
        self._by_name: dict[str, deque[Kept]] = {}

    def count(self, name: str) -> int:
        """Slots (and errors) kept for ``name`` now."""
        kept = self._by_name.get(name)
        return 0 if kept is None else len(kept)

    def counts(self) -> Iterator[tuple[str, int]]:
        """Every name with something kept, and how much."""
        for name, kept in self._by_name.items():
            yield name, len(kept)

    def outcomes(self, name: str) -> tuple[Kept, ...]:
        """What is kept for ``name``, oldest first (left in place)."""
        return tuple(self._by_name.get(name, ()))

    def keep(self, name: str, outcome: Kept, *, first: bool = False) -> None:
        """Keep ``outcome`` for the next request of ``name``: last, or ``first`` (a slot a request
        took and gave back unused goes before the ones got after it)."""
        kept = self._by_name.setdefault(name, deque())
        if first:
            kept.appendleft(outcome)
        else:
            kept.append(outcome)

    def ready(self, name: str) -> bool:
        """Whether a usable slot (or an error) is kept for ``name``; unusable ones at the head are
        dropped on the way, back to Redis."""
        kept = self._by_name.get(name)
        while (
            kept and not isinstance(head := kept[0], BaseException) and not self.locks.usable(head)
        ):
            kept.popleft()
            self.locks.release_soon(head)
        if kept is not None and not kept:
            del self._by_name[name]
        return bool(kept)

    def take_slot(self, name: str) -> SlotPermit | None:
        """The oldest usable slot kept for ``name``, errors left in place for the queued requests
        (a request waiting in the middleware never fails with a wait it did not make); unusable
        slots are dropped on the way, back to Redis."""
        kept = self._by_name.get(name, deque())
        found: SlotPermit | None = None
        for outcome in [o for o in kept if not isinstance(o, BaseException)]:
            kept.remove(outcome)
            if self.locks.usable(outcome):
                found = outcome
                break
            self.locks.release_soon(outcome)
        if not kept:
            self._by_name.pop(name, None)
        return found

    def take(self, name: str) -> Kept | None:
        """The oldest usable slot (or error) kept for ``name``; unusable ones are dropped on the way,
        back to Redis. None when nothing is kept."""
        if not self.ready(name):
            return None
        kept = self._by_name[name]
        outcome = kept.popleft()
        if not kept:
            del self._by_name[name]
        return outcome

    def prune(self, wanted: Callable[[str], int]) -> None:
        """Keep for each name at most ``wanted(name)`` usable slots (its queued requests that could
        use one), oldest first, and its errors only while it wants any; the rest goes back to
        Redis or is forgotten."""
        now = self.locks.clock()
        for name, kept in list(self._by_name.items()):
            room = want = wanted(name)
            for outcome in list(kept):
                if isinstance(outcome, BaseException):
                    if not want:
                        kept.remove(outcome)
                elif room > 0 and self.locks.usable(outcome, now):
                    room -= 1
                else:
                    kept.remove(outcome)
                    self.locks.release_soon(outcome)
            if not kept:
                del self._by_name[name]

    def release_all(self) -> None:
        """Every kept slot back to Redis; errors forgotten."""
        for kept in self._by_name.values():
            for outcome in kept:
                if not isinstance(outcome, BaseException):
                    self.locks.release_soon(outcome)
        self._by_name.clear()

    def clear(self) -> None:
        """Forget everything kept (whoever closes the locks frees the slots)."""
        self._by_name.clear()


__all__ = ["KeptSlots"]
