-- queue_pop: take up to N requests from a stage's queue into the worker's in-flight record.
-- A pop is also a sign of life: it refreshes the worker's beat (if registered: a worker the others took for
-- dead registers again only by beating, which tells it so).
-- KEYS[1] the stage's queue, KEYS[2] the worker's in-flight hash, KEYS[3] id counter, KEYS[4] alive zset
-- ARGV[1] N, ARGV[2] stage name, ARGV[3] worker id
-- Returns a flat list id1, data1, id2, data2, ... ; each in-flight value is "<stage>\n<data>".
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
