-- queue_epoch: the epoch of a crawl's queue, made when missing (Redis's clock in microseconds), for both fronts. It
-- changes only when the queue was deleted or lost (Redis restarted without persistence, FLUSHALL, a promoted replica
-- that never had it): a process that saw one epoch and later reads another knows that what was queued (and in flight,
-- and the dupefilter) is gone, rather than taken by the others. The worker front's is deleted only with the rest of
-- the crawl state (queue_clear.lua); a worker reads it at its first beat and whenever a beat says it was not
-- registered, never per request (workers/queue.py). Nothing deletes the request front's (beside a shared scrapy-redis
-- queue); each process reads it at start and at every renewal tick (requests/queueloss.py).
-- KEYS[1] the epoch (a string): '<prefix>:{<spider>}:epoch' (worker front) or
--         '<prefix>:shared:{<the spider's queue key>}:epoch' (request front)
-- ARGV none
-- Returns the epoch.
local epoch = redis.call('GET', KEYS[1])
if epoch then return epoch end
local t = redis.call('TIME')
epoch = t[1] .. string.format('%06d', tonumber(t[2]))
redis.call('SET', KEYS[1], epoch)
return epoch
