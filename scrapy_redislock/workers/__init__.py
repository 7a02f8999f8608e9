"""The worker front: workers per stage (:class:`StageWorkerMixin` over scrapy-redis and its
scheduler), the per-stage queues in Redis and their Lua scripts."""
