-- queue_return: give some of the caller's in-flight requests back to the front of their stage queues
-- (popped but not started: the worker lost its stage slot, or is closing). A queue that was empty gets a token on
-- its signal list, so that an idle worker takes them at once.
-- KEYS[1] the worker's in-flight hash, KEYS[2] in-flight counter, KEYS[3..2+n] stage queues, KEYS[3+n..2+2n]
-- their signal lists, in ARGV[2..1+n] order
-- ARGV[1] n (number of stages), ARGV[2..1+n] stage names, ARGV[2+n..] in-flight ids, oldest first
-- Returns the number of requests given back.
local n = tonumber(ARGV[1])
local queue_of, signal_of = {}, {}
for i = 1, n do
  queue_of[ARGV[1 + i]] = KEYS[2 + i]
  signal_of[ARGV[1 + i]] = KEYS[2 + n + i]
end
local moved = 0
for i = #ARGV, n + 2, -1 do
  local value = redis.call('HGET', KEYS[1], ARGV[i])
  if value then
    local stage, data = string.match(value, '^([^\n]*)\n(.*)$')
    if stage and queue_of[stage] then
      if redis.call('RPUSH', queue_of[stage], data) == 1 and redis.call('LLEN', signal_of[stage]) == 0 then
        redis.call('LPUSH', signal_of[stage], '1')
      end
      redis.call('HDEL', KEYS[1], ARGV[i])
      moved = moved + 1
    end
  end
end
if moved > 0 and redis.call('DECRBY', KEYS[2], moved) < 0 then redis.call('SET', KEYS[2], 0) end
return moved
