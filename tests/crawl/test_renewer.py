"""The process's renewal loop (pure: members are plain objects, no Redis)."""

from __future__ import annotations

import asyncio

from scrapy_redislock.crawl.renewer import Renewer
from testing.waiting import until


class Member:
    renew_interval = 0.01

    def __init__(self) -> None:
        self.ticks = 0
        self.closed_unclean = 0

    async def tick(self) -> None:
        self.ticks += 1

    async def close_unclean(self) -> None:
        self.closed_unclean += 1


def test_a_member_that_joins_as_the_last_one_leaves_is_ticked_and_not_closed() -> None:
    """The last member leaves (its task is cancelled) and another joins before the cancellation is
    delivered: the old task must neither free the new member's slots nor take its task away."""

    async def scenario() -> None:
        renewer = Renewer.current()
        first, second = Member(), Member()
        renewer.join(first)
        await until(lambda: first.ticks > 0)  # its loop runs
        renewer.leave(first)
        renewer.join(second)
        await until(lambda: second.ticks >= 2)
        assert second.closed_unclean == 0
        assert renewer.task is not None and not renewer.task.done()
        renewer.leave(second)

    asyncio.run(scenario())


def test_members_left_when_the_loop_is_torn_down_free_their_slots() -> None:
    member = Member()

    async def scenario() -> None:
        Renewer.current().join(member)
        await asyncio.sleep(0)  # the loop's task starts; asyncio.run cancels it at the end

    asyncio.run(scenario())
    assert member.closed_unclean == 1
