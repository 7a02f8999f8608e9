-- queue_beat: a worker is alive (server time), so its in-flight record is not requeued; notes its stage, and names
-- up to ARGV[4] workers silent for ARGV[3] ms (dead: the caller requeues their in-flight requests with
-- queue_requeue). One call per worker per ttl/3, whatever the number of workers. It also says how many entries the
-- worker's in-flight record holds: more than the worker knows of means a pop whose reply was lost.
-- KEYS[1] alive zset (worker -> last beat, ms on Redis's clock), KEYS[2] working hash (worker -> stage),
-- KEYS[3] the worker's in-flight hash
-- ARGV[1] worker id, ARGV[2] the stage it works on ('' = none), ARGV[3] silence in ms that makes a worker dead,
-- ARGV[4] how many dead workers to name at most
-- Returns {beat time in ms, 1 if the worker was not registered (new, or taken for dead and reaped) else 0,
-- entries in the worker's in-flight record, dead worker ids...}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local new = redis.call('ZADD', KEYS[1], now, ARGV[1])
if ARGV[2] == '' then redis.call('HDEL', KEYS[2], ARGV[1]) else redis.call('HSET', KEYS[2], ARGV[1], ARGV[2]) end
local out = {now, new, redis.call('HLEN', KEYS[3])}
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]), 'LIMIT', 0, tonumber(ARGV[4]))
for _, worker in ipairs(dead) do out[#out + 1] = worker end
return out
