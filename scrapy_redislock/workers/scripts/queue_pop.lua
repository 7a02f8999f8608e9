-- queue_pop: take up to N requests from a stage's queue into the worker's in-flight record.
-- Only a registered worker may pop: one the others took for dead (its in-flight requests already requeued) must
-- beat first, which tells it so and makes it drop what it had taken ahead. Otherwise its pop would land in an
-- in-flight record that nobody reaps while it goes on beating, and it would drop those requests with the rest.
-- A pop is also a sign of life: it refreshes the worker's beat.
-- KEYS[1] the stage's queue, KEYS[2] the worker's in-flight hash, KEYS[3] id counter, KEYS[4] alive zset
-- ARGV[1] N, ARGV[2] stage name, ARGV[3] worker id
-- Returns nil if the worker is not registered (nothing popped), else a flat list id1, data1, id2, data2, ... ;
-- each in-flight value is "<stage>\n<data>".
if not redis.call('ZSCORE', KEYS[4], ARGV[3]) then return false end
local out = {}
for _ = 1, tonumber(ARGV[1]) do
  local data = redis.call('RPOP', KEYS[1])
  if not data then break end
  local id = redis.call('INCR', KEYS[3])
  redis.call('HSET', KEYS[2], id, ARGV[2] .. '\n' .. data)
  table.insert(out, id)
  table.insert(out, data)
end
if #out > 0 then
  local t = redis.call('TIME')
  redis.call('ZADD', KEYS[4], 'XX', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), ARGV[3])
end
return out
