""":class:`~testing.spiders.workerspider.StagedSpider` under another spider name (``otherstaged``),
for the tests of cap groups (REDISLOCK_GROUP) on the worker front: two spiders with the same stage
names. ``scrapy runspider`` takes this file's own spider class."""

from __future__ import annotations

from testing.spiders.workerspider import StagedSpider


class OtherStagedSpider(StagedSpider):
    name = "otherstaged"
