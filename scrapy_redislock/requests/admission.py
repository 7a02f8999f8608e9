"""Which sub-queue of :class:`~scrapy_redislock.StageScheduler` may let a request go now.

The sub-queues (:mod:`.stagequeue`) ask it two things: a request's route (its capped stage, and its
key when keys are capped; computed once per request) and whether a request of a route may leave
the scheduler now. A capped stage's request may leave when the stage has a slot in hand here (a
finished request's passed on, or a grant to one of the waits in Redis the process's line keeps for
the stage's queued requests, up to REDISLOCK_WAITERS_PER_STAGE:
:meth:`SlotLines.ask <scrapy_redislock.requests.lines.SlotLines.ask>`), so that no
request of a full stage takes one of CONCURRENT_REQUESTS; a capped key's, while the key's line lets
it (:class:`~scrapy_redislock.requests.keyline.KeyLine`, which counts every request of this process
that holds, takes or waits for the key); a delayed stage's, key's or scope's, while no request of
it that left waits for its start here (:class:`~scrapy_redislock.requests.startwaits.StartWaits`). Reads
REDISLOCK_STAGE_KEY from the checked settings it is given.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from scrapy_redislock.crawl.early import early_middlewares, settled_before_download
from scrapy_redislock.crawl.engine import downloader_active
from scrapy_redislock.crawl.keys import request_key
from scrapy_redislock.crawl.stages import stage_of
from scrapy_redislock.errors import KeyFunctionError, UnknownStage
from scrapy_redislock.requests.stagequeue import UNCAPPED, Route
from scrapy_redislock.requests.startwaits import STAGE_NAME_PREFIX, StartWaits, wait_name

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler

    from scrapy_redislock.crawl.settings import RedisLockSettings
    from scrapy_redislock.requests.keyline import KeyLine
    from scrapy_redislock.requests.requestslots import RequestSlots


class StageAdmission:
    """The routes of requests and the line of each capped stage."""

    def __init__(
        self,
        crawler: Crawler,
        settings: RedisLockSettings,
        slots: RequestSlots,
    ) -> None:
        self.crawler = crawler
        self.settings = settings
        # the request front's slots: kept ones let a request of their stage go; its line of requests
        # let go without one
        self.slots = slots
        self.key_capped = settings.keys.capped
        # the inner scheduler's queues are split by stage (False: an unknown scheduler)
        self.queues_split = True
        self._routes: weakref.WeakKeyDictionary[Request, Route] = weakref.WeakKeyDictionary()
        # key slots got in the scheduler, for requests of no capped stage (StageScheduler sets it)
        self.keyline: KeyLine | None = None
        # the delayed stages, keys and scopes with a start under way here (StageScheduler sets it)
        self.start_waits: StartWaits | None = None
        # cache and robots.txt middlewares before ours, found on first use
        self._early: tuple[Any, ...] | None = None

    def route(self, request: Request) -> Route:
        """The sub-queue of ``request``: its stage when capped, and its key when keys are capped;
        computed once."""
        known = self._routes.get(request)  # no KeyError raised and caught per new request
        if known is not None:
            return known
        stage = stage_of(request, self.settings, self.crawler.spider)
        try:
            capped = stage is not None and self.slots.locks.is_capped(stage)
        except UnknownStage:
            capped = False  # the middleware fails it, naming the stage and counting it
        if capped and self.settled_early(request, unknown=False):
            capped = False  # a cache hit, a URL robots.txt forbids: it needs no slot
        route: Route = (
            (stage, self._key(request) if self.key_capped else None) if capped else (None, None)
        )
        self._routes[request] = route
        return route

    def queue_route(self, request: Request) -> Route:
        """The sub-queue ``request`` goes into now: its route; a request of no capped stage whose
        key or other scope is blocked here (:meth:`KeyLine.blocked
        <scrapy_redislock.requests.keyline.KeyLine.blocked>`) goes into the first such name's."""
        route = self.route(request)
        if route[0] is None:
            name = self._blocked_name(request)
            if name is not None:
                return None, name
        return route

    def _blocked_name(self, request: Request) -> str | None:
        """The first of the request's capped names blocked here (KeyLine), else the first of its
        delayed names with a start under way here (StartWaits)."""
        name = self.keyline.blocked_name(request) if self.keyline is not None else None
        if name is None and self.start_waits is not None:
            name = self.start_waits.blocked_name(request)
        return name

    def divert(self, request: Request, route: Route) -> Route | None:
        """A request popped from the main sub-queue whose key or scope got blocked since it was
        queued waits in that name's sub-queue instead."""
        if route != UNCAPPED:
            return None
        name = self._blocked_name(request)
        return None if name is None else (None, name)

    def emptied(self, route: Route) -> None:
        """A name's sub-queue ran out: StartWaits may open another one."""
        if route[0] is None and route[1] is not None and self.start_waits is not None:
            self.start_waits.emptied(route[1])

    def may_go(self, route: Route) -> bool:
        """A request of this sub-queue may leave now: not capped; or no request of its stage that
        left waits for its start of the stage here (a delayed stage's, StartWaits), its stage has
        a slot (or the error of a wait that ran out) in hand here, and its key (if capped) has room
        here (:meth:`KeyLine.has_room <scrapy_redislock.requests.keyline.KeyLine.has_room>`). With
        none in hand, the stage's line keeps waits in Redis for it. A key's own sub-queue (no capped
        stage) while the key may go (:meth:`KeyLine.may_go
        <scrapy_redislock.requests.keyline.KeyLine.may_go>`) and has no start under way here
        (:class:`~scrapy_redislock.requests.startwaits.StartWaits`)."""
        stage, key = route
        if stage is None:
            if key is None:
                return True
            if self.start_waits is not None and self.start_waits.busy(key):
                return False
            # a stage's sub-queue (a delayed stage's, StartWaits) has no key line
            return (
                self.keyline is None
                or key.startswith(STAGE_NAME_PREFIX)
                or self.keyline.may_go(key)
            )
        if self.start_waits is not None and self.start_waits.busy(wait_name(stage)):
            return False  # a request of the stage that left waits for its start of the stage
        room = key is None or self.keyline is None or self.keyline.has_room(key)
        if self.slots.kept.ready(stage) or not self._waits_here() or not self._capped(stage):
            return room
        if room:
            self.slots.lines.ask(stage)
        return False

    def _capped(self, stage: str) -> bool:
        """Whether ``stage`` is capped now: a sub-queue a JOBDIR kept from a crawl where it was, and
        it no longer is (or is no longer configured), lets its requests go to the middleware, which
        lets them through or fails them naming the stage; no slot would ever come for them."""
        try:
            return self.slots.locks.is_capped(stage)
        except UnknownStage:
            return False

    def _waits_here(self) -> bool:
        """A capped request waits for its stage's slot here, not in the downloader (where it would
        take one of CONCURRENT_REQUESTS); with no downloader to watch (a scheduler driven by hand,
        as in Scrapy's own scheduler tests) or an inner scheduler whose queues are not split by
        stage, it goes to wait in the middleware."""
        return self.queues_split and downloader_active(self.crawler) is not None

    def settled_early(self, request: Request, *, cache: bool = True, unknown: bool = True) -> bool:
        """A middleware before StageLockMiddleware answers or drops ``request`` without a download
        (:func:`~scrapy_redislock.crawl.early.settled_before_download`), so it needs no slot. A
        capped request is asked when it is queued (its cache entry, and robots.txt if known: a
        host's robots.txt is not known yet when its start requests are queued), so that it does not
        wait for a slot, and again when it leaves (robots.txt, known or not)."""
        if self._early is None:
            self._early = early_middlewares(self.crawler)
        return bool(self._early) and settled_before_download(
            request, self._early, self.crawler.spider, cache=cache, unknown=unknown
        )

    def _key(self, request: Request) -> str | None:
        """The request's key (REDISLOCK_STAGE_KEY); None also when its function fails for it (the
        middleware then fails the request, naming the error)."""
        try:
            return request_key(request, self.crawler.spider, self.settings.keys.stage_key)
        except KeyFunctionError:
            return None
