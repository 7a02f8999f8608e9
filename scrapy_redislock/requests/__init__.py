"""The request front: requests in flight per stage
(:class:`~scrapy_redislock.requests.middleware.StageLockMiddleware` and
:class:`~scrapy_redislock.requests.scheduler.StageScheduler`)."""
