-- queue_return: give some of the caller's in-flight requests back to the front of their stage queues
-- (popped but not started: the worker lost its stage slot, or is closing).
-- KEYS[1] the worker's in-flight hash, KEYS[2..] stage queues, in ARGV[2..1+n] order
-- ARGV[1] n (number of stages), ARGV[2..1+n] stage names, ARGV[2+n..] in-flight ids, oldest first
-- Returns the number of requests given back.
local n = tonumber(ARGV[1])
local queue_of = {}
for i = 1, n do queue_of[ARGV[1 + i]] = KEYS[1 + i] end
local moved = 0
for i = #ARGV, n + 2, -1 do
  local value = redis.call('HGET', KEYS[1], ARGV[i])
  if value then
    local stage, data = string.match(value, '^([^\n]*)\n(.*)$')
    if stage and queue_of[stage] then
      redis.call('RPUSH', queue_of[stage], data)
      redis.call('HDEL', KEYS[1], ARGV[i])
      moved = moved + 1
    end
  end
end
return moved
