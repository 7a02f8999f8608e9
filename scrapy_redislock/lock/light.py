"""The light path of a lock met at run time: while nobody waits for it, a grant is one zset member.

A lock made for a key met at run time (a domain, in a broad crawl) is mostly taken by one process at
a time, often for one page, then left for good. Setting up its stream and deleting it again cost
about 35 Redis commands per page. On the light path (``LockCore(light=True)``) a grant is a member
of the zset ``<prefix>:{<lock>}:light`` scored by the end of its lease on Redis's clock: the lock
has no stream, registers nobody, and leaves nothing to retire (the zset expires with its last
lease). The first caller that finds every slot held sets up the stream, which *escalates* the lock
(``scripts/_lib.lua``: each live light grant moves into the stream as a held grant of its owner,
with the rest of its lease, and the zset is marked) and queues there; from then on every caller
queues in the stream, first come, first served, until the lock is retired when idle and its next
taker starts on the light path again. The cap holds on both paths and across the switch: the
scripts that switch count every live grant, and a light grant that moved is released, or renewed,
in the stream.

Cost: a grant of an idle lock is 4 commands (EVALSHA, TIME, ZADD, PEXPIREAT), a release 2 (EVALSHA,
ZREM); a renewal, only for grants held longer than a renewal interval, one script per lock and tick.

What the light path does without: fencing tokens (a light grant's fence is 0; one that moved into
the stream takes its entry's id at its next renewal) and the recovery window after a Redis restart
(a key's lock starts afresh after a data loss, as it did before: its lock object lives only while
its key is in use).

Sans-IO like :mod:`scrapy_redislock.lock.core`, whose part it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scrapy_redislock._redis import text
from scrapy_redislock.errors import LockError, Paused
from scrapy_redislock.lock.permit import Permit, fence_of
from scrapy_redislock.lock.protocol import Operation, RunScript
from scrapy_redislock.lock.renewal import Renewal

if TYPE_CHECKING:
    from scrapy_redislock.lock.parts import Core

# Why a light take did not grant, besides "stream" (the lock's stream is in use: callers queue
# there) and "full" (every slot is held): a Retry-After paused the key's starts
# (lock/delay.py: pause_starts).
PAUSED = "paused"


class LightGrants:
    """One lock object's grants on the light path: take, release, renew (a view of its core, made
    per use: :attr:`LockCore.lights <scrapy_redislock.lock.core.LockCore.lights>`)."""

    def __init__(self, core: Core) -> None:
        self.core = core

    def take(self, limit: int) -> Operation[Permit | str]:
        """A light grant if the lock has no stream in use and a free slot; else why not
        ("stream", "full" or :data:`PAUSED`). ``limit`` is written when the lock is idle in Redis."""
        core = self.core
        core.light_grants_made += 1
        sent_at = core.clock()
        permit = Permit(core.name, core.owner, f"L{core.light_grants_made}", 0, sent_at, light=True)
        granted, why, *paused = text(
            (yield RunScript("light_take", (core.keys.light,), (limit, permit.token, core.ttl_ms)))
        )
        if why == PAUSED:
            until, now = (int(value) / 1000 for value in paused)
            raise Paused(
                f"lock {core.name!r}: starts paused for {until - now:.3f} s", until, until - now
            )
        if not int(granted):
            return str(why)
        permit.leased(sent_at, core.ttl_ms / 1000)
        return permit

    def acquire(self, limit: int | None, blocking: bool) -> Operation[tuple[bool, Permit | None]]:
        """The light path's part of an acquire: (True, a permit) when granted; (True, None) when
        ``blocking`` is off and the lock has no free slot or others queue for one (no try jumps
        the line); (False, None) to queue in the stream."""
        core = self.core
        if limit is None:
            raise LockError(f"lock {core.name!r}: light=True needs a limit to acquire")
        taken = yield from self.take(limit)
        if isinstance(taken, Permit):
            core.held[taken.grant] = taken
            return True, taken
        return not blocking, None

    def give_back(self, permit: Permit) -> Operation[bool]:
        """Release one light grant; True if it was still held."""
        permit.released = True
        released = yield from self.release([permit])
        self.core.let_go(permit)
        permit.lost = not released
        return bool(released)

    def release_held(self) -> Operation[int]:
        """Release every light grant this object holds (on close); how many were still held."""
        light = [p for p in self.core.held.values() if p.light]
        return (yield from self.release(light)) if light else 0

    def maintain(self, permits: list[Permit] | None) -> Operation[list[Permit]]:
        """A renewal pass of a lock with a light path: its light grants here (one that moved into
        the stream becomes a stream grant), then the stream's renewal for the stream grants, only
        when this object uses the stream (it set it up, waits, or holds a grant there)."""
        core = self.core
        targets = list(core.held.values()) if permits is None else list(permits)
        light = [p for p in targets if p.light]
        lost = (yield from self.renew(light)) if light else []
        for permit in lost:
            permit.lost = True
            core.let_go(permit)
        stream = [p for p in targets if not p.light and not p.lost]
        if stream or core.registration.ever or core.waits_in_flight or core.consumers.abandoned:
            lost += yield from Renewal(core, stream).run()
        return lost

    def release(self, permits: list[Permit]) -> Operation[int]:
        """Give light grants back (one that moved into the stream is freed there); returns how many
        were still held."""
        k = self.core.keys
        released = yield RunScript(
            "light_release", (k.light, k.migrated, k.slots), tuple(p.token for p in permits)
        )
        return int(released)

    def renew(self, permits: list[Permit]) -> Operation[list[Permit]]:
        """Extend the leases of light grants; returns those found lost. A grant that moved into the
        stream becomes a stream grant of this owner here (``light`` False, its entry's id and
        fence): the stream's renewal takes it from then on."""
        core = self.core
        sent_at = core.clock()
        replies = text(
            (
                yield RunScript(
                    "light_renew",
                    (core.keys.light, core.keys.migrated),
                    (core.ttl_ms, *(p.token for p in permits)),
                )
            )
        )
        lost = []
        for permit, reply in zip(permits, replies, strict=True):
            if reply == 1 or reply == "1":
                permit.leased(sent_at, core.ttl_ms / 1000)
            elif reply in (0, "0"):
                lost.append(permit)
            else:
                self._moved(permit, str(reply))
        return lost

    def _moved(self, permit: Permit, grant: str) -> None:
        """``permit`` is now the stream's grant ``grant``, held by this owner's consumer."""
        core = self.core
        if core.held.get(permit.grant) is permit:
            del core.held[permit.grant]
            core.held[grant] = permit
        permit.grant, permit.fence, permit.consumer, permit.light = (
            grant,
            fence_of(grant),
            core.owner,
            False,
        )
