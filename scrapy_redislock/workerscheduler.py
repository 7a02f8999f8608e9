"""The path ``scrapy_redislock.workerscheduler.StageWorkerScheduler`` of earlier releases, kept
working for existing ``SCHEDULER`` settings. New settings name
``scrapy_redislock.StageWorkerScheduler`` (the mixin sets it for you)."""

from scrapy_redislock.workers.scheduler import StageWorkerScheduler

__all__ = ["StageWorkerScheduler"]
