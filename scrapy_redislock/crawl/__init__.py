"""The Scrapy glue both fronts share: settings and their defaults, how a request's stage is found,
the touches of Scrapy's engine internals, and :class:`~scrapy_redislock.crawl.stagelocks.StageLocks`
(one per crawler: the stage locks, their start, renewal and close; the process's one renewal loop
runs the worker front's itself, and the request front's through the front)."""
