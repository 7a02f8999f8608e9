"""One release of a stream grant: give it back, give back at once the slot a renewal re-adopts for
it after a Redis restart, and, with replicas, wait until they have the release.

Sans-IO like :mod:`scrapy_redislock.lock.core`, whose
:meth:`~scrapy_redislock.lock.core.LockCore.release` it is (a light grant goes back through
:mod:`.light`); apart because the reply's codes and the replicas' check are a job of their own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scrapy_redislock.errors import NotReplicated
from scrapy_redislock.lock.protocol import Operation, RunScript

if TYPE_CHECKING:
    from scrapy_redislock.lock.parts import Core
    from scrapy_redislock.lock.permit import Permit

# release.lua's replies
RELEASED, NOT_HELD_RESTARTED = 1, 3


def release_grant(core: Core, permit: Permit, confirm: bool) -> Operation[bool]:
    """True if ``permit`` was held and is now given back (one reentrant hold dropped counts: the
    count is this process's, Redis sees only the last release); False for a stale permit.
    NotReplicated when ``confirm`` and fewer replicas than asked have the release."""
    if core.reentrant and permit.holds > 1 and not permit.lost:
        permit.holds -= 1
        return True
    usable = permit.owner == core.owner and permit.usable(core.clock())
    permit.released = True
    reply = yield RunScript(
        "release", (core.keys.slots, core.keys.meta), (permit.owner, permit.grant)
    )
    result = int(reply)
    if result == NOT_HELD_RESTARTED:
        result = 0
        if usable and permit.released:
            # Within its lease, and Redis forgot it in a restart: a renewal re-adopts a reserved
            # slot for it and, as it was released meanwhile, gives that straight back: the slot
            # need not wait out the reservation.
            yield from core.maintain([permit])
    core.let_go(permit)
    if result != RELEASED:
        permit.lost = True
    elif confirm and core.replicas:
        acked = yield from core.wait_replicas()
        if acked < core.replicas:
            raise NotReplicated(
                f"lock {core.name!r}: release of {permit.grant} done, but acknowledged by {acked} of {core.replicas} replica(s): a failover before they have it brings the slot back held for a lease"  # noqa: E501
            )
    return result == RELEASED
