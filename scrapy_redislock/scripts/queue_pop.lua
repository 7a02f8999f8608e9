-- queue_pop: take up to N requests from a stage's queue into the worker's in-flight record.
-- KEYS[1] the stage's queue, KEYS[2] the worker's in-flight hash, KEYS[3] id counter
-- ARGV[1] N, ARGV[2] stage name
-- Returns a flat list id1, data1, id2, data2, ... ; each in-flight value is "<stage>\n<data>".
local out = {}
for _ = 1, tonumber(ARGV[1]) do
  local data = redis.call('LPOP', KEYS[1])
  if not data then break end
  local id = redis.call('INCR', KEYS[3])
  redis.call('HSET', KEYS[2], id, ARGV[2] .. '\n' .. data)
  table.insert(out, id)
  table.insert(out, data)
end
return out
