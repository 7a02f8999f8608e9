"""One wait for a slot: block in the lock's FIFO, then make sure the grant is still leased and, when
asked, on enough replicas.

Sans-IO like :mod:`scrapy_redislock.lock.core`: the wait yields commands and gets replies. It is
the body of :meth:`LockCore.acquire <scrapy_redislock.lock.core.LockCore.acquire>`, apart because
it has state of its own (its consumer, its deadline) that lives only as long as the wait.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import redis.exceptions

from scrapy_redislock._redis import text
from scrapy_redislock.errors import AcquireTimeout, NotReplicated
from scrapy_redislock.lock.permit import Permit, fence_of
from scrapy_redislock.lock.protocol import Operation, ReadGrant, RunScript, is_missing_lock

if TYPE_CHECKING:
    from scrapy_redislock.lock.parts import Core


def block_ms(deadline: float | None, now: float, max_block: float | None) -> int | None:
    """Milliseconds to block; 0 is forever; None when the deadline has passed."""
    cap = None if max_block is None else max(1, int(max_block * 1000))
    if deadline is None:
        return cap or 0
    left = deadline - now
    if left <= 0:
        return None
    ms = max(1, math.ceil(left * 1000))
    return ms if cap is None else min(ms, cap)


def grant_from(reply: Any) -> str | None:
    """The grant id in an ``XREADGROUP`` reply; None if it timed out empty."""
    if not reply:
        return None
    # RESP2: [[key, [[id, fields]]]]; RESP3: {key: [[id, fields]]} (or one level deeper)
    entries = next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1]
    entry = entries
    while entry and isinstance(entry[0], list | tuple):
        entry = entry[0]
    if not entry:
        return None
    return str(text(entry[0]))


class GrantWait:
    """One acquire's wait, from its first look to a permit held (or a timeout)."""

    def __init__(self, core: Core, timeout: float | None, blocking: bool) -> None:
        self.core = core
        self.timeout = timeout
        self.blocking = blocking
        self.deadline = None if timeout is None else core.clock() + timeout

    def run(self) -> Operation[Permit | None]:
        """Wait for a slot (FIFO across all processes); None when not blocking and none is free."""
        core = self.core
        consumer = core.consumers.take()
        while True:
            wait_ms = (
                block_ms(self.deadline, core.clock(), core.max_block) if self.blocking else None
            )
            # deadline passed: one last look without blocking
            last_try = self.blocking and wait_ms is None
            asked_at = core.clock()
            grant, again = yield from self._ask(consumer, wait_ms)
            if again:
                continue
            if grant is not None:
                permit = Permit(
                    core.name, core.owner, grant, fence_of(grant), core.clock(), consumer=consumer
                )
                permit.leased(asked_at, core.ttl)
                if wait_ms is not None and not (yield from self._confirmed(permit)):
                    continue  # reclaimed before our word came: wait again (the consumer is empty)
                if core.replicas:
                    yield from self._confirm_replicated(permit)
                if core.clock() - permit.leased_at >= core.ttl / 2 and not (
                    yield from self._still_granted(permit)
                ):
                    consumer = core.consumers.take()
                    continue
                return permit
            if not self.blocking:
                core.consumers.free(consumer)
                return None
            if last_try:
                core.consumers.free(consumer)
                raise AcquireTimeout(f"lock {core.name!r}: no slot within {self.timeout} s")

    def _ask(self, consumer: str, wait_ms: int | None) -> Operation[tuple[str | None, bool]]:
        """One look, blocking when ``wait_ms``: (the grant or None, whether to look again because
        the lock had to be set up anew)."""
        core = self.core
        core.waits_in_flight += 1
        finished = False
        try:
            if self.blocking and wait_ms is not None:
                reply = yield ReadGrant(
                    core.keys.slots, consumer, wait_ms, core.keys.meta, core.durable
                )
                grant = grant_from(reply)
            else:  # one look without blocking: a script, which notices a restart of Redis first
                reply = yield core.take_script(consumer)
                grant = None if not reply else str(text(reply))
            finished = True
            return grant, False
        except redis.exceptions.ResponseError as exc:
            finished = True  # an error reply: nothing was delivered
            if not is_missing_lock(exc):
                core.consumers.free(consumer)
                raise
            core.registration.current = False
            try:
                yield from core.ensure_setup()
            except BaseException:
                core.consumers.free(consumer)
                raise
            return None, True
        finally:
            core.waits_in_flight -= 1
            if not finished:
                # Cancelled, or the connection broke: a grant may have been delivered that nobody
                # will see.
                core.consumers.abandon(consumer)

    def _confirmed(self, permit: Permit) -> Operation[bool]:
        """Confirm a grant a blocked wait was handed; False if Redis reclaimed it meanwhile.

        Redis hands a freed slot to the first blocked wait whether or not its process can still
        hear: a process cut off (a partition, a VM pause) keeps its waits in the line. So a grant
        handed to a wait stays unconfirmed until its owner says it got it, and Redis frees one
        left unconfirmed for a renewal interval (``reclaim_unconfirmed`` in ``_lib.lua``): a silent
        process costs the others about that long, not a lease. This is the owner's word: one round
        trip (``hold_again``: still ours? then it moves to the owner's consumer, its lease begun
        again). A grant reclaimed before the word arrived (the reply came late) is not used, and
        the wait goes on.
        """
        core = self.core
        sent_at = core.clock()
        try:
            held = yield RunScript("hold_again", (core.keys.slots,), (core.owner, permit.grant))
        except BaseException:
            core.consumers.abandon(permit.consumer)
            core.consumers.abandon(permit.grant)
            raise
        if not int(held):
            return False
        core.consumers.free(permit.consumer)
        permit.consumer = core.owner
        permit.leased(sent_at, core.ttl)
        return True

    def _still_granted(self, permit: Permit) -> Operation[bool]:
        """Renew a grant whose reply came late; False if its lease was already reaped.

        Redis made the grant at some moment between the ask and the reply. A reply that took half a
        lease or more (a paused or overloaded Redis, a slow network, a long blocking wait) may carry
        a grant made that long ago, whose lease has run out or is about to, and which a reaper may
        hand to somebody else. Renewing it first makes it safe to use; a grant already reaped is not
        used and the wait goes on. Shorter replies cost nothing: their grant has more than half a
        lease left, and renewals run every ttl/3.
        """
        try:
            lost = yield from self.core.maintain([permit])
        except BaseException:
            # Not held yet: whatever the wait was handed is freed, under its wait's consumer or, if
            # the renewal went through before the cancel, under the owner's.
            self.core.consumers.abandon(permit.consumer)
            self.core.consumers.abandon(permit.grant)
            raise
        return not lost

    def _abandon(self, permit: Permit) -> None:
        """Nobody will use ``permit``: its grant is freed by the next renewals, under its wait's
        consumer or (confirmed) by its id."""
        if permit.consumer != self.core.owner:
            self.core.consumers.abandon(permit.consumer)
        self.core.consumers.abandon(permit.grant)

    def _confirm_replicated(self, permit: Permit) -> Operation[None]:
        """With ``replicas``: the grant is on that many replicas, or it is given back and
        NotReplicated raised.

        The permit is not held yet: if this is cancelled, abandoning its grant id (and its wait's
        consumer, for a grant not confirmed) frees exactly this grant.
        """
        core = self.core
        acked, error = -1, None
        try:
            acked = yield from core.wait_replicas()
        except redis.exceptions.RedisError as exc:
            error = exc
        except BaseException:
            self._abandon(permit)
            raise
        if acked >= core.replicas:
            return
        try:
            yield from core.release(permit, confirm=False)
        except BaseException as exc:
            self._abandon(permit)
            if not isinstance(exc, redis.exceptions.RedisError):
                raise
        seen = f"{type(error).__name__}: {error}" if error else f"{acked} acknowledged"
        raise NotReplicated(
            f"lock {core.name!r}: grant {permit.grant} not acknowledged by {core.replicas} replica(s) ({seen}); given back"  # noqa: E501
        ) from error
