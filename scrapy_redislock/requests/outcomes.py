"""Outcomes: what StageLockMiddleware tells the adaptive limits about each answer, and the pauses a
site's Retry-After asks for.

- An answer of a request that held a slot of an adaptive stage or key (REDISLOCK_ADAPTIVE) is one
  observation for that lock's controller: its download latency (``meta["download_latency"]``, as
  Scrapy's AutoThrottle reads it), how long it held its slots (from the moment the first of them was
  its own, granted by Redis or passed on by a request of this process, to the moment they went back:
  the controller reads the share of a slot's time the site had the request, lower when requests
  wait in this process with their slots), and whether it was an overload answer (429, 503); a failed
  download (a timeout, a connection error; not IgnoreRequest nor one of ours) is an error
  (:class:`~scrapy_redislock.crawl.adaptive.Adaptation`).
- With REDISLOCK_RETRY_AFTER, a 429 or 503 answer with ``Retry-After`` (seconds, or an HTTP date,
  read against the answer's own ``Date``) pauses the starts of the request's key when the key is
  throttled (a cap, a delay, a Crawl-delay or a rate window; else of its capped stage; and a stage
  whose REDISLOCK_STAGES policy says ``retry_after``) in every process until then; a 429 without
  it, for REDISLOCK_RETRY_AFTER_DEFAULT seconds; a 503 without it pauses nothing (it is overload:
  the adaptive limit backs off). Counted as ``redislock/retry_after/pauses``.
- An answer HttpCacheMiddleware replayed (flag ``cached``) is neither: the site never saw it.

Reads, through the checked settings, REDISLOCK_ADAPTIVE, REDISLOCK_RETRY_AFTER,
REDISLOCK_RETRY_AFTER_DEFAULT.
"""

from __future__ import annotations

import email.utils
import math
import time
import weakref
from typing import TYPE_CHECKING

from scrapy.exceptions import IgnoreRequest

from scrapy_redislock.crawl.keys import request_key
from scrapy_redislock.crawl.stages import stage_of
from scrapy_redislock.errors import LockError
from scrapy_redislock.lock.status import KEY_LOCK_PREFIX

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler
    from scrapy.http import Response

    from scrapy_redislock.crawl.adaptive import Adaptation
    from scrapy_redislock.crawl.settings import RedisLockSettings
    from scrapy_redislock.crawl.stagelocks import SlotPermit
    from scrapy_redislock.lock.core import Clock
    from scrapy_redislock.requests.requestslots import RequestSlots
    from scrapy_redislock.requests.throttle import ScopeThrottle

OVERLOAD = (429, 503)


def retry_after(response: Response) -> float | None:
    """Seconds the answer's ``Retry-After`` asks to wait (a number, or an HTTP date read against
    the answer's ``Date``, else this machine's clock); None without one, or one that is neither."""
    raw = response.headers.get(b"Retry-After")
    if not raw:
        return None
    value = raw.decode("latin-1").strip()
    if value.isascii() and value.isdigit():  # str.isdigit() also takes "²", which float() refuses
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    date = response.headers.get(b"Date")
    try:
        now = email.utils.parsedate_to_datetime(date.decode("latin-1")) if date else None
    except (TypeError, ValueError):
        now = None
    if now is None or when.tzinfo is None or now.tzinfo is None:
        return max(0.0, when.timestamp() - time.time())
    return max(0.0, (when - now).total_seconds())


class Outcomes:
    """Answers and failures of one crawler's requests, for the adaptive limits and Retry-After."""

    def __init__(
        self,
        crawler: Crawler,
        settings: RedisLockSettings,
        slots: RequestSlots,
        throttle: ScopeThrottle | None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.crawler = crawler
        self.clock = clock  # monotonic seconds: how long a request held its slots
        self.settings = settings
        self.slots = slots
        self.locks = slots.locks
        self.throttle = throttle
        # the adaptive locks a request held, noted when its slots go back (request_left_downloader
        # comes before process_response), until its answer or failure is seen
        self.held: weakref.WeakKeyDictionary[Request, list[tuple[Adaptation, str]]] = (
            weakref.WeakKeyDictionary()
        )
        # when a request's slots became its own, then, once they went back, how long it held them,
        # until its answer is seen
        self.since: weakref.WeakKeyDictionary[Request, float] = weakref.WeakKeyDictionary()
        self.holds: weakref.WeakKeyDictionary[Request, float] = weakref.WeakKeyDictionary()
        # id(permit) -> when a request of this process last gave it back: a slot passed on to the
        # next request is that one's from then, not from its grant (an id reused by a later permit
        # finds a time before that permit's grant, which the grant's time then wins over)
        self.freed: dict[int, float] = {}
        self.pruned = 0.0

    def going(self, request: Request) -> None:
        """``request`` has all its slots and goes to the downloader: its hold started when the first
        of them became its own (granted by Redis: a slot taken for a request still queued in this
        process is held, and counted in use, while the request waits; or passed on by the request
        before it)."""
        if not self.settings.adaptive.watched:
            return
        since = self.clock()
        for permit in self._permits(request):
            since = min(since, max(permit.acquired_at, self.freed.pop(id(permit), -math.inf)))
        self.since[request] = since

    def _permits(self, request: Request) -> list[SlotPermit]:
        """The slots ``request`` holds now: its stage's, its key's and its scopes'."""
        return [permit for _, permit in self.slots.held(request)]

    def releasing(self, request: Request) -> None:
        """The request's slots are about to go back: note its adaptive locks for its outcome."""
        if not self.settings.adaptive.watched:
            return  # nothing adapts: no work per request
        since, now = self.since.pop(request, None), self.clock()
        found = self._adaptive(request)
        if found:
            self.held[request] = found
            if since is not None:
                self.holds[request] = now - since
        for permit in self._permits(request):
            self.freed[id(permit)] = now
        if now - self.pruned > self.settings.ttl:
            # a slot is passed on within half a lease, or not at all
            self.freed = {key: at for key, at in self.freed.items() if now - at < self.settings.ttl}
            self.pruned = now

    def _adaptive(self, request: Request) -> list[tuple[Adaptation, str]]:
        """(adaptation, lock name) of the adaptive locks whose slot the request holds (or held,
        noted by :meth:`releasing`)."""
        noted = self.held.pop(request, None)
        if noted is not None:
            return noted
        found = []
        for lines, permit in self.slots.held(request):
            adaptation = lines.locks.adaptation
            stage = lines is self.slots.lines  # else a key's or scope's
            name = permit.name if stage else permit.name.removeprefix(KEY_LOCK_PREFIX)
            if adaptation is not None and self.settings.policy_of(name, stage=stage).adaptive:
                found.append((adaptation, permit.name))
        return found

    def response(self, request: Request, response: Response) -> None:
        if "cached" in getattr(response, "flags", ()):
            return  # HttpCacheMiddleware's: the site never saw it (a cached 429 pauses nothing)
        overload = getattr(response, "status", None) in OVERLOAD
        if self.settings.adaptive.watched:
            latency = request.meta.get("download_latency")
            hold = self.holds.pop(request, None)
            for adaptation, name in self._adaptive(request):
                adaptation.response(name, latency, overload, hold)
        if overload and (self.settings.adaptive.retry_after or self.settings.adaptive.scoped):
            self._pause(request, response)

    def exception(self, request: Request, exception: BaseException) -> None:
        if isinstance(exception, IgnoreRequest | LockError) or not self.settings.adaptive.watched:
            return
        for adaptation, name in self._adaptive(request):
            adaptation.error(name)

    def _pause(self, request: Request, response: Response) -> None:
        seconds = retry_after(response)
        if seconds is None:
            if response.status != 429:
                return
            seconds = self.settings.adaptive.retry_after_default
        if seconds <= 0:
            return
        policy_of, obey = self.settings.policy_of, self.settings.adaptive.retry_after
        key = self._paused_key(request)
        throttle = self.throttle
        key_paused = False
        if throttle is not None and throttle.locks.adaptation is not None:
            key_paused = key is not None
            paused = [scope for scope in self._scopes(request) if policy_of(scope).retry_after]
            if key is not None and (obey or policy_of(key).retry_after):
                paused.insert(0, key)
            for scope in paused:
                throttle.locks.adaptation.pause(f"{KEY_LOCK_PREFIX}{scope}", seconds)
        paused_stages = self.settings.adaptive.paused_stages
        # REDISLOCK_RETRY_AFTER pauses the key, else the capped stage; a stage's own policy, the stage
        if not (paused_stages or (obey and not key_paused)):
            return
        stage = stage_of(request, self.settings, self.crawler.spider)
        if stage is None or not (stage in paused_stages or (obey and not key_paused)):
            return
        if stage in self.locks.locks and self.locks.adaptation is not None:
            self.locks.adaptation.pause(stage, seconds)

    def _scopes(self, request: Request) -> tuple[str, ...]:
        """The request's scopes beside its stage and key (none when they cannot be read)."""
        if self.throttle is None:
            return ()
        try:
            return self.throttle.key_and_scopes(request)[1]
        except LockError:
            return ()

    def _paused_key(self, request: Request) -> str | None:
        """The request's key when a pause of it holds its starts: a key with a cap, a delay (its
        own, REDISLOCK_DELAY, or its site's robots.txt Crawl-delay) or a rate window. A key with
        none of them has no start to hold: the capped stage is paused instead."""
        if self.settings.keys.stage_key is None:
            return None
        try:
            key = request_key(request, self.crawler.spider, self.settings.keys.stage_key)
        except LockError:
            return None
        if key is None:
            return None
        policy = self.settings.policy_of(key)
        if policy.limit is not None or policy.rate is not None:
            return key
        throttle = self.throttle
        delay = policy.delay if throttle is None else throttle.key_delay(request, policy.delay)
        return key if delay else None
