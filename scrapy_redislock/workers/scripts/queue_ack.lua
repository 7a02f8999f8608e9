-- queue_ack: requests have been fully handled (download, callback, the requests they yielded are queued); drop
-- them from the worker's in-flight record and from the spider's in-flight counter. When that leaves nothing in
-- flight anywhere and every stage queue empty, the crawl has ended: every registered worker gets a token on the
-- wake list, so that idle workers blocked on it see the end at once instead of at their next heartbeat.
-- KEYS[1] the worker's in-flight hash, KEYS[2] in-flight counter, KEYS[3] wake list, KEYS[4] alive zset,
-- KEYS[5..4+n] stage lists, KEYS[5+n..4+2n] their sorted sets (a stage queue's two parts: see queue_pop.lua)
-- ARGV[1], ARGV[2], ... in-flight ids (any number: HDEL gets them 1000 at a time, as Lua's unpack stops at about
-- 8000 values)
-- Returns how many were dropped.
local dropped = 0
for first = 1, #ARGV, 1000 do
  dropped = dropped + redis.call('HDEL', KEYS[1], unpack(ARGV, first, math.min(first + 999, #ARGV)))
end
if dropped == 0 then return 0 end
local left = redis.call('DECRBY', KEYS[2], dropped)
if left > 0 then return dropped end
if left < 0 then redis.call('SET', KEYS[2], 0) end
local n = (#KEYS - 4) / 2
for i = 5, 4 + n do
  if redis.call('EXISTS', KEYS[i], KEYS[i + n]) > 0 then return dropped end  -- an empty part is no key
end
local workers = redis.call('ZCARD', KEYS[4])
redis.call('DEL', KEYS[3])
for _ = 1, workers do redis.call('LPUSH', KEYS[3], '1') end
return dropped
