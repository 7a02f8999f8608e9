-- queue_reclaim: give back, to the front of their queues, the entries of the caller's in-flight record that it does
-- not know of. A pop whose reply never reached the worker (a connection cut or a failover after the script ran, or
-- a cluster client that ran it again on the new master) left them there; queue_beat tells the worker how many
-- entries its record holds, and it calls this when that is more than it knows of.
-- KEYS[1] the worker's in-flight hash, KEYS[2] in-flight counter, KEYS[3..2+n] stage queues, KEYS[3+n..2+2n]
-- their signal lists, in ARGV[2..1+n] order
-- ARGV[1] n (number of stages), ARGV[2..1+n] stage names, ARGV[2+n..] the in-flight ids the worker knows of
-- Returns the number of requests given back.
local n = tonumber(ARGV[1])
local queue_of, signal_of = {}, {}
for i = 1, n do
  queue_of[ARGV[1 + i]] = KEYS[2 + i]
  signal_of[ARGV[1 + i]] = KEYS[2 + n + i]
end
local known = {}
for i = n + 2, #ARGV do known[ARGV[i]] = true end
local unknown = {}
for _, id in ipairs(redis.call('HKEYS', KEYS[1])) do
  if not known[id] then unknown[#unknown + 1] = id end
end
table.sort(unknown, function(a, b) return tonumber(a) < tonumber(b) end)
local moved = 0
for i = #unknown, 1, -1 do  -- newest first, so that the oldest is the next one taken (RPOP takes from the right)
  local value = redis.call('HGET', KEYS[1], unknown[i])
  local stage, data = string.match(value, '^([^\n]*)\n(.*)$')
  if stage and queue_of[stage] then
    if redis.call('RPUSH', queue_of[stage], data) == 1 and redis.call('LLEN', signal_of[stage]) == 0 then
      redis.call('LPUSH', signal_of[stage], '1')
    end
    redis.call('HDEL', KEYS[1], unknown[i])
    moved = moved + 1
  end
end
if moved > 0 and redis.call('DECRBY', KEYS[2], moved) < 0 then redis.call('SET', KEYS[2], 0) end
return moved
