"""Settings of the example shop crawl: worker slots per stage over scrapy-redis.

The runner (``python -m example_project.run``) passes the Redis URL, the per-worker concurrency and
the TTL on the command line (``-s``); everything else is here.
"""

BOT_NAME = "example_project"
SPIDER_MODULES = ["example_project.spiders"]
ROBOTSTXT_OBEY = False
TELNETCONSOLE_ENABLED = False
LOG_LEVEL = "INFO"
CONCURRENT_REQUESTS = 2
CONCURRENT_REQUESTS_PER_DOMAIN = 1000
RETRY_ENABLED = False

# Where the shared state lives; scrapy-redis reads REDIS_URL, scrapy_redislock reads REDISLOCK_URL
# and falls back to REDIS_URL, so one setting is enough.
REDIS_URL = "redis://localhost:6379/0"

# Max workers per stage, cluster-wide (ShopSpider says the same with worker_stages; either one is
# enough).
REDISLOCK_WORKER_STAGES = {"list": 1, "detail": 3, "comments": None}
# A worker with nothing left to do takes the first of these that has work and a free slot.
REDISLOCK_STAGE_PREFERENCE = ["list", "detail", "comments"]
# Slot leases: renewed every TTL/3; a killed worker's slot and its unfinished requests come back
# after the TTL.
REDISLOCK_TTL = 5
# Close a worker once no stage has had work anywhere for this many seconds (None: idle like a
# RedisSpider).
REDISLOCK_IDLE_CLOSE = 3
# scrapy-redis's setting, honoured by the worker queues too: keep the queues and the dupefilter
# after the crawl (False: the last worker out clears them; never the first, as plain scrapy-redis
# would).
SCHEDULER_PERSIST = True

# The baseline spider (plain scrapy-redis) closes after this many idle seconds.
MAX_IDLE_TIME_BEFORE_CLOSE = 3
