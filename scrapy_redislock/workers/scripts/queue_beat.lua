-- queue_beat: a worker is alive (server time), so its in-flight record is not requeued; notes its stage, promises its
-- next beat within ARGV[3] ms (its deadline in the due zset), and names up to ARGV[4] workers whose deadline has
-- passed (dead: the caller requeues their in-flight requests with queue_requeue). One call per worker per beat
-- (every ttl/3; at least every second while it has work), whatever the number of workers. A full beat also says how
-- many entries the worker's in-flight record holds: more than the worker knows of means a pop whose reply was lost.
-- KEYS[1] alive zset (worker -> last beat, ms on Redis's clock), KEYS[2] working hash (worker -> stage),
-- KEYS[3] the worker's in-flight hash, KEYS[4] due zset (worker -> ms by which it must beat again, or be dead)
-- ARGV[1] worker id, ARGV[2] the stage it works on ('' = none), ARGV[3] ms within which it beats again,
-- ARGV[4] how many dead workers to name at most, ARGV[5] '1' = a pulse (only the beat and the dead: its stage note
-- is left as it is unless it was not registered, and its in-flight record is not counted)
-- Returns {beat time in ms, 1 if the worker was not registered (new, or taken for dead and reaped) else 0,
-- entries in the worker's in-flight record (0 for a pulse), dead worker ids...}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local new = redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[3]), ARGV[1])
local pulse = ARGV[5] == '1'
if not pulse or new == 1 then
  if ARGV[2] == '' then redis.call('HDEL', KEYS[2], ARGV[1]) else redis.call('HSET', KEYS[2], ARGV[1], ARGV[2]) end
end
local holds = 0
if not pulse then holds = redis.call('HLEN', KEYS[3]) end
local out = {now, new, holds}
local dead = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', '(' .. now, 'LIMIT', 0, tonumber(ARGV[4]))
for _, worker in ipairs(dead) do out[#out + 1] = worker end
return out
