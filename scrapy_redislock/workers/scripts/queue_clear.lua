-- queue_clear: delete a spider's whole crawl state (queues, dupefilter, in-flight records, registry), but
-- only if no worker other than the caller has beaten within ARGV[2] ms. This is SCHEDULER_PERSIST = False
-- (the last worker out clears) and SCHEDULER_FLUSH_ON_START (the first worker in flushes) made safe for a
-- cluster: one worker's close or start never deletes what the others are working on.
-- KEYS[1] alive zset, KEYS[2] working hash, KEYS[3] dupefilter, KEYS[4] id counter, KEYS[5] in-flight counter,
-- KEYS[6] wake list, KEYS[7..] stage queues, their signal lists and the in-flight hashes of the registered workers
-- ARGV[1] caller's worker id, ARGV[2] ms within which a beat counts as alive
-- Returns 1 cleared, 0 another worker is alive (nothing deleted).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = redis.call('ZRANGEBYSCORE', KEYS[1], now - tonumber(ARGV[2]), '+inf')
for _, worker in ipairs(live) do
  if worker ~= ARGV[1] then return 0 end
end
-- 1000 keys per DEL: Lua's unpack stops at about 8000 values (many registered workers, each with its record).
for first = 1, #KEYS, 1000 do
  redis.call('DEL', unpack(KEYS, first, math.min(first + 999, #KEYS)))
end
return 1
