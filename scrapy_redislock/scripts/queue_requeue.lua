-- queue_requeue: give a worker's in-flight requests back to their stage queues (front) and forget it,
-- if it has not beaten for ARGV[2] ms (a dead worker), or unconditionally when ARGV[2] is '0' (own close).
-- KEYS[1] alive zset, KEYS[2] the worker's in-flight hash, KEYS[3] working hash,
-- KEYS[4..] stage queues, in ARGV[3..] order
-- ARGV[1] worker id, ARGV[2] silence in ms that makes it dead ('0' = now), ARGV[3..] stage names
-- Returns the number of requests requeued, or -1 if the worker is alive.
if ARGV[2] ~= '0' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local beat = redis.call('ZSCORE', KEYS[1], ARGV[1])
  if beat and now - tonumber(beat) < tonumber(ARGV[2]) then return -1 end
end
local queue_of = {}
for i = 3, #ARGV do queue_of[ARGV[i]] = KEYS[i + 1] end
local entries = redis.call('HGETALL', KEYS[2])
local moved = 0
for i = 2, #entries, 2 do
  local stage, data = string.match(entries[i], '^([^\n]*)\n(.*)$')
  if queue_of[stage] then
    redis.call('LPUSH', queue_of[stage], data)
    moved = moved + 1
  end
end
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return moved
