-- queue_push: add requests to their stage queues, each unless the shared dupefilter has seen it, and signal work.
-- A stage queue has two parts (see workers/queue.py): a list in scrapy-redis's FifoQueue orientation (pushed on the
-- left, popped on the right; LIFO order pops on the left) and a sorted set scored -priority, as scrapy-redis's
-- PriorityQueue (lowest score first), whose members are a 16-digit order number followed by the request, so that
-- equal priorities keep their push order. A request with no score goes to the list (FIFO or LIFO order, and the
-- requests of priority 0 in priority order), one with a score to the sorted set. A stage that goes from empty (both
-- parts) to non-empty gets one token on its signal list (at most one waits there): an idle worker blocked on it
-- (BLPOP) starts at once; the worker that takes the work passes the token on while there is more.
-- KEYS[1] dupefilter set, KEYS[2] order counter, KEYS[3..2+n] stage lists, KEYS[3+n..2+2n] their sorted sets,
-- KEYS[3+2n..2+3n] their signal lists
-- ARGV[1] n, then in fours: the request's stage (1 = the first), its fingerprint ('' = never filtered), its score
--         ('' = the list; else -priority, the sorted set), the serialized request ('' = only record the
--         fingerprint: a request with no stage, kept in memory)
-- Returns one integer per four: 1 queued (or new), 0 filtered as a duplicate.
local n = tonumber(ARGV[1])
local scored = 0
for i = 2, #ARGV, 4 do
  if ARGV[i + 2] ~= '' and ARGV[i + 3] ~= '' then scored = scored + 1 end
end
-- One INCRBY per call reserves the order numbers of its scored requests (a duplicate leaves a gap: no matter).
local order = 0
if scored > 0 then order = redis.call('INCRBY', KEYS[2], scored) - scored end
local decided = {}  -- stage -> true once this call knows whether the stage was empty before it
local out = {}
for i = 2, #ARGV, 4 do
  local q, fingerprint, score, data = tonumber(ARGV[i]), ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  if fingerprint ~= '' and redis.call('SADD', KEYS[1], fingerprint) == 0 then
    out[#out + 1] = 0
  else
    if data ~= '' then
      local list, zset = KEYS[2 + q], KEYS[2 + n + q]
      local empty = false
      if score == '' then
        local length = redis.call('LPUSH', list, data)
        if not decided[q] then empty = length == 1 and redis.call('EXISTS', zset) == 0 end
      else
        if not decided[q] then empty = redis.call('EXISTS', list, zset) == 0 end  -- an empty part is no key
        order = order + 1
        redis.call('ZADD', zset, score, string.format('%016d', order) .. data)
      end
      if not decided[q] then
        decided[q] = true
        local signal = KEYS[2 + 2 * n + q]
        if empty and redis.call('LLEN', signal) == 0 then redis.call('LPUSH', signal, '1') end
      end
    end
    out[#out + 1] = 1
  end
end
return out
