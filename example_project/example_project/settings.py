"""Settings of the example shop crawl: worker slots per stage over scrapy-redis.

The runner (example_project/run.py) passes REDISLOCK_URL, SHOP_URL and the page counts on the command line.
"""

BOT_NAME = "example_project"
SPIDER_MODULES = ["example_project.spiders"]
ROBOTSTXT_OBEY = False
TELNETCONSOLE_ENABLED = False
LOG_LEVEL = "INFO"
CONCURRENT_REQUESTS = 2
CONCURRENT_REQUESTS_PER_DOMAIN = 1000
RETRY_ENABLED = False

# Where the shared state lives (the runner overrides it with the Redis it started).
REDISLOCK_URL = "redis://localhost:6379/0"
REDISLOCK_TTL = 5
# Max workers per stage, cluster-wide; the spider's worker_stages says the same (either is enough).
REDISLOCK_WORKER_STAGES = {"list": 1, "detail": 3, "comments": None}
REDISLOCK_STAGE_PREFERENCE = ["list", "detail", "comments"]
# Close a worker once no stage has had work anywhere for this many seconds (None: idle like RedisSpider).
REDISLOCK_IDLE_CLOSE = 3

# The baseline spider (no stage slots) uses scrapy-redis as it comes, with a FIFO queue.
SCHEDULER_QUEUE_CLASS = "scrapy_redis.queue.FifoQueue"
SCHEDULER_PERSIST = True
MAX_IDLE_TIME_BEFORE_CLOSE = 3
