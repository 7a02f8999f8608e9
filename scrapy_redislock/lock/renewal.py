"""One renewal pass: renew a set of permits, free what abandoned waits were handed, reap expired
leases, and bring the permits' ids up to date after Redis lost and recreated the lock.

Sans-IO like :mod:`scrapy_redislock.lock.core`, whose
:meth:`~scrapy_redislock.lock.core.LockCore.maintain` it is: apart because it has state of its own
(the permits it renews, when it asked) that lives only as long as the pass.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import redis.exceptions

from scrapy_redislock._redis import text
from scrapy_redislock.lock.permit import Permit, fence_of
from scrapy_redislock.lock.protocol import Operation, RunScript, is_missing_lock

if TYPE_CHECKING:
    from scrapy_redislock.lock.parts import Core


class Renewal:
    """Renew exactly ``permits`` (None: every permit held) in one ``maintain`` script."""

    def __init__(self, core: Core, permits: list[Permit] | None) -> None:
        self.core = core
        self.permits = permits
        targets = list(core.held.values()) if permits is None else list(permits)
        # The reply names the ids sent: another renewal may rename a permit (re-adopted) meanwhile.
        self.sent = {p.grant: p for p in targets}
        self.abandoned = list(core.consumers.abandoned)
        # Everything held is renewed (re-adopted after a data loss): only such a pass reports this
        # owner as a survivor (maintain.lua), not one for a single permit being released.
        self.whole = self.sent.keys() >= core.stream_grants

    def run(self) -> Operation[list[Permit]]:
        """The permits found lost. A permit released while this ran is never reported lost, and a
        limbo slot adopted for it after a data loss is given back at once."""
        core, k = self.core, self.core.keys
        sent_at = core.clock()
        try:
            reply = yield RunScript(
                "maintain",
                (k.slots, k.meta, k.owners, k.ttls, k.seen),
                (
                    core.owner,
                    json.dumps(core.identity),
                    core.ttl_ms,
                    max(1, round(core.renew_interval * 1000)),
                    core.durable_flag,
                    "1" if self.whole else "0",
                    len(self.abandoned),
                    *self.abandoned,
                    *[g if p.valid_until > sent_at else f"!{g}" for g, p in self.sent.items()],
                ),
            )
        except redis.exceptions.ResponseError as exc:
            if not is_missing_lock(exc):
                raise
            # Redis lost the lock (restart without persistence, or a reset): recreate it with every
            # slot reserved for one lease if this object ever saw it (survivors re-adopt their
            # grants), then renew again.
            core.registration.current = False
            yield from core.ensure_setup()
            return (yield from core.maintain(self.permits))
        core.registration.done(core.clock())  # maintain registers this owner as setup does
        core.consumers.cleaned(self.abandoned)
        lost_ids, limit, lease_ms, _freed, adopted, *roster = text(reply)
        core.ttl = int(lease_ms) / 1000
        core.reported_limit = int(limit) if str(limit).isdigit() else None
        if roster:  # the owners alive, named should Redis lose the lock (see maintain.lua)
            core.registration.saw(roster[0], sent_at)
        renamed = dict(zip(adopted[::2], adopted[1::2], strict=True))
        self._renewed(set(lost_ids), renamed, sent_at)
        for grant in self._adopt(renamed):
            yield RunScript("release", (k.slots, k.meta), (core.owner, grant))
        # A permit released meanwhile (by another thread or task) is not "lost".
        lost = [self.sent[g] for g in lost_ids if g in self.sent and not self.sent[g].released]
        for permit in lost:
            permit.lost = True
            core.let_go(permit)
        return lost

    def _renewed(self, lost: set[str], renamed: dict[str, str], sent_at: float) -> None:
        """Renewed permits now sit under the consumer named like the owner: their wait consumers
        are free again."""
        core = self.core
        for grant, permit in self.sent.items():
            if grant not in lost and permit.owner == core.owner:
                permit.leased(sent_at, core.ttl)
                if grant not in renamed:
                    core.consumers.free(permit.consumer)
                    permit.consumer = core.owner

    def _adopt(self, renamed: dict[str, str]) -> list[str]:
        """Apply the re-adoption map as a whole (old and new ids never meet half-renamed); returns
        the adopted ids of permits released meanwhile, to give straight back."""
        core = self.core
        moved = [(self.sent[old], new) for old, new in renamed.items()]
        for permit, _new in moved:
            if core.held.get(permit.grant) is permit:
                del core.held[permit.grant]
        orphans: list[str] = []
        for permit, new in moved:
            if permit.released or permit.lost:
                orphans.append(new)
                continue
            core.consumers.free(permit.consumer)
            permit.grant, permit.fence, permit.consumer = new, fence_of(new), core.owner
            core.held[new] = permit
        return orphans
