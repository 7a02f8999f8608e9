-- queue_epoch: the epoch of a spider's crawl state, made when missing (Redis's clock in microseconds). Deleted only
-- with the rest of the state (queue_clear), so it changes only when the state was deleted or lost: a worker that
-- saw one epoch and later reads another knows that what was queued and in flight is gone (Redis restarted empty,
-- FLUSHALL, a promoted replica that never had it), rather than taken back by the others. A worker reads it at its
-- first beat and whenever a beat says it was not registered: never per request, never on a regular beat.
-- KEYS[1] the epoch (a string)
-- ARGV[1] none (takes no arguments)
-- Returns the epoch.
local epoch = redis.call('GET', KEYS[1])
if epoch then return epoch end
local t = redis.call('TIME')
epoch = t[1] .. string.format('%06d', tonumber(t[2]))
redis.call('SET', KEYS[1], epoch)
return epoch
