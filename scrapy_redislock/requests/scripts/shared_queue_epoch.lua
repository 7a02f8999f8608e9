-- shared_queue_epoch: the epoch of a shared scrapy-redis queue (StageScheduler over scrapy-redis's scheduler), made
-- when missing (Redis's clock in microseconds). Nothing deletes it, so it changes only when Redis lost its data (a
-- restart without persistence, FLUSHALL, a promoted replica that never had it): a process that saw one epoch and
-- later reads another knows that the queue and scrapy-redis's dupefilter it knew of are gone. Each process reads it
-- at start and at every renewal tick (see scrapy_redislock/requests/queueloss.py).
-- KEYS[1] the epoch (a string): '<prefix>:shared:{<the spider's queue key>}:epoch'
-- ARGV none
-- Returns the epoch.
local epoch = redis.call('GET', KEYS[1])
if epoch then return epoch end
local t = redis.call('TIME')
epoch = t[1] .. string.format('%06d', tonumber(t[2]))
redis.call('SET', KEYS[1], epoch)
return epoch
