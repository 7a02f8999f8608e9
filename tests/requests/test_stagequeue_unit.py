"""stagequeue.push_back, pure: a request given back goes to the disk queue, or to memory when the
disk queue cannot serialize it (as Scrapy's scheduler does), into the sub-queue named or its own,
counted as queued again."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from scrapy import Request
from scrapy.statscollectors import StatsCollector
from scrapy.utils.test import get_crawler

from scrapy_redislock.requests.stagequeue import Route, push_back


class Queue:
    """A queue of Scrapy's scheduler split by stage: what was pushed, and where."""

    def __init__(self, *, refuses: bool = False) -> None:
        self.refuses = refuses  # a disk queue that cannot serialize what it is given
        self.pushed: list[tuple[Route | None, Request]] = []

    def push(self, request: Request) -> None:
        self.push_to(None, request)

    def push_to(self, route: Route | None, request: Request) -> None:
        if self.refuses:
            raise ValueError("cannot serialize")
        self.pushed.append((route, request))


@pytest.mark.parametrize("route", [None, ("detail", "a.com")])
def test_a_request_goes_back_to_disk_else_to_memory(route: Route | None) -> None:
    request = Request("https://a.com/1")
    disk, memory = Queue(), Queue()
    push_back(SimpleNamespace(dqs=disk, mqs=memory), request, route)
    assert disk.pushed == [(route, request)] and memory.pushed == []

    refusing = Queue(refuses=True)
    push_back(SimpleNamespace(dqs=refusing, mqs=memory), request, route)
    assert memory.pushed == [(route, request)]

    no_disk: Any = SimpleNamespace(mqs=Queue())  # no JOBDIR: Scrapy's scheduler has no dqs
    push_back(no_disk, request, route)
    assert no_disk.mqs.pushed == [(route, request)]


def test_a_request_put_back_is_counted_as_queued_again_where_it_went() -> None:
    """As Scrapy's scheduler counts a push: its next pop counts it as dequeued again."""
    stats = StatsCollector(get_crawler())
    request = Request("https://a.com/1")
    push_back(SimpleNamespace(dqs=Queue(), mqs=Queue(), stats=stats), request)
    push_back(SimpleNamespace(dqs=Queue(refuses=True), mqs=Queue(), stats=stats), request)
    push_back(SimpleNamespace(mqs=Queue(), stats=stats), request)
    assert stats.get_stats() == {
        "scheduler/enqueued": 3,
        "scheduler/enqueued/disk": 1,
        "scheduler/enqueued/memory": 2,
    }
