"""A cluster-wide delay between two starts of one key (a stage, or a request key such as a domain).

Each start books the earliest free moment of the key's gate, ``<prefix>:{<name>}:gate``, in one
script (``scripts/delay.lua``) on Redis's clock: the booking is at least ``gap`` after the previous
one, and bookings are served in the order they reach Redis (first come, first served across every
process). The caller then sleeps for the wait the script returned and starts. Nothing polls: one
EVALSHA per start. The gate is a string that expires once its moment has passed, so an idle key
leaves nothing in Redis.

What the gap holds between: the bookings, exactly, on Redis's clock. Between the starts seen by a
server it holds up to the difference of the two callers' lateness after their booked moment (the
reply's way back, event-loop lag): that is the clock tolerance to allow for. A booking abandoned
(its request cancelled) leaves a longer gap, never a shorter one.

No Scrapy, no Twisted, no I/O: an operation for :func:`~scrapy_redislock.lock.protocol.adrive`.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from scrapy_redislock._redis import check_name, text
from scrapy_redislock.lock.permit import LockKeys
from scrapy_redislock.lock.protocol import Operation, RunScript


def gate_key(prefix: str, name: str) -> str:
    """The gate's key (:class:`LockKeys` ``gate``): under the lock's hash tag, on the lock's Redis
    Cluster node."""
    return LockKeys.of(check_name(prefix, "key_prefix"), check_name(name)).gate


def gap_of(delay: float, randomize: bool, rng: Callable[[], float] = random.random) -> float:
    """The gap to keep after one start: ``delay``, or a random 0.5 to 1.5 times it (as
    RANDOMIZE_DOWNLOAD_DELAY)."""
    return delay * (0.5 + rng()) if randomize else delay


def book_start(gate: str, gap: float) -> Operation[tuple[float, float]]:
    """Book the next start of ``gate``, keeping ``gap`` seconds after it; returns (seconds to wait
    first, the booked moment in seconds since the epoch on Redis's clock)."""
    wait, start = text((yield RunScript("delay", (gate,), (max(0, round(gap * 1_000_000)),))))
    return int(wait) / 1_000_000, int(start) / 1_000_000
