-- queue_clear: delete a spider's whole crawl state (queues, dupefilter, in-flight records, registry), but
-- only if no worker other than the caller has beaten within ARGV[2] ms. This is SCHEDULER_PERSIST = False
-- (the last worker out clears) and SCHEDULER_FLUSH_ON_START (the first worker in flushes) made safe for a
-- cluster: one worker's close or start never deletes what the others are working on.
-- With ARGV[3] = 'finished' (SCHEDULER_PERSIST = False at close) it also deletes nothing while any work is left: a
-- request in a stage queue (a paused stage's too; either part: its list or its sorted set), in the in-flight counter
-- or in a worker's in-flight record (the keys are told by their names: '}:queue:<stage>', '}:pqueue:<stage>',
-- '}:inflight:<worker>', '}:inflight_total'). Only a finished crawl is cleared that way; a flush on start (no
-- ARGV[3]) is the operator's explicit choice.
-- KEYS[1] alive zset, KEYS[2] working hash, KEYS[3] dupefilter, KEYS[4] id counter, KEYS[5] in-flight counter,
-- KEYS[6] wake list, KEYS[7..] stage lists and sorted sets, their signal lists and the in-flight hashes of the
-- registered workers, and any other key of the crawl state (the epoch, the due zset, the order counter)
-- ARGV[1] caller's worker id, ARGV[2] ms within which a beat counts as alive, ARGV[3] 'finished' (optional),
-- ARGV[4] 'dry' (optional): only tell whether it would clear (a worker that keeps a leftover dupefilter asks)
-- Returns 1 cleared (or would clear), 0 another worker is alive, -1 work is left (nothing deleted in either case).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = redis.call('ZRANGEBYSCORE', KEYS[1], now - tonumber(ARGV[2]), '+inf')
for _, worker in ipairs(live) do
  if worker ~= ARGV[1] then return 0 end
end
if ARGV[3] == 'finished' then
  for _, key in ipairs(KEYS) do
    if string.find(key, '}:queue:', 1, true) then
      if redis.call('LLEN', key) > 0 then return -1 end
    elseif string.find(key, '}:pqueue:', 1, true) then
      if redis.call('ZCARD', key) > 0 then return -1 end
    elseif string.find(key, '}:inflight:', 1, true) then
      if redis.call('HLEN', key) > 0 then return -1 end
    elseif string.sub(key, -16) == '}:inflight_total' then
      if tonumber(redis.call('GET', key) or '0') > 0 then return -1 end
    end
  end
end
if ARGV[4] == 'dry' then return 1 end
-- 1000 keys per DEL: Lua's unpack stops at about 8000 values (many registered workers, each with its record).
for first = 1, #KEYS, 1000 do
  redis.call('DEL', unpack(KEYS, first, math.min(first + 999, #KEYS)))
end
return 1
