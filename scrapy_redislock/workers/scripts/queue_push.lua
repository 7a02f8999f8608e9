-- queue_push: add requests to their stage queues, each unless the shared dupefilter has seen it.
-- The queues are lists in scrapy-redis's FifoQueue orientation: pushed on the left, popped on the right.
-- KEYS[1] dupefilter set, KEYS[2..] stage queues (lists)
-- ARGV[1], ARGV[2], ARGV[3] and so on, in triples: the request's queue (1 = KEYS[2]), its fingerprint ('' =
--         never filtered), the serialized request ('' = only record the fingerprint: a request with no stage,
--         which the worker keeps in memory)
-- Returns one integer per triple: 1 queued (or new), 0 filtered as a duplicate.
local out = {}
for i = 1, #ARGV, 3 do
  local fingerprint, data = ARGV[i + 1], ARGV[i + 2]
  if fingerprint ~= '' and redis.call('SADD', KEYS[1], fingerprint) == 0 then
    out[#out + 1] = 0
  else
    if data ~= '' then redis.call('LPUSH', KEYS[1 + tonumber(ARGV[i])], data) end
    out[#out + 1] = 1
  end
end
return out
