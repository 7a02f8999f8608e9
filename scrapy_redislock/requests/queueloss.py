"""QueueWatch: StageScheduler over scrapy-redis's queue notices when Redis lost the shared queue.

A Redis restarted without persistence (or flushed, or a replica without the queue promoted) comes
back empty: every request queued in the shared queue, and scrapy-redis's dupefilter, are gone.
scrapy-redis cannot tell: the crawl went on with what the processes had in flight and then ended as
``finished``, exit status 0, after a fraction of the pages. Each process reads the queue's epoch
(``<REDISLOCK_KEY_PREFIX>:shared:{<the spider's queue key>}:epoch``, made when missing by
``crawl/scripts/queue_epoch.lua``, the worker front's too) at start and at a renewal tick when no
look ran for WATCH_EVERY s, with the lengths of the queue's keys (in the shared queue's thread,
:class:`~scrapy_redislock.requests.stagequeue.QueueThread`: scrapy-redis's client blocks). Another
epoch than the one seen before means the data is gone:

- when this process knew of queued work (the queue held requests at its previous look, or it pushed
  or took one since): ERROR once, naming what was lost and what to do, stat ``redislock/queue_lost``,
  and the crawl ends with finish reason ``redislock_queue_lost`` (only in place of ``finished``)
  and exit status 1 (:func:`~scrapy_redislock.crawl.engine.finish_uncleanly`);
- else a WARNING (the dupefilter went with it: pages may be fetched again).

A request scrapy-redis fails to queue otherwise than by an outage (its serializer refuses a
callback that is not a spider method, or meta it cannot write; Redis refuses the user or its
command) is lost too: ERROR naming it,
stat ``redislock/queue_unqueueable``, and the same finish reason (:meth:`QueueWatch.unqueueable`).
So is a popped request scrapy-redis cannot read back (another version's callback, another
serializer): stat ``redislock/queue_unreadable`` (:meth:`QueueWatch.unreadable`).
Scrapy's own scheduler keeps such a request in memory; a shared queue cannot.

What this process still holds goes on: requests in flight finish and queue what their callbacks
yield (in the new queue); requests kept in memory while Redis did not answer are queued there.

The epoch is also read when the queue answers again after an outage and when it is found empty: a
Redis restarted quickly leaves an empty queue, which the engine would take for the end of the crawl
before the next tick. While the reactor runs, that is the same look (epoch and lengths) in the queue
thread, which ``has_pending_requests`` waits for before it says the queue is empty
(:meth:`SharedStageQueues.has_requests
<scrapy_redislock.requests.stagequeue.SharedStageQueues.has_requests>`); driven without a
reactor (synchronously), the epoch alone, at once.

Reads no settings (StageScheduler builds it over scrapy-redis's queue). Redis cost per process: a
look is one EVALSHA (a GET) plus one ZCARD or LLEN per key of the shared queue (the spider's and one
per capped stage), in the queue thread: at a renewal tick when none ran for WATCH_EVERY s; each time
the engine asks ``has_pending_requests`` with nothing on its way and the last look older than 0.5 s
(an idle engine asks at its 5 s heartbeat); while a key of the queue is found empty
(:class:`~scrapy_redislock.requests.stagequeue.SharedStageQueues`); and when the queue answers again
after an outage. Nothing on the reactor thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from scrapy_redislock._redis import ProjectScript, ScriptMode, text
from scrapy_redislock.crawl.engine import finish_uncleanly
from scrapy_redislock.crawl.epoch import EPOCH_SCRIPT, SharedQueueKeys, crawl_scripts
from scrapy_redislock.crawl.reach import REDIS_ERRORS, REFUSED

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler

    from scrapy_redislock.lock.core import Clock
    from scrapy_redislock.requests.stagequeue import SharedStageQueues, Unreadable

logger = logging.getLogger(__name__)

LOST_REASON = "redislock_queue_lost"
# a renewal tick looks when the last look (the tick's, or one the shared queue started) is this old
WATCH_EVERY = 5.0

__all__ = ["LOST_REASON", "WATCH_EVERY", "QueueWatch"]


class QueueWatch:
    """Reads the shared queue's epoch and lengths when the shared queue looks; says so when Redis
    lost it."""

    def __init__(
        self,
        crawler: Crawler,
        shared: SharedStageQueues,
        prefix: str,
        *,
        clock: Clock = time.monotonic,
    ) -> None:
        self.crawler = crawler
        self.clock = clock  # monotonic seconds: how long before a loss the last look was
        self.shared = shared
        self.key = SharedQueueKeys.of(prefix, shared.key).epoch
        source = crawl_scripts()[EPOCH_SCRIPT]
        self.script = ProjectScript(shared.server, source, ScriptMode())
        self.epoch: str | None = None  # the epoch seen (None: not read yet)
        self.queued = 0  # requests in the shared queue at the last look
        self.looked_at = 0.0
        self.moved = 0  # shared.moved at the last look
        self.losses = 0  # losses with work this process knew of
        self._looking = False

    def _look(self, lengths: bool = True) -> tuple[str, dict[str | None, int] | None]:
        """(epoch, the requests queued per sub-queue or None when not asked): scrapy-redis's client
        blocks, so a tick runs it in a thread."""
        epoch = text(self.script(keys=[self.key], args=[]))
        if not lengths:
            return str(epoch), None
        return str(epoch), self.shared.lengths()

    async def look(self) -> BaseException | None:
        """One look, in the shared queue's thread (after what was given to it before), else in a
        thread of asyncio's: at start, and when the shared queue looks (skipped while the last one
        runs). The Redis error that stopped it, for the shared queue to say (None: it ran, or was
        skipped)."""
        if self._looking:
            return None
        self._looking = True
        moved = self.shared.moved
        thread = self.shared.thread
        try:
            if thread is not None:
                epoch, queued = await thread.run(self._look)
            else:
                epoch, queued = await asyncio.to_thread(self._look)
        except REDIS_ERRORS as exc:
            return exc
        finally:
            self._looking = False
        self._judge(epoch, queued, moved)
        return None

    def look_now(self) -> None:
        """The epoch only, at once, where no reactor runs (the scheduler driven synchronously): when
        the shared queue answers again after an outage, and when it is found empty (the engine
        would close the spider before the next tick)."""
        moved = self.shared.moved
        try:
            epoch, queued = self._look(lengths=False)
        except REDIS_ERRORS:
            return
        self._judge(epoch, queued, moved)

    def _judge(self, epoch: str, lengths: dict[str | None, int] | None, moved: int) -> None:
        seen, self.epoch = self.epoch, epoch
        if seen is not None and seen != epoch:
            self._lost(knew=bool(self.queued) or self.moved != moved or bool(self.shared.in_memory))
        if lengths is not None:
            self.queued, self.looked_at = sum(lengths.values()), self.clock()
            self.shared.looked(lengths)
        self.moved = self.shared.moved

    def _lost(self, knew: bool) -> None:
        spider = self.crawler.spidercls.name
        if not knew:
            logger.warning(
                "Redis lost the shared queue of spider %r at %s (a restart without persistence, FLUSHALL, or a replica without it promoted); this process knew of no queued request, but scrapy-redis's dupefilter went with it: pages fetched before may be fetched again",  # noqa: E501
                spider,
                self.shared.key,
            )
            return
        self.losses += 1
        self.crawler.stats.inc_value("redislock/queue_lost")
        logger.error(
            "Redis lost the shared queue of spider %r at %s (restarted without persistence, flushed, or a replica without it promoted): the %d request(s) queued there at this process's last look (%.1f s before) and any other process had not started, and scrapy-redis's dupefilter, are gone and cannot be recovered. This process finishes what it has in flight and queues what that yields; the crawl will finish as redislock_queue_lost (exit status 1). Keep the queue with Redis persistence (appendonly yes), and run the crawl again to fetch what was lost",  # noqa: E501
            spider,
            self.shared.key,
            self.queued,
            self.clock() - self.looked_at,
        )
        finish_uncleanly(self.crawler, LOST_REASON, self._last_word)

    def unqueueable(self, request: Request, exc: BaseException) -> None:
        """scrapy-redis failed to queue ``request`` otherwise than by an outage (its serializer, or
        Redis, refused it): the request is lost. ERROR with why, stat
        ``redislock/queue_unqueueable``, and no clean finish."""
        self.crawler.stats.inc_value("redislock/queue_unqueueable")
        if isinstance(exc, REFUSED):
            logger.error(
                "Redis refused to queue %s: %r. The request is lost (redislock/queue_unqueueable), and the crawl will finish as redislock_queue_lost (exit status 1). The crawl's Redis user and password must still be accepted, and the user needs the crawler role, which allows scrapy-redis's queue commands (docs/security.md)",  # noqa: E501
                request,
                exc,
            )
        else:
            logger.error(
                "scrapy-redis could not queue %s: %r. The request is lost (redislock/queue_unqueueable), and the crawl will finish as redislock_queue_lost (exit status 1). Every process shares this queue in Redis, so a request must pass scrapy-redis's serializer (SCHEDULER_SERIALIZER): a callback and errback that are methods of the spider, and meta that the serializer can write",  # noqa: E501
                request,
                exc,
                exc_info=exc,
            )
        finish_uncleanly(self.crawler, LOST_REASON, lambda: None)

    def unreadable(self, exc: Unreadable) -> None:
        """A request popped from the shared queue that scrapy-redis could not read back: out of
        Redis, it is lost. ERROR with why and its first bytes, stat ``redislock/queue_unreadable``,
        and no clean finish."""
        self.crawler.stats.inc_value("redislock/queue_unreadable")
        logger.error(
            "A request popped from %s could not be read back (%r), and is lost (redislock/queue_unreadable); the crawl will finish as redislock_queue_lost (exit status 1). A request queued by another version of the spider (a callback it no longer has) or by another SCHEDULER_SERIALIZER; its data began %r",  # noqa: E501
            exc.key,
            exc.__cause__,
            exc.data[:200],
        )
        finish_uncleanly(self.crawler, LOST_REASON, lambda: None)

    def _last_word(self) -> None:
        logger.info(
            "Redis lost the shared queue %d time(s) during this crawl (redislock/queue_lost): it finishes as %s",
            self.losses,
            LOST_REASON,
        )


def unqueued_at_close(crawler: Crawler, count: int) -> None:
    """Requests kept in memory while Redis did not answer, never queued before the close, and a
    request whose pop got no reply that could not be asked again: lost. ERROR once, stat
    ``redislock/queue_unqueued``, and no clean finish."""
    if not count:
        return
    crawler.stats.inc_value("redislock/queue_unqueued", count)
    logger.error(
        "%d request(s) scheduled or popped while the shared queue in Redis did not answer could not be queued before the spider closed: they are lost (redislock/queue_unqueued), and the crawl finishes as redislock_queue_lost. Run the crawl again to fetch them",  # noqa: E501
        count,
    )
    finish_uncleanly(crawler, LOST_REASON, lambda: None)
