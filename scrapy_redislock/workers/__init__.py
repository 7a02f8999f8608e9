"""The worker front: workers per stage (:class:`~scrapy_redislock.workers.mixin.StageWorkerMixin`
over scrapy-redis and its scheduler), the per-stage queues in Redis and their Lua scripts."""
