"""ScopeThrottle: what StageLockMiddleware adds per request for its key and its other throttling
scopes (REDISLOCK_STAGE_KEY, REDISLOCK_SCOPES; docs/scopes.md): their slots, delays and rate windows.

After the request's stage slot (from StageScheduler, or waited for in the middleware), in this fixed
order:

1. the slot of its key (the domain, ...) when the key is capped (REDISLOCK_KEY_LIMIT,
   REDISLOCK_KEY_LIMITS), waited for in Redis's FIFO like a stage's;
2. its stage's delay (REDISLOCK_DELAYS[stage]), then its key's (REDISLOCK_DELAY,
   REDISLOCK_DELAYS[key]): each a booking of the next start on Redis's clock, a sleep until it and
   a confirmation against the previous confirmed start (:mod:`scrapy_redislock.lock.delay`). When
   the request reaches Scrapy's downloader (``request_reached_downloader``) more than
   ``LATE_SEND`` after a confirmation came back, the next start of that stage or key is moved back
   by the lateness (:mod:`~scrapy_redislock.crawl.delays`). Under StageScheduler, one request per
   delayed stage, key or scope and process sleeps here at a time, the others queued
   (:class:`~scrapy_redislock.requests.startwaits.StartWaits`, which this throttle keeps);
3. the rate windows (a sliding log on Redis's clock): the stage's (its REDISLOCK_STAGES policy),
   the key's, then the other scopes' by name.

Why this order cannot deadlock: a key slot is the last slot a request takes, so a request holding
one waits for no other slot (only for bounded delays and its download), and always ends and frees
it; a request holding a stage slot may wait for a key slot, but the holders of that key slot are all
past every slot wait. No cycle of waits can form, in one process or across many. The price: a
request waiting for a busy key keeps its stage slot (and, like any request waiting in a downloader
middleware, one of CONCURRENT_REQUESTS) meanwhile.

The key's and scopes' slots are kept by request object in the same record as its stage's
(:class:`~scrapy_redislock.requests.requestslots.RequestSlots`) and given back on the same paths,
before it (response, exception, request_left_downloader, a sweep at every renewal tick for requests
gone from the downloader, spider close). A request that waits here for a key's or scope's slot
waits in this process's line for it, as one waiting for a stage's does
(:mod:`~scrapy_redislock.requests.lines`):
a slot freed here passes straight to the oldest of them while it is younger than
REDISLOCK_LOCAL_REUSE (and half REDISLOCK_TTL) since Redis's grant, with no Redis command (counted
as ``redislock/keys/reused``); else it goes back to Redis. When the spider closes, a request that
left StageScheduler and waits here for its key's slot goes back to the scheduler's queue, as one
waiting for its stage's does (:mod:`~scrapy_redislock.requests.closewaits`). A key slot lost, or
past its lease on this process's clock, by the end of the delays is dropped
(:meth:`ScopeThrottle.usable`) and taken again: a request never starts with a slot another process
may hold by now. Nor with a slot StageScheduler took for the key the request had in the scheduler,
when a middleware before this one changed what REDISLOCK_STAGE_KEY's function reads: that slot goes
back and the request's own key's is taken. A request that waited for a delay carries its confirmed
start in ``meta["redislock_start_at"]`` (seconds since the epoch, Redis's clock; the key's when it
had a stage delay too). A key function that raises fails that request with
:class:`~scrapy_redislock.errors.KeyFunctionError` (stat ``redislock/key_errors``), not the crawl.

Stats: redislock/keys/{acquired,wait_time_total,wait_time_max,retired_idle,taken_in_downloader,reused,dropped_at_close},
redislock/keys/<key>/{timeouts,lost,unusable,lease_bounded} (a download cut where its key's or
scope's slot's lease ends, as StageLockMiddleware cuts it where a stage slot's ends),
redislock/delay/{waits,wait_time_total,held_back,late_sends,send_lag_max}, redislock/key_errors.

Reads CONCURRENT_REQUESTS (the bound on the waits for queued requests), ROBOTSTXT_OBEY,
ROBOTSTXT_USER_AGENT and USER_AGENT (REDISLOCK_CRAWL_DELAY) and, through the checked settings, the
key, scope, delay, REDISLOCK_LOCAL_REUSE, REDISLOCK_TTL and REDISLOCK_WAIT_TIMEOUT settings.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar
from weakref import WeakKeyDictionary

from scrapy import signals

from scrapy_redislock.crawl.delays import Start
from scrapy_redislock.crawl.early import early_middlewares, robots_unknown
from scrapy_redislock.crawl.engine import one_per_crawler, wake_engine
from scrapy_redislock.crawl.keylocks import KEY_LOCK_PREFIX, KeyLocks
from scrapy_redislock.crawl.keys import domain, request_key
from scrapy_redislock.crawl.reach import REDIS_ERRORS
from scrapy_redislock.crawl.scopes import MOST_SECONDS, NO_POLICY, ScopePolicy, request_scopes
from scrapy_redislock.crawl.stagelocks import SlotPermit
from scrapy_redislock.crawl.stages import stage_of
from scrapy_redislock.errors import KeyFunctionError, Paused
from scrapy_redislock.requests.closewaits import CloseWaits
from scrapy_redislock.requests.kept import KeptSlots
from scrapy_redislock.requests.lines import SlotLines
from scrapy_redislock.requests.requestslots import RequestSlots
from scrapy_redislock.requests.startwaits import StartWaits, lock_name, wait_name

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler

    from scrapy_redislock.crawl.settings import RedisLockSettings
    from scrapy_redislock.lock.core import Clock


START_META = "redislock_start_at"  # the confirmed start, on Redis's clock (seconds since the epoch)
STARTS_META = "redislock_starts"  # every confirmed start of the request: {stage or key:<name>: at}
logger = logging.getLogger(__name__)
T = TypeVar("T")


class ScopeThrottle:
    """Key slots and delays of the requests of one crawler (see the module docstring)."""

    @classmethod
    def of(
        cls,
        crawler: Crawler,
        settings: RedisLockSettings,
        *,
        attr: str = "_redislock_throttle",
        clock: Clock = time.monotonic,
    ) -> ScopeThrottle:
        """The crawler's one instance (the middleware and StageScheduler share it; the first
        caller's ``clock``)."""
        return one_per_crawler(crawler, attr, lambda: cls(crawler, settings, clock=clock))

    def __init__(
        self, crawler: Crawler, settings: RedisLockSettings, *, clock: Clock = time.monotonic
    ) -> None:
        self.crawler = crawler
        # monotonic seconds: how long a slot took to get (KeyLine, which goes with this throttle, too)
        self.clock = clock
        self.settings = settings
        self.locks = KeyLocks.of(crawler, settings, clock=clock)
        # the stages', keys' and scopes' delays and rate windows, over the keys' runner
        self.delays = self.locks.delays
        # the records of what each request holds: its key's and other scopes' slots
        # (meta["redislock_scopes"], REDISLOCK_SCOPES_OF) beside its stage's
        self.slots = RequestSlots.of(crawler, settings, clock=clock)
        # the requests waiting in the middleware, for a slot of a key or scope among others
        self.waits = CloseWaits.of(crawler, settings)
        # per key or scope: this process's line for its slots, for requests waiting in the
        # middleware and StageScheduler's queued ones (a grant none waits for goes back to Redis);
        # each wait in Redis blocks one connection: at most CONCURRENT_REQUESTS at once for queued
        # requests (a request waiting in the line holds a place of its own); for the queued ones, one
        # wait per name kept open while they outnumber what is kept (keep_asking)
        self.lines = SlotLines(
            KeptSlots(crawler, self.locks, could_use=self._could_use, most=1, keep_asking=True),
            reuse_for=settings.reuse_bound,
            kind="key",
            ask_timeout=settings.wait_timeout,
            bound=crawler.settings.getint("CONCURRENT_REQUESTS"),
        )
        # StageScheduler's (serve_scheduler): how many slots a name's queued requests could use
        self._scheduler_could_use: Callable[[str], int] | None = None
        # per request: its capped names, key then scopes, as StageScheduler read them, or as this
        # middleware did when they changed on the way (a proxy rotator)
        self.names: WeakKeyDictionary[Request, tuple[str, ...]] = WeakKeyDictionary()
        # the keys' renewals and the lines' upkeep run with the stages', in the front's rounds
        self.slots.serve_keys(self.locks, self.lines)
        # confirmed starts of requests not yet in Scrapy's downloader (gone with their request)
        self.starts: WeakKeyDictionary[Request, list[Start]] = WeakKeyDictionary()
        # request_reached_downloader is connected with the first confirmed start (:meth:`_delay`):
        # a crawl without delays pays no signal receiver per request
        self._watching_sends = False
        # robots.txt Crawl-delay per host (REDISLOCK_CRAWL_DELAY), as this process parsed it
        self.crawl_delays: dict[str, float] = {}
        # the cache and robots.txt middlewares before ours, found on first use
        self._early: tuple[Any, ...] | None = None
        # per delayed stage, key or scope, the request between StageScheduler and its start (one at
        # a time: the others wait queued, not in the downloader); read by StageScheduler's admission
        self.start_waits: StartWaits | None = None
        self._rated = settings.rated  # read per request leaving StageScheduler
        # the stages with a delay or a rate window of their own
        self._paced_stages = frozenset(
            stage
            for stage in settings.stages
            if settings.policy_of(stage, stage=True).delay or stage in settings.stage_rates
        )
        if settings.paced:
            self.start_waits = StartWaits(
                self.delayed_names,
                lambda: wake_engine(crawler),
                lambda name: self.delays.rate_waiting(name and lock_name(name)),
                delayed=settings.delayed,
            )
            self._watch_sends()
        if settings.keys.crawl_delay:
            crawler.signals.connect(self.robots_parsed, signal=signals.robots_parsed)
            if not crawler.settings.getbool("ROBOTSTXT_OBEY"):
                logger.warning(
                    "REDISLOCK_CRAWL_DELAY is on but ROBOTSTXT_OBEY is off: no robots.txt is read, so no Crawl-delay applies"  # noqa: E501
                )

    def robots_parsed(self, robotparser: Any, request: Request) -> None:
        """A site's robots.txt was parsed here: its Crawl-delay (for our user agent) becomes the
        least delay of the site's key, for every process (each parses it before its first request
        of the site goes out)."""
        settings = self.crawler.settings
        agent = settings.get("ROBOTSTXT_USER_AGENT") or settings.get("USER_AGENT") or "Scrapy"
        try:
            delay = robotparser.crawl_delay(agent)
        except Exception as exc:  # a parser of the user's (ROBOTSTXT_PARSER) may fail
            logger.warning("Could not read the Crawl-delay of %s: %s", request.url, exc)
            return
        host = domain(request)
        if delay and host is not None and float(delay) > 0:
            if float(delay) > MOST_SECONDS:  # 1e14 s would make Redis refuse the delay's script
                logger.warning(
                    "robots.txt of %s asks for a Crawl-delay of %s s; the cluster keeps %s s, the longest delay there is",  # noqa: E501
                    host,
                    delay,
                    MOST_SECONDS,
                )
                delay = MOST_SECONDS
            self.crawl_delays[host] = float(delay)
            self.crawler.stats.inc_value("redislock/crawl_delay/sites")
            logger.info(
                "robots.txt of %s asks for a Crawl-delay of %s s: the whole cluster keeps it",
                host,
                delay,
            )

    def prepare(self, request: Request, stage: str | None) -> Coroutine[Any, Any, None] | None:
        """A coroutine taking the request's key and scope slots and waiting its delays and rate
        windows; None when it has none of them. KeyFunctionError (counted) when
        REDISLOCK_STAGE_KEY's or REDISLOCK_SCOPES_OF's function fails for it, or a scope of it
        matches no entry of REDISLOCK_SCOPES."""
        try:
            key, scopes = self.key_and_scopes(request)
        except KeyFunctionError:
            self.crawler.stats.inc_value("redislock/key_errors")
            raise
        policy_of = self.settings.policy_of
        staged = policy_of(stage, stage=True) if stage is not None else NO_POLICY
        keyed = policy_of(key) if key is not None else NO_POLICY
        key_delay = self.key_delay(request, keyed.delay) if key is not None else 0.0
        waits = staged.delay or key_delay or staged.retry_after or scopes
        rated = keyed.rate is not None or staged.rate is not None
        if keyed.limit is None and not (waits or rated):
            # nothing capped now; a slot StageScheduler took for a key or scope it had there goes
            # back (a middleware before this one changed what the functions read)
            return (
                self._through(request, stage, staged, key, keyed, 0.0)
                if self.held_scopes(request)
                else None
            )
        if (
            keyed.limit is not None
            and not (waits or rated)
            and self._handed_for(request, f"{KEY_LOCK_PREFIX}{key}")
        ):
            return None
        return self._through(request, stage, staged, key, keyed, key_delay, scopes)

    def _handed_for(self, request: Request, name: str) -> bool:
        """Whether StageScheduler handed ``request`` a usable slot of its key's lock ``name`` with
        no pause to check (:meth:`_queued_key`), the request's key being all it waits for: then
        :meth:`_through` would await nothing, and :meth:`prepare` makes no coroutine (a broad
        crawl's every request). A slot no longer usable is dropped here, as :meth:`usable` drops
        it, and :meth:`_through` takes another."""
        if [p.name for p in self.held_scopes(request)] != [name]:
            return False
        return not self._queued_key(request, name) and self.usable(request)

    def key_and_scopes(self, request: Request) -> tuple[str | None, tuple[str, ...]]:
        """The request's key (REDISLOCK_STAGE_KEY) and its scopes beside its stage and key, each
        with a policy of REDISLOCK_SCOPES (KeyFunctionError when a function fails for it, or names a
        scope that has no policy)."""
        key = request_key(request, self.crawler.spider, self.settings.keys.stage_key)
        scopes = request_scopes(request, self.crawler.spider, self.settings.keys.scopes_of)
        for scope in scopes:
            if self.settings.keys.scopes.match(scope) is None:
                raise KeyFunctionError(
                    f"scope {scope!r} of {request.url} matches no entry of REDISLOCK_SCOPES: give it a policy there (a name or a glob pattern such as 'proxy:*')"  # noqa: E501
                )
        return key, tuple(scope for scope in scopes if scope != key)

    def delayed_names(self, request: Request) -> tuple[str, ...]:
        """In StartWaits' names (:func:`~scrapy_redislock.requests.startwaits.wait_name`), in the
        one order: the request's stage when it keeps a delay, or its rate window was last found
        full here (not while its site's robots.txt is read); its key when it keeps a delay (its
        own, REDISLOCK_DELAY, its site's Crawl-delay, or with REDISLOCK_CRAWL_DELAY a site whose
        robots.txt this process has not read yet), then its other scopes with one, by name, then
        its key and scopes whose rate window this process last found full; none when a function
        fails for it (the middleware fails it then)."""
        try:
            key, scopes = self.key_and_scopes(request)
        except KeyFunctionError:
            return ()
        policy_of = self.settings.policy_of
        named = []
        if self._paced_stages:  # a request's stage is looked up only where one may be held
            stage = stage_of(request, self.settings, self.crawler.spider)
            if (
                stage in self._paced_stages
                and (policy_of(stage, stage=True).delay or self.delays.rate_full(stage))
                # one waiting for its site's robots.txt (which may take a download timeout)
                # would hold the stage's requests of every site back
                and not self._robots_pending(request)
            ):
                named.append(wait_name(stage))
        if key is not None and (
            self.key_delay(request, policy_of(key).delay) or self._robots_unknown(request, key)
        ):
            named.append(key)
        named.extend(scope for scope in scopes if policy_of(scope).delay)
        if self._rated:
            everyone = (key, *scopes) if key is not None else scopes
            named.extend(
                name
                for name in everyone
                if name not in named
                and policy_of(name).rate is not None
                and self.delays.rate_full(f"{KEY_LOCK_PREFIX}{name}")
            )
        return tuple(named)

    def _robots_unknown(self, request: Request, key: str) -> bool:
        """With REDISLOCK_CRAWL_DELAY, RobotsTxtMiddleware (before ours) has not read the site's
        robots.txt yet: its Crawl-delay may come, so its requests go one at a time till then. Only
        where the key is the site itself: a key many sites share (a download slot, a proxy) would
        otherwise fetch their robots.txt files one after another."""
        if not self.settings.keys.crawl_delay or domain(request) != key:
            return False
        return self._robots_pending(request)

    def _robots_pending(self, request: Request) -> bool:
        """RobotsTxtMiddleware (before ours) has not read the robots.txt of the request's site yet
        (the request waits for it there first)."""
        if self._early is None:
            self._early = early_middlewares(self.crawler)
        return robots_unknown(request, self._early)

    def key_delay(self, request: Request, delay: float) -> float:
        """The key's delay: the configured one, or the site's robots.txt Crawl-delay when
        longer."""
        if self.crawl_delays:
            host = domain(request)
            if host is not None:
                delay = max(delay, self.crawl_delays.get(host, 0.0))
        return delay

    async def _through(
        self,
        request: Request,
        stage: str | None,
        staged: ScopePolicy,
        key: str | None,
        keyed: ScopePolicy,
        key_delay: float,
        scopes: tuple[str, ...] = (),
    ) -> None:
        """In one global order (docs/scopes.md): the slots (the stage's came before: the key's,
        then the other scopes' by name), then the delays, then the rate windows; each name by its
        policy (``staged``: the stage's, ``keyed``: the key's)."""
        policy_of = self.settings.policy_of
        others = [(scope, policy_of(scope)) for scope in scopes]
        named = [(key, keyed), *others] if key is not None else others
        names = [name for name, policy in named if policy.limit is not None]
        self.names[request] = tuple(names)  # as they are now: counted where it is (KeyLine.load)
        held = [p.name.removeprefix(KEY_LOCK_PREFIX) for p in self.held_scopes(request)]
        if held != names[: len(held)]:
            # not the first of the request's names: a middleware before this one changed what
            # REDISLOCK_STAGE_KEY's or REDISLOCK_SCOPES_OF's function reads since StageScheduler took
            # them; they go back, and the request's own are taken, in the one order
            self.slots.free_scopes(request)
        for name in names:
            await self._take_slot(request, name)
        if stage is not None and staged.delay:
            await self._delay(request, stage, staged.delay)
        elif stage is not None and staged.retry_after:
            await self._pause_check(request, stage)
        if key is not None and key_delay:
            await self._delay(request, f"{KEY_LOCK_PREFIX}{key}", key_delay)
        elif (
            key is not None
            and keyed.limit is not None
            and self._queued_key(request, f"{KEY_LOCK_PREFIX}{key}")
        ):
            await self._pause_check(request, f"{KEY_LOCK_PREFIX}{key}")
        elif (
            key is not None
            and keyed.limit is None
            and keyed.rate is not None
            and (self.settings.adaptive.retry_after or keyed.retry_after)
        ):
            # a key with only a rate window: the window's log knows no pause (rate.lua)
            await self._pause_check(request, f"{KEY_LOCK_PREFIX}{key}")
        for scope, policy in others:
            if policy.delay:
                await self._delay(request, f"{KEY_LOCK_PREFIX}{scope}", policy.delay)
            elif policy.retry_after:
                await self._pause_check(request, f"{KEY_LOCK_PREFIX}{scope}")
        if stage is not None and staged.rate is not None:
            await self._rate(request, stage, staged.rate)
        for name, policy in named:
            if policy.rate is not None:
                await self._rate(request, f"{KEY_LOCK_PREFIX}{name}", policy.rate)

    async def _rate(self, request: Request, name: str, rate: tuple[int, float]) -> None:
        """Wait for a place in the rate window of ``name`` (a stage, or ``key:<scope>``)."""
        try:
            start = await self._start_of(
                request, name, self.delays.wait_rate(name, *rate, self.starts.get(request, ()))
            )
        finally:  # a full window's next queued request may leave StageScheduler (StartWaits)
            if self.start_waits is not None:
                self.start_waits.ended(request, wait_name(name))
        self._started(request, start)
        stats = self.crawler.stats
        stats.inc_value("redislock/rate/starts")
        if start.waited:
            stats.inc_value("redislock/rate/waits")
            stats.inc_value("redislock/rate/wait_time_total", start.waited)  # type: ignore[arg-type]  # (as below)

    def _queued_key(self, request: Request, name: str) -> bool:
        """The request's slot of ``name`` (``key:<key>``) needs a pause check: it came from the key's
        stream, or is a light slot the request did not take itself (``Holds.recheck``; a light
        take checks a pause itself, for its own request), and a Retry-After may pause the key
        (REDISLOCK_RETRY_AFTER, or its REDISLOCK_SCOPES entry)."""
        holds = self.slots.holds(request)
        permit = next((p for _, p in holds.slots if p.name == name), None) if holds else None
        light = getattr(permit, "light", False)  # a QuorumPermit never is
        if permit is None or (light and not (holds is not None and holds.recheck)):
            return False
        key = permit.name.removeprefix(KEY_LOCK_PREFIX)
        return self.settings.adaptive.retry_after or self.settings.policy_of(key).retry_after

    async def _pause_check(self, request: Request, name: str) -> None:
        """Wait while a Retry-After pauses the starts of ``name`` (a start with no gap: one script
        of 4 commands when nothing is paused)."""
        start = await self._start_of(
            request, name, self.delays.wait_start(name, 0.0, self.starts.get(request, ()))
        )
        if start.waited:
            self.crawler.stats.inc_value("redislock/retry_after/waits")

    def capped_names(self, request: Request) -> tuple[str, ...]:
        """The request's capped names in the order their slots are taken: its key, then its other
        scopes by name; the slots StageScheduler takes before it lets a request go (none when a key
        or scope function fails for it: the middleware fails the request then, naming the
        error)."""
        try:
            key, scopes = self.key_and_scopes(request)
        except KeyFunctionError:
            return ()
        names = (key, *scopes) if key is not None else scopes
        policy_of = self.settings.policy_of
        return tuple(name for name in names if policy_of(name).limit is not None)

    def names_of(self, request: Request) -> tuple[str, ...]:
        """The request's capped names (:meth:`capped_names`), read once per request unless the
        middleware finds them changed."""
        found = self.names.get(request)  # no KeyError raised and caught per new request
        if found is None:
            found = self.names[request] = self.capped_names(request)
        return found

    async def _take_slot(self, request: Request, key: str) -> None:
        """Take a slot of ``key`` (the request's key or another scope of it) for the request: one
        look, else a wait in the key's first-come-first-served line."""
        if any(p.name == f"{KEY_LOCK_PREFIX}{key}" for p in self.held_scopes(request)):
            return  # handed by StageScheduler (a lost or late one is dropped by usable())
        # taken here, holding one of CONCURRENT_REQUESTS meanwhile (StageScheduler takes it before
        # a request of no capped stage leaves: keyline.py)
        self.crawler.stats.inc_value("redislock/keys/taken_in_downloader")
        started = self.clock()
        try:  # one look (a free slot in one script: lock/light.py), else a wait in its line
            taken = await self.locks.take(key)
        except (*REDIS_ERRORS, Paused):  # the wait retries, or waits the pause out
            taken = None
        if taken is not None:
            self.slots.hold(request, taken, self.lines)
            self.locks.record_grant(key, self.clock() - started)
            return
        # given back to the scheduler, or dropped, if the spider closes meanwhile
        permit = await self.waits.wait(
            request,
            key,
            self.locks,
            self.lines.wait(key, self.settings.wait_timeout),
            keyed=True,
        )
        self.slots.hold(request, permit, self.lines, recheck=getattr(permit, "light", False))
        self.locks.record_grant(key, self.clock() - started)

    async def _delay(self, request: Request, name: str, delay: float) -> None:
        try:
            start = await self._start_of(
                request, name, self.delays.wait_start(name, delay, self.starts.get(request, ()))
            )
        finally:  # the name's next queued request may leave StageScheduler and book its start
            if self.start_waits is not None:
                self.start_waits.ended(request, wait_name(name))
        self._started(request, start)
        self.crawler.stats.inc_value("redislock/delay/waits")
        self.crawler.stats.inc_value("redislock/delay/wait_time_total", start.waited)  # type: ignore[arg-type]  # (as above)

    async def _start_of(self, request: Request, name: str, waiting: Awaitable[T]) -> T:
        """A wait for the request's start of ``name`` (a stage, or ``key:<name>``): given back to
        the scheduler when the spider closes meanwhile, as a wait for a slot is (CloseWaits): a
        long Crawl-delay would otherwise hold the close up."""
        return await self.waits.wait(
            request,
            name.removeprefix(KEY_LOCK_PREFIX),
            self.locks,
            waiting,
            keyed=name.startswith(KEY_LOCK_PREFIX),
            start=True,
        )

    def _started(self, request: Request, start: Start) -> None:
        """The request's start of a delay or rate window: in its meta, and kept until it goes out
        (each later wait holds it back, and a late send moves it)."""
        request.meta[START_META] = start.at
        request.meta.setdefault(STARTS_META, {})[start.name] = start.at
        self.starts.setdefault(request, []).append(start)
        self._watch_sends()

    def _watch_sends(self) -> None:
        if not self._watching_sends:
            self._watching_sends = True
            self.crawler.signals.connect(
                self.reached_downloader, signal=signals.request_reached_downloader
            )

    def reached_downloader(self, request: Request) -> None:
        """The request's confirmed starts went out now (a late one moves its key's next start);
        none of its starts is under way any more."""
        for start in self.starts.pop(request, ()):
            self.delays.went_out(start)
        if self.start_waits is not None:
            self.start_waits.went_out(request)

    def held_scopes(self, request: Request) -> list[SlotPermit]:
        """The request's key and scope slots held now, in the order taken."""
        return [permit for lines, permit in self.slots.held(request) if lines is self.lines]

    def usable(self, request: Request) -> bool:
        """Whether the request's key and scope slots, if any, may still go with it (see
        ``StageLocks.usable``); when one may not, all of them are dropped (released, in case Redis
        still holds them) and taken again in their order."""
        held = self.held_scopes(request)
        if all(self.locks.usable(p) for p in held):
            return True
        for _, permit in self.slots.drop_scopes(request):
            self.locks.release_soon(permit)
        return False

    def serve_scheduler(self, could_use: Callable[[str], int]) -> None:
        """StageScheduler's key line, once: ``could_use(name)``, how many slots the queued requests
        of a key or scope could use now (the lines keep what comes for them, and wait for them)."""
        self._scheduler_could_use = could_use

    def _could_use(self, name: str) -> int:
        return 0 if self._scheduler_could_use is None else self._scheduler_could_use(name)

    async def close(self) -> None:
        await self.locks.close()
