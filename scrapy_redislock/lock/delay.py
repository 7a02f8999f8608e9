"""A cluster-wide delay between two starts of one key (a stage, or a request key such as a domain).

A start is booked, then confirmed. The booking (``scripts/delay.lua``) takes the earliest free
moment of the key's gate, ``<prefix>:{<name>}:gate``, on Redis's clock: at least ``gap`` after the
previous booking, in the order bookings reach Redis (first come, first served across every process).
The caller sleeps until it, then confirms the start (``scripts/start.lua``) against the previous
*confirmed* start, ``<prefix>:{<name>}:started``: a start less than that start's gap after it is
told to wait the rest and confirm again. So confirmed starts of one key are at least their gap apart
on Redis's clock even when a process wakes late for its booking (CPU load, event-loop lag) and the
next one wakes on time: the booking gives the order, the confirmation the gap. A booking that can
start at once (nobody else used the key within the gap) is confirmed in the same script. A start
that goes out later than its confirmation came back (measured by the caller, on its own clock, up
to the moment the request reaches Scrapy's downloader) moves the next free start back by its
lateness (``scripts/late_start.lua``), so the next start keeps the whole gap after it. A start
logged in a rate window (``scripts/rate.lua``) that goes out late moves its entry to that moment
(``scripts/rate_late.lua``).

Cost: one EVALSHA per start while the key is free, two when the start had to wait, one more when
it had to wait again behind a late one or went out late. Both strings expire once their moment has
passed, so an idle key leaves nothing in Redis. What a server sees between two starts is the gap
less the difference between the two callers' delays from confirmation to sending (the reply's way
back, the downloader): the tolerance docs/key-caps.md states. A booking abandoned (its request
cancelled) leaves a longer gap, never a shorter one.

No Scrapy, no Twisted, no I/O: operations for :func:`~scrapy_redislock.lock.protocol.adrive`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from scrapy_redislock._redis import check_name, text
from scrapy_redislock.lock.permit import LockKeys
from scrapy_redislock.lock.protocol import Operation, RunScript


def delay_keys(prefix: str, name: str) -> LockKeys:
    """The keys of ``name`` (its ``gate`` and ``started`` are the delay's)."""
    return LockKeys.of(check_name(prefix, "key_prefix"), check_name(name))


@dataclass(frozen=True)
class Booking:
    """A booked start: ``wait`` seconds to sleep before confirming it (unless ``confirmed``), the
    booked moment (seconds since the epoch, Redis's clock)."""

    wait: float
    at: float
    confirmed: bool


def gap_of(delay: float, randomize: bool, rng: Callable[[], float] = random.random) -> float:
    """The gap to keep after one start: ``delay``, or a random 0.5 to 1.5 times it (as
    RANDOMIZE_DOWNLOAD_DELAY)."""
    return delay * (0.5 + rng()) if randomize else delay


def book_start(keys: LockKeys, gap: float) -> Operation[Booking]:
    """Book the next start of a key, keeping ``gap`` seconds after it (confirmed at once when it may
    start now)."""
    reply = yield RunScript("delay", (keys.gate, keys.started), (_micros(gap),))
    wait, at = text(reply[:2])
    return Booking(int(wait) / 1_000_000, int(at) / 1_000_000, bool(reply[2]))


def confirm_start(keys: LockKeys, gap: float) -> Operation[tuple[float, float]]:
    """Confirm a start now, keeping ``gap`` seconds after it; returns (seconds to wait before
    confirming again, 0 when confirmed; now in seconds since the epoch on Redis's clock)."""
    wait, now = text((yield RunScript("start", (keys.started,), (_micros(gap),))))
    return int(wait) / 1_000_000, int(now) / 1_000_000


def push_start(keys: LockKeys, at: float, lateness: float, gap: float) -> Operation[bool]:
    """A start confirmed at ``at`` (Redis's clock) went out ``lateness`` seconds after its
    confirmation came back: the next start keeps ``gap`` after that (whether the moment moved)."""
    reply = yield RunScript("late_start", (keys.started,), (_micros(at + lateness + gap),))
    return bool(reply)


def take_rate(
    keys: LockKeys, count: int, window: float, member: str
) -> Operation[tuple[float, float, int]]:
    """A start under a rate window of ``count`` starts in any ``window`` seconds (``scripts/rate.lua``,
    a sliding log on Redis's clock): (seconds to wait before asking again, 0 when started; now,
    seconds since the epoch on Redis's clock; places left in the window after this start, 0 when
    told to wait)."""
    reply = yield RunScript("rate", (keys.rate,), (count, _micros(window), member))
    wait, now, left = text(reply)
    return int(wait) / 1_000_000, int(now) / 1_000_000, int(left)


def push_rate(keys: LockKeys, member: str, moment: float, window: float) -> Operation[bool]:
    """A start logged as ``member`` in a rate window goes out at ``moment`` (seconds since the
    epoch, Redis's clock), later than logged: its entry moves there, or is logged there again if
    the log dropped it (``scripts/rate_late.lua``; whether it moved)."""
    reply = yield RunScript("rate_late", (keys.rate,), (member, _micros(moment), _micros(window)))
    return bool(reply)


def pause_starts(keys: LockKeys, seconds: float, light: bool = False) -> Operation[float]:
    """No start of the stage or key before ``seconds`` from now on Redis's clock, for every process
    (a site's Retry-After): its gate and next confirmed start move there, and with ``light`` its
    light path (lock/light.py) refuses takes until then. Returns the end of the pause (seconds
    since the epoch, Redis's clock): this one, or a later one already in place."""
    reply = yield RunScript(
        "pause",
        (keys.gate, keys.started, *((keys.light,) if light else ())),
        (_micros(seconds),),
    )
    return int(text(reply)) / 1_000_000


def _micros(seconds: float) -> int:
    return max(0, round(seconds * 1_000_000))
