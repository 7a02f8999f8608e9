"""StageLockMiddleware: cap the requests in flight per stage across every process of a crawl.

A request's stage comes from ``meta["redislock_stage"]``, the ``@stage(...)`` decorator on its
callback, REDISLOCK_CALLBACK_STAGES, or REDISLOCK_DEFAULT_STAGE; ``meta["dont_redislock"]`` opts it
out, and robots.txt is never throttled (see :func:`scrapy_redislock.crawl.stages.stage_of`). A
capped request holds a slot of its stage from here until its download ends, and the slot is released
on every outcome: response, exception (download timeout included), IgnoreRequest or a response from
a later middleware, a request dropped on the way (found by a sweep at every renewal tick:
:meth:`RequestSlots.sweep <scrapy_redislock.requests.requestslots.RequestSlots.sweep>`), the spider
closing. Permits are kept by request object in the crawler's
:class:`~scrapy_redislock.requests.requestslots.RequestSlots`, never in ``meta``, so retries and redirects
(which copy meta) never carry one. When the request is done with its slot, the slot passes straight
on (within REDISLOCK_LOCAL_REUSE) to a request of the same stage of this process waiting here, else to
one queued in StageScheduler, else goes back to Redis at once.

With :class:`~scrapy_redislock.StageScheduler` the slot was granted before the request left the
scheduler and is picked up here (``RequestSlots.take``). Without it, and for requests that bypass the
scheduler (``engine.download_async``: media pipelines), the request waits here, in this process's
line for the stage (:mod:`~scrapy_redislock.requests.lines`: a slot freed here, or a grant to one
of its waits in Redis's FIFO): caps hold, but a waiting request occupies one of CONCURRENT_REQUESTS
(so a saturated stage slows the others). When the spider closes, a request waiting here for a slot
(of its stage, key or scope) never went out: it goes back into StageScheduler's queue, or keeps
waiting while what it waits for makes progress, or is dropped
(:mod:`~scrapy_redislock.requests.closewaits`).

A request never starts with a slot that is lost or past its lease on this process's clock (Redis out
of reach, a stall: another process may hold it by now; see ``StageLocks.usable``). Such a slot is
dropped when the request picks it up here, or when the request is through its key slot and delays,
and the request waits here for another (counted as ``redislock/<stage>/unusable``). It never waits
for its stage's slot holding its key's or a scope's: those go back first (a stage's dropped slot
takes them with it), and are taken again after it. Nor does its download
outlive the slot's lease as last confirmed, nor its key's or scopes' slots' leases: its
``download_timeout`` ends before the first of them (see :meth:`StageLockMiddleware._within_lease`).

Fail closed: enabled with no stage is a ConfigError, and so is a stage name known at start (a
``@stage`` callback of the spider class, REDISLOCK_CALLBACK_STAGES, REDISLOCK_DEFAULT_STAGE) that
REDISLOCK_STAGES does not configure (:func:`~scrapy_redislock.crawl.stages.check_stage_names`); a
ConfigError ends the crawl as one log line, exit status 1. With REDISLOCK_ENABLED = False the
middleware stays in the chain and fails every request that has a stage with ThrottlingDisabled
(counted), never sends it unthrottled. AcquireTimeout (REDISLOCK_WAIT_TIMEOUT) is not retried by
RetryMiddleware unless RETRY_EXCEPTIONS names it.

Settings read (via :func:`scrapy_redislock.crawl.settings.read_settings`): REDISLOCK_ENABLED,
REDISLOCK_URL (and the scrapy-redis fallbacks), REDISLOCK_PARAMS, REDISLOCK_STAGES, REDISLOCK_TTL,
REDISLOCK_KEY_PREFIX, REDISLOCK_DEFAULT_STAGE, REDISLOCK_CALLBACK_STAGES, REDISLOCK_WAIT_TIMEOUT,
REDISLOCK_LOCAL_REUSE, and for keys and delays (:mod:`~scrapy_redislock.requests.throttle`: after the
stage slot, the key slot, then the delays) REDISLOCK_STAGE_KEY, REDISLOCK_KEY_LIMIT,
REDISLOCK_KEY_LIMITS, REDISLOCK_DELAY, REDISLOCK_DELAYS, REDISLOCK_RANDOMIZE_DELAY; Scrapy's
RETRY_EXCEPTIONS and DOWNLOAD_TIMEOUT. Stats:
redislock/<stage>/{acquired,wait_time_total,wait_time_max,lost,unusable,timeouts,dropped_at_close,given_back_at_close,reused,lease_bounded},
redislock/unknown_stage, redislock/throttling_off, redislock/redis_errors.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, NoReturn

from scrapy import Request, Spider, signals
from scrapy.exceptions import IgnoreRequest
from scrapy.utils.misc import load_object

from scrapy_redislock.crawl.early import EARLY_TYPES, MIDDLEWARE_PATH, middlewares_after
from scrapy_redislock.crawl.engine import at_download_start, check_reactor, one_line_config_errors
from scrapy_redislock.crawl.settings import read_settings
from scrapy_redislock.crawl.stagelocks import (
    SlotPermit,
    StageLocks,
    lease_end,
    out_of_lease,
    say_downloads_cut,
    within_lease,
    within_lease_at_start,
)
from scrapy_redislock.crawl.stages import check_stage_names, stage_of
from scrapy_redislock.errors import AcquireTimeout, ConfigError, ThrottlingDisabled, UnknownStage
from scrapy_redislock.requests.closewaits import CloseWaits
from scrapy_redislock.requests.outcomes import Outcomes
from scrapy_redislock.requests.requestslots import RequestSlots
from scrapy_redislock.requests.throttle import ScopeThrottle

if TYPE_CHECKING:
    from typing import Self

    from scrapy.crawler import Crawler
    from scrapy.http import Response

    from scrapy_redislock.lock.core import Clock

logger = logging.getLogger(__name__)


class StageLockMiddleware:
    """Downloader middleware holding one slot of the request's stage while the request is
    downloaded."""

    redislock_takes_slots = True  # how StageScheduler and crawl.early find it without importing it

    def __init__(self, crawler: Crawler, clock: Clock = time.monotonic) -> None:
        one_line_config_errors()  # a ConfigError below ends the crawl as one line, exit status 1
        self.crawler = crawler
        self.clock = clock  # monotonic seconds, for the parts it makes too (tests pass theirs)
        self.settings = read_settings(crawler.settings)
        self.unknown: Counter[str] = Counter()  # requests dropped per unknown stage
        self.retry_timeouts = _names_acquire_timeout(crawler.settings.getlist("RETRY_EXCEPTIONS"))
        self.download_timeout = crawler.settings.getfloat("DOWNLOAD_TIMEOUT", 180)
        if not self.settings.enabled:
            logger.warning(
                "REDISLOCK_ENABLED is False: requests that have a stage fail with ThrottlingDisabled instead of going out unthrottled; remove %s from DOWNLOADER_MIDDLEWARES to crawl them unthrottled on purpose",  # noqa: E501
                MIDDLEWARE_PATH,
            )
            self.locks: StageLocks | None = None
            self.slots: RequestSlots | None = None
            return
        if not self.settings.stages and not self.settings.keyed:
            raise ConfigError(
                "StageLockMiddleware is enabled but REDISLOCK_STAGES is empty, so no request would be capped; set REDISLOCK_STAGES = {stage: limit, ...} or REDISLOCK_STAGE_KEY, or REDISLOCK_ENABLED = False to switch it off on purpose"  # noqa: E501
            )
        check_reactor(crawler, "StageLockMiddleware")
        check_stage_names(
            crawler.spidercls, self.settings, self.settings.stages, "REDISLOCK_STAGES"
        )
        self.slots = RequestSlots.of(crawler, self.settings, clock=clock)
        self.locks = self.slots.locks
        capped = bool(self.settings.stages) or self.settings.keys.capped
        if capped:
            say_downloads_cut(self.settings.ttl, self.download_timeout)
        # keys and delays
        self.throttle = (
            ScopeThrottle.of(crawler, self.settings, clock=clock) if self.settings.keyed else None
        )
        # requests waiting here for a slot, and what becomes of them at close
        self.waits = CloseWaits.of(crawler, self.settings)
        # what the adaptive limits learn from answers, and the pauses Retry-After asks for
        self.outcomes = Outcomes(crawler, self.settings, self.slots, self.throttle, clock)
        crawler.signals.connect(self.spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(self.spider_closed, signal=signals.spider_closed)
        crawler.signals.connect(self.request_left, signal=signals.request_left_downloader)

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        return cls(crawler)

    def spider_opened(self, spider: Spider) -> None:
        """Say so when a cache or robots.txt middleware runs after this one (its requests would take
        slots); bound downloads by their slots' leases again as they start."""
        if self.locks is not None:
            at_download_start(self.crawler, self._at_download_start)
        late = [
            type(mw).__name__
            for mw in middlewares_after(self.crawler, self)
            if isinstance(mw, EARLY_TYPES)
        ]
        if late:
            logger.warning(
                "%s run(s) after StageLockMiddleware: cache hits and robots.txt refusals then take a slot; give StageLockMiddleware a higher order (950)",  # noqa: E501
                ", ".join(late),
            )

    # -- the request's way through -----------------------------------------------------------------

    def process_request(
        self, request: Request, spider: Spider | None = None
    ) -> Coroutine[Any, Any, None] | None:
        """None at once when there is nothing to wait for; a coroutine only when the request must
        wait here.

        A plain method keeps uncapped requests, and requests whose slot came with them from the
        scheduler, free of any coroutine round trip. A request that goes with a slot goes with a
        download timeout that ends within the slot's lease (:meth:`_within_lease`).
        """
        through = self._through(request)
        if self.locks is None:
            return through
        if through is None:
            self._within_lease(request)
            return None
        return self._then_within_lease(through, request)

    async def _then_within_lease(
        self, through: Coroutine[Any, Any, None], request: Request
    ) -> None:
        await through
        self._within_lease(request)

    def _within_lease(self, request: Request) -> None:
        """Bound the download of a request that holds slots (of its stage, key, scopes) by the
        lease that ends first, as last confirmed: Scrapy aborts it (``download_timeout``:
        TimeoutError, retried as usual) half a renewal interval before Redis could give the slot
        to another process, whatever happens to this process's link to Redis meanwhile. A renewal
        extends the lease but not a download already under way: a download longer than the lease
        is cut (the log says so at start-up when DOWNLOAD_TIMEOUT is longer than REDISLOCK_TTL);
        counted as ``redislock/<stage>/lease_bounded`` (``redislock/keys/<key>/lease_bounded``)
        when the lease is shorter than the request's own timeout."""
        self.outcomes.going(request)
        first = self._first_lease_end(request)
        if first is None:
            out_of_lease(request)
            return
        locks, permit, end = first
        if within_lease(request, end - self.clock(), self.download_timeout):
            locks.count(locks.stage_of(permit) or permit.name, "lease_bounded")

    def _at_download_start(self, request: Request) -> None:
        """As its download starts, after its downloader slot's queue and delay: bounded again by
        its slots' leases as now confirmed. One that ran out meanwhile (this process cut off from
        Redis) is cut at once, not sent while its slot may be another process's."""
        first = self._first_lease_end(request)
        if first is not None:
            within_lease_at_start(request, first[2] - self.clock(), self.download_timeout)

    def _first_lease_end(self, request: Request) -> tuple[StageLocks, SlotPermit, float] | None:
        """Of the slots ``request`` holds (its stage's, and its key's and scopes' too: the cap of a
        broad crawl is its key's), the one whose lease ends first, as last confirmed: its registry,
        it, and that end less half its renewal interval; None when it holds none."""
        assert self.slots is not None
        held = self.slots.held(request)
        if not held:
            return None
        # read once per slot: a registry's interval is a property over its locks
        lines, permit = held[0]
        locks = lines.locks
        end = lease_end(permit, locks.renew_interval)
        for other_lines, other in held[1:]:
            other_end = lease_end(other, other_lines.locks.renew_interval)
            if other_end < end:
                locks, permit, end = other_lines.locks, other, other_end
        return locks, permit, end

    def _through(self, request: Request) -> Coroutine[Any, Any, None] | None:
        """What ``request`` waits for here before it may go: a coroutine, or None when it may go
        now."""
        if self.locks is None or self.slots is None:
            self._refuse_unthrottled(request)
            return None
        # None also for a slot no longer usable: the request waits here instead
        handed = self.slots.take(request)
        if isinstance(handed, SlotPermit):
            return self._keys(request, handed.name, slotted=True)
        if handed is not None:
            # the scheduler's verdict after REDISLOCK_WAIT_TIMEOUT
            self._fail_timeout(request, handed)
        stage = stage_of(request, self.settings, self.crawler.spider)
        if stage is None:
            return self._keys(request, None)
        try:
            capped = self.locks.is_capped(stage)
        except UnknownStage as exc:
            self._drop_unknown(request, stage, exc)
        if not capped:
            return self._keys(request, stage)
        return self._wait_here(request, stage)

    def _keys(
        self, request: Request, stage: str | None, slotted: bool = False
    ) -> Coroutine[Any, Any, None] | None:
        """After the stage slot (``slotted``: the request holds one): the key slot and the delays
        (:mod:`~scrapy_redislock.requests.throttle`), if any."""
        through = None if self.throttle is None else self.throttle.prepare(request, stage)
        return None if through is None else self._through_throttle(request, stage, slotted, through)

    async def _through_throttle(
        self, request: Request, stage: str | None, slotted: bool, through: Coroutine[Any, Any, None]
    ) -> None:
        """The throttle may take long (a busy key, delays): a slot that stopped being usable meanwhile
        is dropped and taken again, the stage slot first (a key slot is always the last one
        taken)."""
        try:
            await through
        except AcquireTimeout as exc:
            self._fail_timeout(request, exc)
        assert self.throttle is not None and self.slots is not None
        key_usable = self.throttle.usable(request)
        if slotted and stage is not None and self.slots.take(request) is None:
            await self._wait_here(request, stage)
        elif not key_usable:
            again = self._keys(request, stage, slotted)
            if again is not None:
                await again

    def _refuse_unthrottled(self, request: Request) -> None:
        stage = stage_of(request, self.settings, self.crawler.spider)
        if stage is None:
            return
        self.crawler.stats.inc_value("redislock/throttling_off")
        raise ThrottlingDisabled(
            f"request of stage {stage!r} refused: REDISLOCK_ENABLED is False, and it must not go out unthrottled (remove {MIDDLEWARE_PATH} from DOWNLOADER_MIDDLEWARES to crawl unthrottled on purpose)"  # noqa: E501
        )

    def _drop_unknown(self, request: Request, stage: str, exc: UnknownStage) -> None:
        """A request of a stage nobody configured is dropped, never sent uncapped: said once per
        stage at ERROR, counted, and the crawl then finishes as ``redislock_unknown_stage``."""
        self.crawler.stats.inc_value("redislock/unknown_stage")
        if not self.unknown:
            # connected now, so that it runs after every other spider_closed handler
            self.crawler.signals.connect(self._unclean_finish, signal=signals.spider_closed)
        if stage not in self.unknown:
            logger.error(
                "Request %s: %s. It is dropped, as is every request of that stage (counted as redislock/unknown_stage), and the crawl will finish as redislock_unknown_stage: add the stage to REDISLOCK_STAGES (None for no cap) or fix its name",  # noqa: E501
                request,
                exc,
            )
        self.unknown[stage] += 1
        raise IgnoreRequest(str(exc))

    def _unclean_finish(self, spider: Spider, reason: str) -> None:
        """Requests were dropped: not a clean finish. A reason of ``finished`` that CoreStats set
        is replaced (another reason, a timeout or a shutdown, is kept), and Scrapy's commands exit
        with status 1 for a crawler left without a spider (as after a failed start)."""
        logger.error(
            "Dropped requests of unknown stages: %s; the crawl finishes as redislock_unknown_stage",
            dict(self.unknown),
        )
        if reason == "finished":
            self.crawler.stats.set_value("finish_reason", "redislock_unknown_stage")
        self.crawler.spider = None

    def _fail_timeout(self, request: Request, error: BaseException) -> NoReturn:
        """Raise the error; an AcquireTimeout is not retried unless RETRY_EXCEPTIONS names
        AcquireTimeout (it is an OSError, which RetryMiddleware retries by default: the wait would
        be REDISLOCK_WAIT_TIMEOUT times RETRY_TIMES + 1)."""
        if isinstance(error, AcquireTimeout) and not self.retry_timeouts:
            request.meta["dont_retry"] = True
        raise error

    async def _wait_here(self, request: Request, stage: str) -> None:
        """Wait in Redis's FIFO (no StageScheduler, or a request that bypassed it); see the module
        docstring for what happens when the spider closes meanwhile."""
        assert self.locks is not None and self.slots is not None
        # a key's or scope's slot it still holds goes back: none is held waiting for a stage's (the
        # one order; a request whose stage the scheduler did not see as capped may come with them)
        self.slots.finish(request)
        started = self.clock()
        permit = await self._wait_for_slot(request, stage)
        while not self.locks.usable(permit):
            self.locks.release_soon(permit)
            permit = await self._wait_for_slot(request, stage)
        self.slots.hold(request, permit)
        self.locks.record_grant(stage, self.clock() - started)
        after = self._keys(request, stage, slotted=True)
        if after is not None:
            await after

    async def _wait_for_slot(self, request: Request, stage: str) -> SlotPermit:
        """A slot of ``stage`` from this process's line (IgnoreRequest at close:
        :mod:`~scrapy_redislock.requests.closewaits`)."""
        assert self.locks is not None and self.slots is not None
        slot = self.slots.wait(stage, self.settings.wait_timeout)
        try:
            return await self.waits.wait(request, stage, self.locks, slot)
        except AcquireTimeout as exc:
            self._fail_timeout(request, exc)

    def process_response(
        self, request: Request, response: Response, spider: Spider | None = None
    ) -> Response:
        if self.locks is not None:
            self.outcomes.response(request, response)
        self._release(request)
        return response

    def process_exception(
        self, request: Request, exception: Exception, spider: Spider | None = None
    ) -> None:
        if self.locks is not None:
            self.outcomes.exception(request, exception)
        self._release(request)

    def request_left(self, request: Request, spider: Spider) -> None:
        """The download is over (request_left_downloader fires before process_response): free the
        slot now."""
        self._release(request)

    def _release(self, request: Request) -> None:
        """The key's and scopes' slots go back first, then the stage's, each on to a request of this
        process waiting for it, or back to Redis (see RequestSlots.finish); this also frees slots
        the scheduler handed out with a request that never reached process_request (an earlier
        middleware answered it from a cache, or raised IgnoreRequest): such a request's delayed
        names have no start under way any more either."""
        if self.slots is None:
            return  # REDISLOCK_ENABLED is False: nothing was set up
        if self.throttle is not None and self.throttle.start_waits is not None:
            self.throttle.start_waits.went_out(request)
        self.outcomes.releasing(request)
        self.slots.finish(request)

    async def spider_closed(self, spider: Spider, reason: str) -> None:
        """Free every permit and waiter of this process (one call per stage) before spider_closed
        completes."""
        assert self.slots is not None
        if self.throttle is not None:
            await self.throttle.close()
        await self.slots.close()


def _names_acquire_timeout(exceptions: list[Any]) -> bool:
    """Whether RETRY_EXCEPTIONS names AcquireTimeout (or a subclass) itself, not only a base class
    like OSError."""
    for entry in exceptions:
        try:
            loaded = load_object(entry) if isinstance(entry, str) else entry
        except (ImportError, ValueError, NameError, AttributeError):
            continue
        if isinstance(loaded, type) and issubclass(loaded, AcquireTimeout):
            return True
    return False
