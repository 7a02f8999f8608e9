""":class:`~testing.spiders.crawlspider.PlanSpider` under another spider name (``othershop``), for
the tests of cap groups (REDISLOCK_GROUP): two spiders with the same stage names. ``scrapy
runspider`` takes this file's own spider class."""

from __future__ import annotations

from testing.spiders.crawlspider import PlanSpider


class OtherShopSpider(PlanSpider):
    name = "othershop"
