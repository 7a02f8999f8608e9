"""StartWaits: at most one request of this process at a time between StageScheduler and its start
of a delayed stage, key or scope, or of one whose rate window is full, so that the others wait
queued, not in the downloader.

A delay (REDISLOCK_DELAY, REDISLOCK_DELAYS[stage or key], a stage's or scope's ``delay``, a site's
robots.txt Crawl-delay with REDISLOCK_CRAWL_DELAY) is a sleep in StageLockMiddleware, until the
request's booked start (:class:`~scrapy_redislock.requests.throttle.ScopeThrottle`). A request
sleeping there holds one of CONCURRENT_REQUESTS: sixteen requests of a site with a 30 s
Crawl-delay would fill the downloader for eight minutes while other sites' requests waited behind
them. So, over Scrapy's scheduler:

- a request that leaves StageScheduler's inner scheduler (with capped keys, for its key's take
  here first) marks its delayed names (its stage when it has a delay of its own, its key when it
  has one, then its other scopes with one; a request of a capped stage its stage only, the
  stage's cap bounding the rest) as having a start under way here (:meth:`StartWaits.leaving`);
- while a name has one, the next requests of that name stay in the scheduler, in the name's
  sub-queue, as a capped key's do (:class:`~scrapy_redislock.requests.admission.StageAdmission`),
  taking none of CONCURRENT_REQUESTS, while other names' requests go past them;
- the mark goes when the request's wait for that name ends (its start is confirmed, or the wait
  failed: :meth:`StartWaits.ended`), or when it reaches the downloader, or goes back to a
  sub-queue (its key refused it), or when the request is gone (a middleware before ours dropped
  it); the engine is woken then, and the name's next request leaves and books its start.

At most MOST_QUEUED_NAMES (256) names hold requests back in sub-queues of their own at once (the
sub-queues are scanned at every pop, and with JOBDIR each keeps a file open per priority in use);
past them, a request of a busy name leaves and sleeps in the middleware as before.

A rate window (a stage's or scope's ``rate``) is held the same way once this process found it
full, or took its last place (:meth:`Delays.rate_full
<scrapy_redislock.crawl.delays.Delays.rate_full>`, until a try a window later finds room at once
and leaves some): its name counts as delayed then, and as busy while a request of this process
waits for a place in it (``waiting``). While a window has room its requests leave at once: holding
them one at a time would bound a wide window's pace by a round trip a request.

Each process keeps one booking of a name at a time, so the cluster's bookings of a site interleave
instead of queueing dozens ahead. With REDISLOCK_CRAWL_DELAY a site whose robots.txt this process
has not read yet counts as delayed (its Crawl-delay may come): its requests leave one at a time
until RobotsTxtMiddleware has it, instead of all waiting for it in the downloader. A request of
several delayed names that leaves its first name's sub-queue goes on even if another of its names
has a start under way. A request whose site's robots.txt is not read yet does not mark its stage:
it waits for the robots.txt first (up to a download timeout), which would hold the stage's
requests of every site back; it sleeps for its stage's start in the middleware after. A stage's
sub-queue here is named :data:`STAGE_NAME_PREFIX` and the stage; a capped stage's requests wait in
their stage's sub-queues. The key and scope delays of a capped stage's requests (bounded by the
stage's cap), requests over scrapy-redis's scheduler (its queue is shared and not split by key)
and requests that bypass the scheduler sleep in the middleware as before.

Reads, through the checked settings, REDISLOCK_STAGES, REDISLOCK_STAGE_KEY, REDISLOCK_SCOPES,
REDISLOCK_SCOPES_OF, REDISLOCK_DELAY(S) and REDISLOCK_CRAWL_DELAY.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary, WeakSet

from scrapy_redislock.crawl.keylocks import KEY_LOCK_PREFIX

if TYPE_CHECKING:
    from scrapy import Request

# A stage among StartWaits' names, which are otherwise the keys' and scopes' (their sub-queues'
# names, as KeyLine's): a prefix no host name, proxy or token has, so a stage's requests never
# share a sub-queue with a key's
STAGE_NAME_PREFIX = "\x00stage:"


def wait_name(name: str) -> str:
    """StartWaits' name for the delay or rate window of the lock ``name`` (a stage's own name, a
    key's or scope's ``key:<name>``)."""
    if name.startswith(KEY_LOCK_PREFIX):
        return name.removeprefix(KEY_LOCK_PREFIX)
    return f"{STAGE_NAME_PREFIX}{name}"


def lock_name(name: str) -> str:
    """The lock's name of one of StartWaits' names (the inverse of :func:`wait_name`)."""
    if name.startswith(STAGE_NAME_PREFIX):
        return name.removeprefix(STAGE_NAME_PREFIX)
    return f"{KEY_LOCK_PREFIX}{name}"


# Names with a sub-queue of their own at once, at most: past them a request of a busy name leaves
# and sleeps in the middleware. Scrapy's scheduler scans every sub-queue at each pop, and with
# JOBDIR each keeps a file open per priority in use (a default limit of open files is 1,024).
MOST_QUEUED_NAMES = 256


class StartWaits:
    """Per delayed stage, key or scope, the requests of this process between the scheduler and
    their start of it (see the module docstring)."""

    def __init__(
        self,
        delayed_names: Callable[[Request], tuple[str, ...]],
        wake: Callable[[], None],
        waiting: Callable[[str | None], bool] = lambda name: False,
        *,
        delayed: bool = True,
    ) -> None:
        # the request's delayed stage, key and scopes, as the throttle reads them now
        self.delayed_names = delayed_names
        self.wake = wake  # the engine's next ask, when a name's start is no longer under way
        # a request of this process waits in the middleware for a place in the name's full rate
        # window (one that left before the window was found full); None: any window found full
        self.waiting = waiting
        # any stage, key or scope keeps a delay (else only a full rate window holds requests back)
        self.delayed = delayed
        # weak: a request dropped on its way (never reaching our middleware) lets its names go
        self.under_way: dict[str, WeakSet[Request]] = {}
        self.names: WeakKeyDictionary[Request, tuple[str, ...]] = WeakKeyDictionary()
        # names whose requests wait in a sub-queue of their own (the scheduler's sub-queues are
        # scanned at every pop, and with JOBDIR each keeps a file open per priority)
        self.queued: set[str] = set()

    def busy(self, name: str) -> bool:
        """A request of this process that left the scheduler waits for its start of ``name``:
        one marked when it left, or one waiting for a place in the name's full rate window."""
        requests = self.under_way.get(name)
        return bool(requests) or self.waiting(name)

    def blocked_name(self, request: Request) -> str | None:
        """The first of the request's delayed names with a start under way here, if any: the
        request waits in that name's sub-queue. None past :data:`MOST_QUEUED_NAMES` names with a
        sub-queue of their own: the request leaves and sleeps in the middleware, as without
        StartWaits."""
        if not self.under_way and not self.waiting(None):
            return None
        for name in self.delayed_names(request):
            if self.busy(name):
                if name not in self.queued and len(self.queued) >= MOST_QUEUED_NAMES:
                    return None
                self.queued.add(name)
                return name
        return None

    def emptied(self, name: str) -> None:
        """The sub-queue of ``name`` ran out of requests."""
        self.queued.discard(name)

    def leaving(self, request: Request, *, capped: bool = False) -> None:
        """``request`` leaves the scheduler: each of its delayed names has a start under way; only
        its stage's for a request of a capped stage (its key's and scopes' slots came with its
        stage's, so the stage's cap bounds how many of them wait for those starts)."""
        if not self.delayed and not self.waiting(None):
            return  # only rate windows, none found full: no name to look up per request
        names = self.delayed_names(request)
        if capped:
            names = names[:1] if names and names[0].startswith(STAGE_NAME_PREFIX) else ()
        if names:
            self.names[request] = names
        for name in names:
            self.under_way.setdefault(name, WeakSet()).add(request)

    def ended(self, request: Request, name: str) -> None:
        """The request's wait for its start of ``name`` ended (confirmed, or failed): the engine
        asks again once no start of the name is under way here (a request that left before its
        rate window was found full, and waited for it, included)."""
        requests = self.under_way.get(name)
        if requests is not None and request in requests:
            requests.discard(request)
            if requests:
                return
            del self.under_way[name]
        elif name not in self.queued and not name.startswith(STAGE_NAME_PREFIX):
            return  # (a capped stage's requests wait in its own sub-queues, not in ``queued``)
        if not self.busy(name):
            self.wake()

    def went_out(self, request: Request) -> None:
        """The request reached the downloader: none of its starts is under way any more (names a
        middleware before ours changed included)."""
        for name in self.names.pop(request, ()):
            self.ended(request, name)

    def prune(self) -> None:
        """Forget the names whose requests are all gone (dropped on their way); the engine asks
        again if one was let go."""
        gone = [name for name, requests in self.under_way.items() if not requests]
        for name in gone:
            del self.under_way[name]
        if gone:
            self.wake()
