"""The quorum lock: a counting lock held on q of N independent Redis masters (Redlock, for a
counting lock).

Each master keeps an ordinary counting lock (a :class:`~scrapy_redislock.lock.sync.CountingLock` or
:class:`~scrapy_redislock.lock.aio.AsyncCountingLock` per master, their Lua scripts unchanged); a
quorum permit is a grant on at least ``q`` of them, obtained within the validity time. No new Lua:
:class:`QuorumCore` is a sans-IO generator, like ``LockCore``, that yields
:class:`~scrapy_redislock.lock.quorum.protocol.Fanout` (one lock operation per master),
:class:`~scrapy_redislock.lock.quorum.protocol.LeadWait` and
:class:`~scrapy_redislock.lock.quorum.protocol.Pause`; :class:`QuorumCountingLock` runs a fanout's
operations one master after the other, :class:`AsyncQuorumCountingLock` all at once.

Why not a majority: each master admits ``limit`` (L) holders and each holder needs q masters, so up
to floor(N*L/q) holders fit at once. The safe quorum is the smallest q with q > N*L/(L+1)
(:func:`safe_quorum`); for a mutex (L=1) that is a majority, for L >= 2 it is more (N=3, L=2: 3;
N=5, L=3: 4).

What it promises and what it does not:

* Acquire: a waiter queues in the *lead* master's FIFO (the first master not found down in the last
  ttl/3), then a round asks every other master for a slot without blocking (and renews the lead's
  slot after a long wait); the round wins when >= q granted and the validity ``ttl - elapsed -
  drift`` (drift = ttl * drift_factor + 2 ms, elapsed counted from the start of a short wait, or of
  the round) is still positive; otherwise the partial grants are given back and the round is tried
  again after a jittered back-off, for up to ttl/3, after which the lead's slot goes back too and
  the waiter queues again at the back.
* Order: one FIFO per master cannot give a global FIFO (two waiters can be first on different
  masters); waiters are served in the lead's FIFO order while it is up (a release gives the lead's
  slot back last). While it is down the next master leads, and waiters queued on the dead one lose
  their place. ``try_acquire`` is one round, no queue.
* A lead that stops answering (paused, frozen VM, silent network) is noticed within about ttl/3 plus
  a PING's answer time: a wait that heard nothing from its lead for a renewal interval makes sure
  the lead still answers (one PING per master and interval, shared by every wait of the object); a
  lead that does not is left as a failed one is (down for ttl/3), whatever it may still hand the
  wait being freed when it answers again. A lead that answers keeps the waiter's place in its FIFO
  however long the wait.
* Renew on all masters; a renewal that fewer than q masters confirm loses the permit (what it still
  has is given back). Release on all masters.
* The fencing token is a vector: :attr:`QuorumPermit.fences`, master index -> that master's fence.
  :meth:`QuorumPermit.newer_than` compares two: for a mutex, two successive holders share a master,
  and on it the later one's fence is larger. One number (a max or a sum) would not be ordered across
  masters.
* A master that restarted empty rejoins only after one lease: the lock is recreated there with every
  slot reserved (the single lock's limbo recovery) whenever the lock is on any master, so holders
  re-adopt their grants and nobody new gets that master's slots for one ttl. Before its first write
  (``set_limit``, or the setup of a first acquire) an object that has not seen the lock yet asks
  every master whether it has it (one EXISTS each); only a lock that no master answering has is
  created with free slots.
"""

from scrapy_redislock.lock.quorum.aio import AsyncQuorumCountingLock
from scrapy_redislock.lock.quorum.base import QuorumBase
from scrapy_redislock.lock.quorum.core import QuorumCore, safe_quorum
from scrapy_redislock.lock.quorum.factory import QuorumLockFactory, master_options
from scrapy_redislock.lock.quorum.protocol import LeadSilent, QuorumPermit
from scrapy_redislock.lock.quorum.sync import QuorumCountingLock

__all__ = [
    "AsyncQuorumCountingLock",
    "LeadSilent",
    "QuorumBase",
    "QuorumCore",
    "QuorumCountingLock",
    "QuorumLockFactory",
    "QuorumPermit",
    "master_options",
    "safe_quorum",
]
