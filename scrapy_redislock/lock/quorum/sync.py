"""The quorum lock for blocking code: masters asked one after the other."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import redis

from scrapy_redislock.errors import LockLost
from scrapy_redislock.lock.base import ThreadContext
from scrapy_redislock.lock.permit import Permit
from scrapy_redislock.lock.protocol import Operation, drive
from scrapy_redislock.lock.quorum.base import QuorumBase
from scrapy_redislock.lock.quorum.core import (
    MASTER_ERRORS,
)
from scrapy_redislock.lock.quorum.protocol import (
    LeadWait,
    Pause,
    Pending,
    QuorumOperation,
    QuorumPermit,
)
from scrapy_redislock.lock.sync import CountingLock

logger = logging.getLogger("scrapy_redislock.lock.quorum")
T = TypeVar("T")


class QuorumCountingLock(ThreadContext[QuorumPermit], QuorumBase[CountingLock]):
    """A counting lock held on a safe quorum of N independent ``redis.Redis`` masters, for blocking
        code.

    Masters are asked one after the other; give the clients a socket timeout well below ``ttl`` and no
        retries (:class:`~scrapy_redislock.lock.quorum.QuorumLockFactory` does), or a hung or dead
        master eats the validity time.
    """

    client_types = (redis.Redis,)
    master_class = CountingLock

    def __init__(self, masters: Sequence[redis.Redis], *args: Any, **kwargs: Any) -> None:
        super().__init__(masters, *args, **kwargs)
        self._local = threading.local()
        self._renewer: threading.Thread | None = None
        self._loop_lock = threading.Lock()
        self._stop = threading.Event()
        self._answer_locks = [threading.Lock() for _ in self._masters]

    def _one(self, index: int, op: Operation[object]) -> object:
        try:
            return drive(op, self._runners[index], self.name)
        except MASTER_ERRORS as exc:
            return exc

    def _run(self, op: QuorumOperation[T]) -> T:
        reply: Any = None
        try:
            while True:
                try:
                    command = op.send(reply)
                except StopIteration as stop:
                    result: T = stop.value
                    return result
                if isinstance(command, Pause):
                    time.sleep(command.seconds)
                    reply = None
                elif isinstance(command, LeadWait):
                    try:
                        reply = {command.index: self._lead_wait(command)}
                    except MASTER_ERRORS as exc:
                        reply = {command.index: exc}
                else:
                    reply = {i: self._one(i, sub) for i, sub in command.ops.items()}
        finally:
            op.close()

    def _lead_wait(self, command: LeadWait) -> Permit | BaseException:
        """The lead master's blocking acquire, in this thread; with ``command.watch`` a watcher
        thread breaks the wait off when the master stops answering (see :meth:`_watch`): LeadSilent
        then."""
        master = self._locks[command.index]
        if command.watch is None:
            return master.acquire(command.timeout)
        done, cut = threading.Event(), threading.Event()
        watcher = threading.Thread(
            target=self._watch,
            args=(command.index, command.watch, done, cut),
            name=f"redislock-quorum-watch-{self.name}",
            daemon=True,
        )
        watcher.start()
        try:
            return master.acquire(command.timeout)
        except MASTER_ERRORS as exc:
            if cut.is_set():
                return self._silent(command.index, exc)
            raise
        finally:
            done.set()

    def _watch(self, index: int, every: float, done: threading.Event, cut: threading.Event) -> None:
        """While a lead wait on master ``index`` is out: every ``every`` s, if that master does not
        answer, close the connections that wait on it (a blocked read cannot be cancelled from
        another thread): the wait ends with a connection error, its consumer is abandoned (freed by
        the next maintain there), and the quorum moves on. Repeated while it stays silent, in case
        the wait was between two reads. Every wait of this object's factory queued there ends alike:
        the master is silent for all of them."""
        while not done.wait(every):
            if self._answers(index) or done.is_set():
                continue
            cut.set()
            waiting = self._locks[index]._waiting_client  # (its command runner's)
            if waiting is not None:
                waiting.connection_pool.disconnect()

    def _answers(self, index: int) -> bool:
        """Whether master ``index`` answers a PING (within the client's socket timeout, which a
        quorum's clients must have: 1 s from QuorumLockFactory); one PING per master and renewal
        interval, however many waits ask."""
        with self._answer_locks[index]:
            recent = self._recent_answer(index)
            if recent is not None:
                return recent
            try:
                self._masters[index].ping()
                answered = True
            except MASTER_ERRORS:
                answered = False
            self._answered[index] = (self._core.clock(), answered)
            return answered

    def _acquire(self, timeout: float | None, blocking: bool) -> QuorumPermit | None:
        pending: Pending = []
        try:
            return self._run(self._core.acquire(timeout, blocking, threading.get_ident(), pending))
        except BaseException:
            # interrupted (KeyboardInterrupt) holding grants no permit owns: give them back
            if pending:
                with contextlib.suppress(Exception):
                    self._run(self._core.sweep(pending))
            raise

    def acquire(self, timeout: float | None = None) -> QuorumPermit:
        """A permit on >= quorum masters; AcquireTimeout after ``timeout`` s, saying how the last
        round went."""
        permit = self._acquire(timeout, True)
        assert permit is not None
        self._start_loop()
        return permit

    def try_acquire(self) -> QuorumPermit | None:
        """One round: a permit if >= quorum masters grant one now, else None (partial grants given
        back)."""
        permit = self._acquire(None, False)
        if permit is not None:
            self._start_loop()
        return permit

    def release(self, permit: QuorumPermit) -> bool:
        """Give the slot back on every master: True if >= quorum still held it."""
        return bool(self._run(self._core.release(permit)))

    def renew(self, permit: QuorumPermit) -> None:
        """Renew on every master; LockLost when fewer than ``quorum`` renewed (what is left is given
        back)."""
        if self.maintain([permit]):
            raise LockLost(
                f"quorum lock {self.name!r}: fewer than {self.quorum} masters renewed {permit.token}"
            )

    def maintain(self, permits: list[QuorumPermit] | None = None) -> list[QuorumPermit]:
        """Renew held permits (default: all) on every master; returns the lost ones (on_lost is
        called for each)."""
        lost: list[QuorumPermit] = self._run(self._core.maintain(permits))
        self._report_lost(lost)
        return lost

    def set_limit(self, limit: int) -> int | None:
        """Write this object's limit to every master (see
        :meth:`~scrapy_redislock.lock.quorum.AsyncQuorumCountingLock.set_limit`); returns the previous limit."""
        self._check_limit(limit)
        return self._run(self._core.set_limit(limit))

    def get_limit(self) -> int | None:
        """The limit most answering masters hold; QuorumNotReached when fewer than q answer."""
        return self._run(self._core.get_limit())

    def close(self, retire: bool = False) -> int:
        """Stop renewing and free everything this object holds on every master; returns how many
        permits. ``retire=True``: each master deletes the lock when nobody else uses it there."""
        self._stop.set()
        renewer = self._renewer
        if renewer is not None and renewer is not threading.current_thread():
            renewer.join()
        count = self._core.forget_all()
        for master in self._locks:
            with contextlib.suppress(*MASTER_ERRORS):
                master.close(retire=retire)
        return count

    def _start_loop(self) -> None:
        with self._loop_lock:
            if (
                not self.auto_renew
                or self._stop.is_set()
                or (self._renewer and self._renewer.is_alive())
            ):
                return
            self._renewer = threading.Thread(
                target=self._loop, name=f"redislock-quorum-{self.name}", daemon=True
            )
            self._renewer.start()

    def _loop(self) -> None:
        """Renew every ttl/3 while something is held; errors are logged and retried."""
        while not self._stop.wait(self.renew_interval):
            with self._loop_lock:
                if not self._core.held:
                    self._renewer = None
                    return
            try:
                self.maintain()
            except Exception:
                logger.exception("renewing quorum lock %r failed", self.name)
