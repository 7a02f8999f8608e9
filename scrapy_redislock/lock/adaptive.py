"""An adaptive limit: one controller per lock for the whole cluster, its state in Redis beside the
lock, the limit it sets the lock's own (meta ``limit``), so everything that reads limits keeps working.

**Who runs it.** Nobody in particular. Every process reports a :class:`Sample` of what it saw of
the lock's requests (:func:`report`, about once a second per lock). ``scripts/adapt_report.lua``
merges it into the one current :class:`Window` of the lock (the ``adapt`` hash, on Redis's clock)
and, when that window is due (``window`` seconds old and ``min_samples`` outcomes; a quarter of
that old when more than ``overload_threshold`` of them are overloads or errors), hands it with
the :class:`ControllerState` and its version to the process that happened to report. That process
computes :func:`next_state` (pure, deterministic) and commits it (:func:`commit`,
``scripts/adapt_commit.lua``): the version must still match, so of several processes that got the
same window exactly one applies its result; the window restarts with fresh counters and the
lock's limit moves (``change_limit`` of ``_lib.lua``). No leader, nothing to elect: a process that
dies between report and commit leaves the window due, and the next report of anyone takes it. An
idle controller's hash expires ``idle_windows`` windows after the last report; the next report
starts again from the lock's limit.

**The algorithm** (per window; inspired by Netflix concurrency-limits' Vegas limit and Envoy's
adaptive concurrency). ``rtt`` is the window's mean latency (download latency of the responses
that were not overload answers), ``noload`` the estimate of the latency with no queue at the site,
``in_flight`` the mean number of the lock's slots in use:

1. Overload first (AIMD): when 429/503 answers plus errors (timeouts, connection errors) are more
   than ``overload_threshold`` (1%) of the window's outcomes, ``limit = limit * backoff`` (0.75).
2. Else Vegas: ``queue = in_flight * (1 - noload / rtt)``, the requests waiting at the site.
   Below ``alpha_share`` (a tenth) of ``in_flight``, but at least ``alpha`` (0.3), the limit
   grows by 1, unless it was not used ("app limited": mean in-flight below ``app_limited`` (0.5)
   of the limit applied): a limit nobody fills says nothing about the site. When the queue is
   above ``beta_share`` (a fifth) of ``in_flight``, but at least ``beta`` (0.6), by more than
   ``confidence`` (2) standard errors of the window's own latencies (it sums their squares too),
   it shrinks by ``max(1, shrink_gain * excess)`` (gain 0.5: a big queue is halved towards that
   threshold in one window, a small one costs one slot), at most down to ``limit * backoff``.
   Else it holds. Why a share of the requests out, not 0.3 to 0.6 requests whatever the limit:
   the site is only full with a queue, and the crawling processes hold a slot longer than the
   site has the request (the more so on a busy CPU); held at 0.3 to 0.6, a real crawl
   (bench/adaptive.py ``--refuse 1.5``, K = 8) held its limit at 9 and the site at 8.2 in flight,
   77 of its 80 pages/s, where a fixed cap of 12 kept 10.5 to 11.5 there without a refusal; with
   a share, 9 to 11 and 9.1 to 9.8. A share, not a count of 1 or 2: 2 is half of K = 4 (the
   latency 1.5 times), and a site of K = 2 refusing past 1.5 K = 3 is past it at K + 2.
   With exact latencies the error is 0 and this is Vegas as is; with real, noisy ones a single
   slow window is no queue (without it, in a simulation whose latencies scattered with a
   coefficient of variation of 1, the limit stayed near 6 whatever the capacity, from 8 to 60).
3. ``noload`` is the minimum window latency since the last *probe*, where a window lowers it
   only when it is lower by more than ``confidence`` standard errors (of the difference), or lower
   and measured more precisely (a first window of a few requests, some opening connections, is no
   estimate: in a real crawl one such window kept ``noload`` 20% high, and the limit 3 above K,
   until the next probe): the plain minimum of noisy means sits 10 to 15% below the truth after a
   few dozen windows, which inflates the queue estimate in proportion to the limit, so that in a
   simulation growth stalled at 15 to 30 for a capacity of 60. Every ``probe_every`` (30)
   windows the applied limit drops to ``probe_fraction`` (0.5) of the limit for two windows (the
   first drains the site's queue, the second measures), and the second window's latency *replaces*
   ``noload``: so it can rise again, and a site that got slower is re-measured (Envoy re-measures
   its minimum latency at low concurrency the same way). A minimum that merely rises slowly would
   creep: held at ``K + 1``, every window shows ``base * (K + 1) / K``, the minimum rises to it,
   the queue estimate falls below ``alpha`` and the limit grows by one each time it caught up. A
   probe costs at most 2 windows in 30 at half the limit. A controller with no ``noload`` yet
   (new, or its hash expired) probes first; one at a limit no higher than a probe's measures in
   place. The end of a slow start probes in place (below).
4. **Slow start**: a new controller at the minimum grows its limit by up to ``start_growth``
   (1.5) a window while the site shows no significant queue (and the limit was full), as TCP
   does with 2: to ``start_growth`` times the share of the limit that the site *surely* served
   at once, ``1 - (queue + confidence * error) / in_flight`` (the queue estimate at its upper
   bound, ``confidence`` standard errors of both latencies, the window's and the no-load
   estimate's, above it: a no-load latency from the start's first few answers is as uncertain
   as a window's, and a start that counted the window's error alone went 7, 10, 13 against
   K = 8 refusing past 12, in 3 of 28 runs of the crawl test), by one at least (unless the
   window's own latencies show a queue Vegas would shrink), but never past ``start_growth``
   times the share it served by the estimate, ``noload / rtt``, of the limit applied (the float
   limit is up to one higher: a start at K = 6 went 6 -> 10), or that limit plus one where Vegas
   would grow (from 1, times 1.5 floors back to 1); it never shrinks there. With exact latencies
   and no queue both shares are 1: times 1.5 (2, 3, 4, 6, 9, ...). Both count only
   :attr:`Window.site_share` of the slots: the share of their time the site had the requests
   (latencies over the slots' hold times, which each answer reports); a busy crawling process
   holds slots whose requests are not at the site, so their queue hides (9 slots against K = 8
   had 8.3 at the site, the latency 3% up, and the start went 9 -> 13 at a load average of 13),
   and it sends them all when it catches up. The
   first window with a significant queue holds the limit for one more window
   (``START_HOLDING``), and a second in a row ends the start at what the site served at once,
   ``in_flight * noload / rtt`` (its capacity, as the queue shows it), but not below
   ``limit / start_growth`` (at most the step before, which showed no significant queue); after
   a calm one it grows on. Vegas goes on from the end, after a probe *in place*: two windows at
   that limit (``DRAINING_IN_PLACE``, ``MEASURING_IN_PLACE``: what the site served at once, no
   queue there), the second's latency the no-load estimate at the load it will see (the start's
   windows ran at lower loads, and the crawling processes' own delays grow with theirs). Why
   two windows: those delays, for a moment, read as a significant queue at 5 to 8 against K = 8
   in 4 of 10 real crawls (bench/adaptive.py ``--refuse 1.5``), which ended their starts there;
   holding is as safe as the window before, which drew no refusal (one would have cut the
   limit at once). Why in place: the probe at half the limit that followed cost two windows at
   3 or 4 against K = 8 in real crawls. Not 2: a site that serves K at once answers in the same time
   up to K, so no window at or below K tells how far K is, and one step from there reaches
   ``start_growth * K``: doubling sent 2K in flight, which a site with a short queue (refusing
   past 1.5 K, bench/adaptive.py ``--refuse 1.5``) answered with a burst of 503s until the next
   window. Why the share surely served: only a step from above K can pass ``start_growth * K``,
   and just above K the queue is one request, which noise hides; from the share it surely served
   such a step stays within ``start_growth * K`` unless the window's mean latency read more than
   ``confidence`` standard errors low. Growing from the limit whenever the queue estimate was
   below ``alpha`` (and from the limit less the queue above it) passed it on a loaded machine:
   against K = 8 refusing past 12, a noisy window at 7 read a queue of one, the step from the 6
   it served went to 9, whose queue of one read below ``alpha``, and 9 * 1.5 went to 14 (5% of
   the answers refused); in a simulation with noisy latencies (tests/lock/test_adaptive.py) 7
   starts of 200 passed 12, none since. The price is the noise's: smaller steps the fewer and the
   more scattered a window's answers (a coefficient of variation of 0.5 and 40 answers: about
   1.3 instead of 1.5), so K = 8 is first reached in the 10th window instead of the 8th (median
   of that simulation). From 1 to K takes about ``log1.5(K) + 3`` windows with exact latencies,
   not K (a capacity of 60 is found in 12 windows, not 60; with doubling, in a simulation with
   noisy latencies the medians for K = 60 rose from 16-38 to 26-59).
5. Clamped to ``[minimum, maximum]``. The limit is kept as a float; the lock gets its floor
   (``floor(limit)``: never more than the controller decided), or the probe's limit while probing.

**What it converges to.** Against a site serving K requests at once, each in ``base``, the rest
waiting FIFO (latency ``base * in_flight / K`` past K) and 503 past 2K: with ``noload = base`` the
queue estimate is ``in_flight * (1 - K / in_flight) = in_flight - K`` past K, and 0 up to K. So the
slow start grows the limit by half until it passes K (never past 1.5 K), holds it a window, then
sets it to K; there the queue is 0 and it grows by one a window while the queue (``in_flight - K``)
is below a tenth of the limit, and holds while it is no more than a fifth: at K + 1 for K = 4 to
9 (K + 3 for K = 20), between K and K + 1 for K of 2 or 3 (a queue of one is above 0.6), at most
``K / 0.8`` from above (tests/lock/test_adaptive.py): the site full, a request or a few waiting,
within 1.5 K. The thresholds are well below Vegas's usual 3 and 6 requests: the goal here is the
site's capacity itself, which real crawls of bench/adaptive.py's capacity site (K = 8) show: with
``beta`` 1.5 requests the limit held at K + 2 and the site's in flight at K + 1.3 on average,
with ``beta`` 1.0 at K + 2 too; with 0.3 / 0.6 requests at K + 1, the site's in flight at K + 0.7
(K + 0.2 with 3 processes on 2 busy cores, 77 of the site's 80 pages/s); with a tenth / a fifth,
K + 2 to K + 3 and K + 1.1 to K + 1.8. When K drops from 8 to 4, 9 in flight is past 2K: 503s,
``* 0.75`` to 6.75 (6 applied, queue 2, above a fifth of 6), then shrinks: back at K + 1 in 2
windows; when K rises again, the latency falls to ``base`` and the limit grows by one a window
(after the slow start, growth is additive).

**With noisy latencies** (simulated log-normal; 5 seeds, 300 windows each, the medians of each
run's limit after 60 windows; measured with the queue held at 0.3 to 0.6 requests, before it was a
share of the limit, which holds K = 8 at 9.1 to 10.6 on average over 8 seeds where that rule held
7.3 to 8.7, tests/lock/test_adaptive.py): with 100 ms pages and a coefficient of variation of 0.5,
medians of 4-5 for K = 4, 8-9 for K = 8, 15-17 for K = 16, but 16-38 for K = 60; with a coefficient
of 1, 8-9 for K = 8 and 11-26 for K = 60; with 1 s pages (ten times fewer latencies a window) and a
coefficient of 1, 1-6 whatever K. The noisier the site and the fewer its answers per window, the
lower the limit stays: a longer ``window`` (REDISLOCK_ADAPTIVE_WINDOW) is the remedy. Much of it
comes from the start: the no-load latency is the lowest of its first windows, so it reads low (by
up to 40% where starts ended at K = 60), and a queue that is not there ends the start as
significant, at a fraction of K; the smaller steps of a start that grows from the share surely
served give that more windows: K = 60 reached within 60 windows in 43% of 400 runs instead of 48%
(1 s windows, a coefficient of 0.5; in 16 windows instead of 14, the median of those that did), in
26% of 200 instead of 38% with half-second windows; K = 8 as often as before.

**Why many processes do not make it unstable.** Their samples are merged into ONE window per
period (the counters add up in Redis), so the controller sees the window it would see from one
process doing all the work; there is one update per window whoever reports, and the version check
makes concurrent commits idempotent (the second of two commits of one version is refused and
changes nothing). What more processes could add is lag: a process reporting once a second, just
after another committed a new limit, sends what it measured mostly under the previous one. So a
report says how long its sample covers (``span``) and the script keeps only the share of it that
falls within the current window. In the simulation of the tests (2 to 32 processes reporting once
a second at spread instants, a site of K = 8, then 4), the limit reaches 9 after 11 s, holds 8 to
10 (one process: 9; several went to 10 for a window or two after the start, whose first reports
were measured partly under the limit before) and falls to 5 within 2 s of the drop, as with one
process; with the queue held at 0.3 to 0.6 requests they never went above 9, and without the
clipping 16 processes went to 10.

**What it costs** (Redis 7.0, counted with INFO commandstats, checked by the tests): a report runs
5 commands (TIME, HMGET, XINFO GROUPS for the lock's slots in use, HSET, PEXPIRE), 6 when the
window is due (HGET of the lock's limit) and two more HGETs for a new controller (the lock's limit
and pin). A commit refused as stale runs 1 (HGET); one that leaves the lock's limit as it is 9
(HGET, TIME, HMGET of the pin in the lock's record, HSET, PEXPIRE, HGET of the lock's limit,
LPUSH, LTRIM, PEXPIRE of the log; 6 without a log). Moving the limit adds the restart check
(EXISTS, HEXISTS, INFO, HGET) and ``change_limit``'s commands: 6, one XPENDING per slot held, and
one XADD per slot added, or XRANGE, XGROUP SETID and one XDEL per free slot skipped (+1 with one
slot held: 21 in all). About once a second per lock, whoever reports. The pin lives in the lock's
record (a stage's meta, a key's light zset: ``scripts/set_limit.lua``), so it outlives the
controller's hash.

No Scrapy, no Twisted, no I/O: operations for :func:`~scrapy_redislock.lock.protocol.adrive`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

from scrapy_redislock._redis import MAX_LIMIT, text
from scrapy_redislock.errors import InvalidArgument
from scrapy_redislock.lock.permit import LockKeys
from scrapy_redislock.lock.protocol import Operation, RunScript

# Probe phases of ControllerState.probe.
NOT_PROBING, DRAINING, MEASURING = 0, 1, 2
# Not a probe: the slow start of a new controller (the limit grows by up to half a window until the
# site shows a significant queue).
STARTING = 3
# The probe that ends a slow start, in place: it drains and measures as a probe does, but at the
# limit the start ended at (what the site served at once: no queue there), not at half of it.
DRAINING_IN_PLACE, MEASURING_IN_PLACE = 4, 5
# A slow start whose last window would have ended it: it holds its limit for one more window, and
# ends only if that one would too (a noisy window, or the crawling processes' own delays for a
# moment, no longer end a start below the site's capacity).
START_HOLDING = 6
# each probe phase's next one (a window each)
_NEXT_PHASE = {
    DRAINING: MEASURING,
    MEASURING: NOT_PROBING,
    DRAINING_IN_PLACE: MEASURING_IN_PLACE,
    MEASURING_IN_PLACE: NOT_PROBING,
}


def _number(
    name: str,
    value: object,
    *,
    low: float,
    high: float = math.inf,
    open_low: bool = False,
    open_high: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgument(f"adaptive {name} must be a finite number, got {value!r}")
    too_low = value <= low if open_low else value < low
    too_high = value >= high if open_high else value > high
    if too_low or too_high:
        left, right = "(" if open_low else "[", ")" if open_high else "]"
        raise InvalidArgument(
            f"adaptive {name} must be in {left}{low}, {high}{right}, got {value!r}"
        )


def _integer(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidArgument(f"adaptive {name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class AdaptiveParams:
    """What one adaptive limit may do and how fast; checked at construction (InvalidArgument names
    the field and the value)."""

    minimum: int = 1  # never below: a limit of 0 could never measure its way back up
    maximum: int = 64
    window: float = 1.0  # seconds (on Redis's clock) of one window, at least
    min_samples: int = 10  # outcomes a window needs before it is due (a slow site's are longer)
    alpha: float = 0.3  # requests waiting: a slow start ends above it; settled, the least to grow
    beta: float = 0.6  # a start's step is not by one above it; settled, the least to shrink
    alpha_share: float = 0.1  # settled: grow below this share of those out waiting (or alpha)
    beta_share: float = 0.2  # settled: shrink while more than this share wait (or beta)
    confidence: float = 2.0  # shrink only on a queue this many standard errors above beta
    shrink_gain: float = 0.5  # shrink by max(1, shrink_gain * the queue's excess)
    backoff: float = 0.75  # limit * backoff on overload; also the most one Vegas step may cut
    overload_threshold: float = 0.01  # (overloads + errors) / outcomes above this: overload
    app_limited: float = 0.5  # mean in-flight below this share of the limit: do not grow
    start_growth: float = 1.5  # a slow start's step: the limit times this while the site has room
    probe_every: int = 30  # windows between two no-load measurements
    probe_fraction: float = 0.5  # share of the limit applied while probing
    idle_windows: int = 5  # the controller's hash expires this many windows after the last report
    log_length: int = 600  # history records kept (adapt_log); 0: none

    def __post_init__(self) -> None:
        _integer("minimum", self.minimum, 1)
        _integer("maximum", self.maximum, 1)
        if self.maximum > MAX_LIMIT:
            raise InvalidArgument(
                f"adaptive maximum must be at most MAX_LIMIT ({MAX_LIMIT}), got {self.maximum!r}"
            )
        if self.maximum < self.minimum:
            raise InvalidArgument(
                f"adaptive maximum must be >= minimum ({self.minimum}), got {self.maximum!r}"
            )
        _number("window", self.window, low=0.001)
        _integer("min_samples", self.min_samples, 1)
        _number("alpha", self.alpha, low=0.0)
        _number("beta", self.beta, low=self.alpha, open_low=True)
        _number("alpha_share", self.alpha_share, low=0.0, high=1.0, open_high=True)
        _number("beta_share", self.beta_share, low=self.alpha_share, high=1.0, open_low=True)
        _number("confidence", self.confidence, low=0.0)
        _number("shrink_gain", self.shrink_gain, low=0.0, open_low=True)
        _number("backoff", self.backoff, low=0.0, high=1.0, open_low=True, open_high=True)
        _number("overload_threshold", self.overload_threshold, low=0.0, high=1.0, open_high=True)
        _number("app_limited", self.app_limited, low=0.0, high=1.0)
        _number("start_growth", self.start_growth, low=1.0, high=4.0, open_low=True)
        _integer("probe_every", self.probe_every, 3)
        _number("probe_fraction", self.probe_fraction, low=0.0, high=1.0, open_low=True)
        _integer("idle_windows", self.idle_windows, 2)
        _integer("log_length", self.log_length, 0)

    @property
    def window_ms(self) -> int:
        return max(1, round(self.window * 1000))

    def clamp(self, limit: float) -> float:
        return min(float(self.maximum), max(float(self.minimum), limit))


@dataclass(frozen=True)
class Sample:
    """What a process saw of a lock's requests since its last report.

    ``responses``: answers that were not overload answers, their download latencies summed in
    ``latency_sum`` (seconds, as AutoThrottle measures) and their squares in ``latency_sq_sum``
    (so a window knows how noisy its mean is); ``overloads``: 429 and 503 answers; ``errors``:
    timeouts and connection errors; ``in_use_sum`` / ``in_use_count``: observations of how many
    of the lock's slots were in use across the cluster. A process only knows its own, so it may
    leave them at 0: every report adds one observation of the lock's held slots, taken by the
    script in Redis. ``hold_sum``: how long the responses' slots were held, summed (from the
    moment a slot became the request's, granted by Redis or passed on by the request before it,
    to the moment it went back, as the process saw it; its latency where it did not say): with
    ``latency_sum``, the share of a slot's time the site had the request
    (:attr:`Window.site_share`).
    """

    responses: int = 0
    latency_sum: float = 0.0
    latency_sq_sum: float = 0.0
    overloads: int = 0
    errors: int = 0
    in_use_sum: int = 0
    in_use_count: int = 0
    hold_sum: float = 0.0

    def __add__(self, other: Sample) -> Sample:
        return Sample(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Sample)))

    @property
    def outcomes(self) -> int:
        """Requests that ended: answered, overloaded or failed."""
        return self.responses + self.overloads + self.errors

    @property
    def empty(self) -> bool:
        """Nothing to report."""
        return not self.outcomes and not self.in_use_count


@dataclass(frozen=True)
class Window:
    """The samples of every process merged over one period, from ``start_ms`` to ``end_ms`` on
    Redis's clock (ms since the epoch).

    Counts are floats: a sample that began before the window did is clipped to it, assuming its
    outcomes were spread evenly over the time it covers (so a window after a limit change holds
    what was measured under that limit only, whichever process reports when).
    """

    responses: float = 0.0
    latency_sum: float = 0.0
    latency_sq_sum: float = 0.0
    overloads: float = 0.0
    errors: float = 0.0
    in_use_sum: float = 0.0
    in_use_count: float = 0.0
    start_ms: int = 0
    end_ms: int = 0
    hold_sum: float = 0.0

    def merged(self, sample: Sample, share: float = 1.0) -> Window:
        """This window with ``share`` of ``sample`` added (what adapt_report.lua does)."""
        return replace(
            self,
            **{
                f.name: getattr(self, f.name) + share * getattr(sample, f.name)
                for f in fields(Sample)
            },
        )

    @property
    def outcomes(self) -> float:
        return self.responses + self.overloads + self.errors

    @property
    def mean_latency(self) -> float | None:
        """None without responses, or when they took no time (cached ones): nothing to learn."""
        if self.responses <= 0 or self.latency_sum <= 0:
            return None
        return self.latency_sum / self.responses

    @property
    def latency_error(self) -> float:
        """The standard error of :attr:`mean_latency` (0 with fewer than two responses)."""
        if self.responses < 2:
            return 0.0
        mean = self.latency_sum / self.responses
        variance = max(0.0, self.latency_sq_sum / self.responses - mean * mean)
        return math.sqrt(variance / (self.responses - 1))

    @property
    def mean_in_flight(self) -> float | None:
        return self.in_use_sum / self.in_use_count if self.in_use_count > 0 else None

    @property
    def site_share(self) -> float:
        """The share of its slots' time the site had the window's requests: their latencies over
        their slots' hold times (Little's law: of the slots in use, this share had a request at
        the site); 1 when no hold was reported. Below 1 when the crawling processes themselves are
        slow: a slot is taken before its request goes out and given back after its answer is
        read, and on a busy CPU both take longer."""
        if self.hold_sum <= 0 or self.latency_sum <= 0:
            return 1.0
        return min(1.0, self.latency_sum / self.hold_sum)

    @property
    def overload_rate(self) -> float:
        return self.overloads / self.outcomes if self.outcomes > 0 else 0.0

    @property
    def error_rate(self) -> float:
        return self.errors / self.outcomes if self.outcomes > 0 else 0.0


@dataclass
class Recorder:
    """A process's running :class:`Sample` of one lock: record each outcome, :meth:`take` it at
    each report with the seconds it covers (on ``clock``)."""

    clock: Callable[[], float] = time.monotonic
    sample: Sample = field(default_factory=Sample)
    since: float = field(init=False)

    def __post_init__(self) -> None:
        self.since = self.clock()

    def response(self, latency: float, overload: bool = False, hold: float | None = None) -> None:
        """An answer after ``latency`` seconds, its slots held ``hold`` seconds (None: not known,
        taken as the latency; never less than it)."""
        s = self.sample
        if overload:
            self.sample = replace(s, overloads=s.overloads + 1)
        else:
            held = latency if hold is None else max(hold, latency)
            self.sample = replace(
                s,
                responses=s.responses + 1,
                latency_sum=s.latency_sum + latency,
                latency_sq_sum=s.latency_sq_sum + latency * latency,
                hold_sum=s.hold_sum + held,
            )

    def error(self) -> None:
        self.sample = replace(self.sample, errors=self.sample.errors + 1)

    def in_use(self, slots: int) -> None:
        """An observation of the lock's slots in use across the cluster (only if it is known)."""
        s = self.sample
        self.sample = replace(s, in_use_sum=s.in_use_sum + slots, in_use_count=s.in_use_count + 1)

    def take(self) -> tuple[Sample, float]:
        """What was recorded since the last take and the seconds that covers (the ``span`` to
        report it with); the recorder starts afresh."""
        now = self.clock()
        sample, span = self.sample, now - self.since
        self.sample, self.since = Sample(), now
        return sample, span


@dataclass(frozen=True)
class ControllerState:
    """The controller of one lock.

    ``limit``: the float the algorithm moves; ``applied``: the integer limit the lock gets (floor of
    ``limit``, or the probe's); ``noload``: the no-load latency estimate in seconds (0: not measured
    yet) and ``noload_error`` its standard error; ``since_probe``: windows since it was last
    measured at low load; ``probe``: 0 not probing, 1 draining, 2 measuring, 3 a slow start, 4 and
    5 the probe in place that ends it, 6 a slow start holding its limit; ``version``: commits so
    far.
    """

    limit: float
    applied: int
    noload: float = 0.0
    noload_error: float = 0.0
    since_probe: int = 0
    probe: int = NOT_PROBING
    version: int = 0

    @classmethod
    def initial(cls, limit: int) -> ControllerState:
        """A controller that has measured nothing yet, at ``limit``."""
        return cls(float(limit), limit)


def next_state(state: ControllerState, window: Window, params: AdaptiveParams) -> ControllerState:
    """The controller after one window (pure: the same inputs give the same state in every
    process). The version is the next one."""
    rtt, error = window.mean_latency, window.latency_error
    limit, probe = state.limit, state.probe
    noload, noload_error, since_probe = state.noload, state.noload_error, state.since_probe + 1
    drops = window.overloads + window.errors
    overloaded = window.outcomes > 0 and drops > params.overload_threshold * window.outcomes
    if rtt is not None:
        measuring = probe in (MEASURING, MEASURING_IN_PLACE)
        low_load = measuring or (probe == NOT_PROBING and _at_probe_level(state, params))
        if low_load and not overloaded:
            # measured at low load: replaces the estimate, up or down
            noload, noload_error, since_probe = rtt, error, 0
        elif (
            noload <= 0
            or rtt + params.confidence * math.hypot(error, noload_error) < noload
            or (rtt < noload and error < noload_error)
        ):
            # significantly lower (the site got faster), or lower and measured more precisely (a
            # first window of a few requests, some of them opening connections, is no estimate)
            noload, noload_error = rtt, error
    # a new controller at the minimum starts slow-start (one re-made higher, from a lock's limit,
    # probes first instead)
    starting = probe in (STARTING, START_HOLDING) or (
        state.version == 0 and state.limit <= params.minimum
    )
    if overloaded:
        limit *= params.backoff
        probe = NOT_PROBING  # a probe under overload measured nothing: it starts over, lower
    elif probe in _NEXT_PHASE:
        probe = _NEXT_PHASE[probe]
    elif rtt is not None and (state.noload > 0 or since_probe == 0):
        in_flight = window.mean_in_flight
        used = float(state.applied) if in_flight is None else in_flight
        estimate = Estimate(noload, noload_error, rtt, error)
        share = window.site_share
        grown = _slow_start(state, used, estimate, share, params) if starting else None
        if grown is not None:
            limit, probe = grown, STARTING  # slow start: no queue yet, grow
        elif starting and probe != START_HOLDING:
            probe = START_HOLDING  # the first window that would end it: hold for one more
        elif starting:
            # a second window in a row with a queue ends the slow start: what the site served at
            # once (its capacity, as the queue shows it), from where Vegas goes on; a probe in
            # place follows at once, to measure the no-load latency at that limit, the load it
            # will see (the slow start's windows ran at lower loads, and the crawling processes'
            # own delays grow with theirs); at half of it, as a periodic probe, it cost two
            # windows at half the site's capacity. Never below limit / start_growth, at most the
            # last step's limit, which showed no significant queue: on a busy CPU those delays
            # grow with the crawl's rate, the latency with them, and the estimate alone fell to
            # half of K
            served = used * noload / rtt
            limit, probe = max(served, limit / params.start_growth), DRAINING_IN_PLACE
            since_probe = params.probe_every
        else:
            limit = _vegas(state, used, estimate, params)
    limit = params.clamp(limit)
    unmeasured = state.noload <= 0 and since_probe > 0  # what it learnt came from a loaded window
    if probe == NOT_PROBING and (unmeasured or since_probe >= params.probe_every):
        probe = DRAINING
    halved = probe in (DRAINING, MEASURING)
    applied = _probe_limit(limit, params) if halved else _floor(limit, params)
    return ControllerState(
        limit, applied, noload, noload_error, since_probe, probe, state.version + 1
    )


@dataclass(frozen=True)
class Estimate:
    """The latencies one Vegas step compares, each with its standard error (seconds)."""

    noload: float
    noload_error: float
    rtt: float
    rtt_error: float

    def queue(self, in_flight: float) -> tuple[float, float, float]:
        """Requests waiting at the site, ``in_flight * (1 - noload / rtt)``; its standard error
        (both latencies' errors propagated); and its error from this window's latencies alone."""
        queue = in_flight * (1 - self.noload / self.rtt)
        window = in_flight * self.noload * self.rtt_error / self.rtt**2
        error = math.hypot(window, in_flight * self.noload_error / self.rtt)
        return queue, error, window


def _room(
    state: ControllerState,
    used: float,
    estimate: Estimate,
    threshold: float,
    params: AdaptiveParams,
) -> bool:
    """No queue at the site (below ``threshold``), and the limit was used: it may grow by one."""
    queue, _error, _window = estimate.queue(used)
    return queue < threshold and used >= params.app_limited * state.applied


def _slow_start(
    state: ControllerState, used: float, estimate: Estimate, share: float, params: AdaptiveParams
) -> float | None:
    """The next limit of a slow start, or None where it ends (after a window holding the limit,
    :func:`next_state`): the queue is *significantly* above ``alpha`` (a noisy window at a low
    limit, where the crawling processes' own delays weigh most, must not end it), or the limit
    was not used so much that ``start_growth`` times it would be.

    It grows to ``start_growth`` (1.5) times the share of the limit the site *surely* served at
    once: one less the queue estimate at its upper bound (``confidence`` standard errors of both
    latencies) over the limit used; by one at least (Vegas's step) unless the window's own
    latencies show a queue above ``beta`` by ``confidence`` standard errors, but never past
    ``start_growth`` times the share it served by the estimate itself of the limit applied (or
    that limit plus one where Vegas would grow: from 1, times 1.5 floors back to 1); it never
    shrinks here.
    Exact latencies and no queue: both shares are 1, the limit times 1.5. Why a bound: a site that
    serves K at once answers in the same time up to K, so a step can pass ``start_growth * K``
    only from a limit above K, whose queue (one request at K + 1) the noise may hide; from the
    share it surely served, such a step stays within ``start_growth * K`` unless the window's
    mean latency read ``confidence`` standard errors low. Growing from the estimate (from the
    limit while the queue estimate was below ``alpha``) passed it: at 7 a noisy window read a
    queue, the step from what was served went to 9 = K + 1, whose queue of one read below
    ``alpha``, and 9 * 1.5 went to 14 against a site refusing past 12."""
    queue, error, window = estimate.queue(used)
    if queue - params.confidence * error >= params.alpha:
        return None
    if used < params.app_limited * params.start_growth * state.applied:
        return None
    growth, limit = params.start_growth, state.limit
    served = min(1.0, estimate.noload / estimate.rtt)
    # 1 - queue / used at the queue's upper bound, with both latencies' errors (a no-load latency
    # of a few early answers is as uncertain as the window's)
    surely = min(served, max(0.0, 1.0 - (queue + params.confidence * error) / used))
    # at most start_growth times what the site served of the limit it was sent (of the float
    # limit, up to one higher, a start at K = 6 went to 10, past 1.5 K), but one more where Vegas
    # would grow (from 1, times 1.5 floors back to 1: a whole window lost); by one at least unless
    # this window alone shows a queue Vegas would shrink (a no-load latency read low from a few
    # early answers hides every queue in its error, and a start crept by one past 1.5 K); and of
    # the slots, only the ``share`` of their time the site had the requests (Window.site_share):
    # a busy crawling process holds slots whose requests are not at the site, whose queue then
    # hides (a start went 9 -> 13 against K = 8 at 9 slots, the site at 8.3 and its latency 3%
    # up), and which it sends at once when it catches up
    applied, step = state.applied, limit + 1
    most = growth * served * applied * share
    if _room(state, used, estimate, params.alpha, params):
        most = max(most, applied + 1.0)
    elif queue - params.confidence * window > params.beta:
        step = limit
    return max(limit, min(most, max(growth * surely * limit * share, step)))


def _vegas(
    state: ControllerState, used: float, estimate: Estimate, params: AdaptiveParams
) -> float:
    """Grow by one on a queue below ``alpha`` (unless app limited); shrink on one significantly
    above ``beta`` (by this window's own error: the no-load estimate's is the same in every window
    until the next probe, so waiting cannot make a queue significant against it, and in real
    crawls counting it held the limit at K + 2 to K + 3, its queue of 1.1 to 1.5 never
    significant); else hold."""
    queue, _error, window = estimate.queue(used)
    excess = queue - params.confidence * window - max(params.beta, params.beta_share * used)
    limit = state.limit
    if excess > 0:
        return max(limit - max(1.0, params.shrink_gain * excess), limit * params.backoff)
    if _room(state, used, estimate, max(params.alpha, params.alpha_share * used), params):
        return limit + 1
    return limit


def _at_probe_level(state: ControllerState, params: AdaptiveParams) -> bool:
    """A probe is due and the window ran no higher than a probe would: it is the measurement (a
    controller at its minimum never lowers its limit to measure)."""
    due = state.noload <= 0 or state.since_probe + 1 >= params.probe_every
    return due and state.applied <= _probe_limit(state.limit, params)


def _floor(limit: float, params: AdaptiveParams) -> int:
    return max(params.minimum, math.floor(limit + 1e-9))


def _probe_limit(limit: float, params: AdaptiveParams) -> int:
    return max(params.minimum, math.floor(limit * params.probe_fraction + 1e-9))


# -- in Redis ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Due:
    """A window that is due, the state it applies to (its version is the one to commit against),
    and the lock's limit in Redis (None when the lock is not there)."""

    window: Window
    state: ControllerState
    lock_limit: int | None


def report(
    keys: LockKeys, sample: Sample, params: AdaptiveParams, span: float = 0.0, light: bool = False
) -> Operation[Due | None]:
    """Merge ``sample``, measured over the last ``span`` seconds (0: unknown, merged whole), into
    the lock's current window; the window, state and version when the window is due (then compute
    :func:`next_state` and :func:`commit` it), else None. ``light``: a key's lock, which may be on
    its light path (lock/light.py)."""
    reply = yield RunScript(
        "adapt_report",
        (keys.adapt, keys.slots, keys.meta, *((keys.light,) if light else ())),
        (
            sample.responses,
            repr(float(sample.latency_sum)),
            repr(float(sample.latency_sq_sum)),
            sample.overloads,
            sample.errors,
            sample.in_use_sum,
            sample.in_use_count,
            max(0, round(span * 1000)),
            params.window_ms,
            params.min_samples,
            params.minimum,
            params.maximum,
            params.window_ms * params.idle_windows,
            repr(float(params.overload_threshold)),
            repr(float(sample.hold_sum)),
        ),
    )
    if not isinstance(reply, list):
        return None
    values = text(reply)
    version, start, end, responses, latency, latency_sq, overloads, errors = values[:8]
    in_use, count, hold, limit, applied, noload, noload_error, since_probe, probe, lock = values[8:]
    window = Window(
        float(responses),
        float(latency),
        float(latency_sq),
        float(overloads),
        float(errors),
        float(in_use),
        float(count),
        start_ms=int(start),
        end_ms=int(end),
        hold_sum=float(hold),
    )
    state = ControllerState(
        float(limit),
        int(applied),
        float(noload),
        float(noload_error),
        int(since_probe),
        int(probe),
        int(version),
    )
    return Due(window, state, int(lock) if lock else None)


def commit(
    keys: LockKeys,
    version: int,
    new_state: ControllerState,
    window: Window,
    params: AdaptiveParams,
    durable: bool = False,
    light: bool = False,
) -> Operation[bool]:
    """Store ``new_state`` if the controller is still at ``version``, apply its limit to the lock
    (unless an operator pinned it) and log ``window``; False when another process committed this
    version first (nothing changed). ``durable`` as the lock's (a restarted Redis is noticed
    before the limit moves)."""
    latency, in_flight = window.mean_latency, window.mean_in_flight
    applied = yield RunScript(
        "adapt_commit",
        (keys.adapt, keys.adapt_log, keys.slots, keys.meta, *((keys.light,) if light else ())),
        (
            version,
            repr(new_state.limit),
            new_state.applied,
            repr(new_state.noload),
            repr(new_state.noload_error),
            new_state.since_probe,
            new_state.probe,
            "" if latency is None else _rounded(latency * 1000),
            _rounded(new_state.noload * 1000),
            _rounded(window.overload_rate),
            _rounded(window.error_rate),
            "" if in_flight is None else _rounded(in_flight),
            params.log_length,
            params.window_ms * max(params.log_length, params.idle_windows),
            params.window_ms * params.idle_windows,
            "1" if durable else "0",
        ),
    )
    return bool(applied)


def update(
    keys: LockKeys,
    sample: Sample,
    params: AdaptiveParams,
    span: float = 0.0,
    durable: bool = False,
    light: bool = False,
) -> Operation[ControllerState | None]:
    """Report ``sample`` (measured over ``span`` seconds); when the window is due, compute and
    commit the next state. Returns the state this call committed (a pinned controller stored the
    pin instead), None when the window was not due or another process was first."""
    due = yield from report(keys, sample, params, span, light)
    if due is None:
        return None
    new = next_state(due.state, due.window, params)
    done = yield from commit(keys, due.state.version, new, due.window, params, durable, light)
    return new if done else None


def unpin(keys: LockKeys) -> Operation[bool]:
    """Let the lock's controller move its limit again after ``set-limit`` pinned it; whether there
    was a pin."""
    return bool((yield RunScript("adapt_unpin", (keys.meta, keys.light), ())))


def _rounded(value: float) -> str:
    return f"{value:.6g}"
