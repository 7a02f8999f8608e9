-- queue_push: add requests to their stage queues, each unless the shared dupefilter has seen it, and signal work.
-- The queues are lists in scrapy-redis's FifoQueue orientation: pushed on the left, popped on the right. A queue
-- that goes from empty to non-empty gets one token on its stage's signal list (at most one waits there): an idle
-- worker blocked on it (BLPOP) starts at once; the worker that takes the work passes the token on while there is more.
-- KEYS[1] dupefilter set, KEYS[2..1+n] stage queues (lists), KEYS[2+n..1+2n] their signal lists
-- ARGV[1] n, then in triples: the request's queue (1 = KEYS[2]), its fingerprint ('' = never filtered), the
--         serialized request ('' = only record the fingerprint: a request with no stage, kept in memory)
-- Returns one integer per triple: 1 queued (or new), 0 filtered as a duplicate.
local n = tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV, 3 do
  local fingerprint, data = ARGV[i + 1], ARGV[i + 2]
  if fingerprint ~= '' and redis.call('SADD', KEYS[1], fingerprint) == 0 then
    out[#out + 1] = 0
  else
    if data ~= '' then
      local q = tonumber(ARGV[i])
      if redis.call('LPUSH', KEYS[1 + q], data) == 1 and redis.call('LLEN', KEYS[1 + n + q]) == 0 then
        redis.call('LPUSH', KEYS[1 + n + q], '1')
      end
    end
    out[#out + 1] = 1
  end
end
return out
