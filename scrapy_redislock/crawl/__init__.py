"""The Scrapy glue both fronts share: settings and their defaults, how a request's stage is found,
the touches of Scrapy's engine internals, and :class:`~scrapy_redislock.crawl.stagelocks.StageLocks`
(one per crawler: the stage locks, their one renewal loop, the permit hand-off)."""
