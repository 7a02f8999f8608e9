"""KeptSlots: what a name's requests queued in StageScheduler have and want, one copy for every
name a request is capped by (a stage's in RequestSlots' line, a key's or scope's in ScopeThrottle's,
:class:`~scrapy_redislock.requests.lines.SlotLines`):

- the slots got for them before one of them left the scheduler (a grant to a wait of the line, a
  finished request's slot passed on: :meth:`offer`), kept for the next of them, oldest first, or
  the error such a wait ran out with, which the name's next queued request fails with;
- how many waits in Redis they want (:meth:`wanted`, below), never more than the queued requests
  that could use a slot (``could_use(name)``, the owner's: 0 once it stands down);
- since when they wait with nothing kept (:meth:`asked`, :meth:`waited`).

How many waits, two policies: a stage's queued requests keep at most ``most``
(REDISLOCK_WAITERS_PER_STAGE) slots kept or asked for, and StageAdmission asks for them at every
pass of the engine where one of them could go; a key's or scope's ``keep_asking``: ``most`` (one)
wait beside what is kept, opened again by the line as soon as its grant is kept (the sub-queue asks
only when a take is refused), the queued requests waiting from the last one leaving.

A kept slot that can no longer go with a request (lost, or past its lease on this process's clock:
:meth:`StageLocks.usable <scrapy_redislock.crawl.stagelocks.StageLocks.usable>`, which counts and
logs it) is dropped when it is taken or pruned, and goes back to Redis. Reads no setting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from scrapy_redislock.crawl.engine import wake_engine
from scrapy_redislock.crawl.stagelocks import SlotPermit

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

    from scrapy_redislock.crawl.stagelocks import StageLocks

# what is kept: a slot, or the error a wait for the queued requests ran out with
Kept = SlotPermit | BaseException


class KeptSlots:
    """Per name, the slots (and wait errors) kept for its queued requests, the waits they want and
    since when they wait (see the module docstring)."""

    def __init__(
        self,
        crawler: Crawler,
        locks: StageLocks,
        *,
        could_use: Callable[[str], int],
        most: int,
        keep_asking: bool,
    ) -> None:
        self.crawler = crawler  # its engine is woken when something is kept
        self.locks = locks  # the registry the slots came from, and go back to
        self.could_use = could_use  # the owner's: queued requests of a name that could use a slot
        self.most = most  # waits per name at most
        # the line keeps ``most`` waits open beside what is kept (a key's), or the owner asks for
        # ``most`` slots kept or asked for in all (a stage's)
        self.keep_asking = keep_asking
        self._by_name: dict[str, deque[Kept]] = {}
        self._asked_at: dict[str, float] = {}  # per name: since when its queued requests wait

    def count(self, name: str) -> int:
        """Slots (and errors) kept for ``name`` now."""
        kept = self._by_name.get(name)
        return 0 if kept is None else len(kept)

    def outcomes(self, name: str) -> tuple[Kept, ...]:
        """What is kept for ``name``, oldest first (left in place)."""
        return tuple(self._by_name.get(name, ()))

    def wanted(self, name: str) -> int:
        """Waits in Redis wanted for the queued requests of ``name``."""
        kept = self.count(name)
        room = self.most if self.keep_asking else self.most - kept
        return max(0, min(room, self.could_use(name) - kept))

    def offer(self, name: str, outcome: Kept) -> bool:
        """Keep ``outcome`` (a usable slot, or a wanted wait's error, counted as
        ``<name>/timeouts``) for the next queued request of ``name`` and wake the engine; False
        when none of them could use it (a slot then goes back to Redis: the caller's)."""
        if self.could_use(name) <= self.count(name):
            return False
        if isinstance(outcome, BaseException):
            self.locks.count(name, "timeouts")
        elif not self.locks.usable(outcome):
            return False
        self.keep(name, outcome)
        wake_engine(self.crawler)
        return True

    def keep(self, name: str, outcome: Kept, *, first: bool = False) -> None:
        """Keep ``outcome`` for the next request of ``name``: last, or ``first`` (a slot a request
        took and gave back unused goes before the ones got after it)."""
        kept = self._by_name.setdefault(name, deque())
        if first:
            kept.appendleft(outcome)
        else:
            kept.append(outcome)

    def asked(self, name: str) -> None:
        """The queued requests of ``name`` have nothing kept: they wait from now (unless already)."""
        self._asked_at.setdefault(name, self.locks.clock())

    def waited(self, name: str) -> float:
        """Seconds the queued requests of ``name`` waited for the slot one of them leaves with now
        (since the name last had none for them; 0 for a slot that was in hand). A key's left with
        nothing kept wait from now (its line's wait stays open; a stage's owner asks again)."""
        now = self.locks.clock()
        since = self._asked_at.pop(name, None)
        if self.keep_asking and not self.count(name) and self.could_use(name):
            self._asked_at[name] = now
        return 0.0 if since is None else now - since

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

    def prune(self) -> None:
        """Keep for each name at most ``could_use(name)`` usable slots, oldest first, and its errors
        and its waiting time only while it could use any; the rest goes back to Redis or is
        forgotten."""
        now = self.locks.clock()
        for name in [name for name in self._asked_at if not self.could_use(name)]:
            del self._asked_at[name]
        for name, kept in list(self._by_name.items()):
            room = want = self.could_use(name)
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
