-- queue_beat: a worker is alive (server time), so its in-flight record is not requeued; notes its stage.
-- KEYS[1] alive zset (worker -> last beat, ms on Redis's clock), KEYS[2] working hash (worker -> stage)
-- ARGV[1] worker id, ARGV[2] the stage it works on ('' = none)
-- Returns {beat time in ms, 1 if the worker was not registered (new, or taken for dead and reaped) else 0}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local new = redis.call('ZADD', KEYS[1], now, ARGV[1])
if ARGV[2] == '' then redis.call('HDEL', KEYS[2], ARGV[1]) else redis.call('HSET', KEYS[2], ARGV[1], ARGV[2]) end
return {now, new}
