-- queue_keep: requests that name no stage, yielded on this worker and fetched by it: each one's fingerprint goes to
-- the shared dupefilter together with the request itself into the worker's in-flight record, so that the request is
-- in Redis for as long as its fingerprint says it is taken. If the worker dies (or closes) before it has handled
-- one, the request goes back like a popped one (queue_requeue.lua, queue_return.lua): to the front of its home
-- stage's queue (the stage the worker worked on when it was yielded), for whichever worker takes that stage. A
-- worker that is not registered (the others took it for dead and requeued its record) records nothing in its
-- record: the requests go to the front of the home stage's queue at once (nobody would requeue them). A request
-- with no data (one the request format cannot store) only has its fingerprint recorded: it lives in the worker's
-- memory only.
-- KEYS[1] dupefilter set, KEYS[2] the worker's in-flight hash, KEYS[3] id counter, KEYS[4] in-flight counter,
-- KEYS[5] alive zset, KEYS[6] the home stage's list, KEYS[7] its sorted set, KEYS[8] its signal list
-- ARGV[1] worker id, ARGV[2] home stage, then in threes: the fingerprint ('' = never filtered), the mark (where it
--         goes back to, as queue_pop.lua writes it: '' the list's right end, '{L}' its left end,
--         '{P<score>:<order number>}' the sorted set), the serialized request ('' = fingerprint only)
-- Returns one integer per three: its in-flight id (> 0), 0 filtered as a duplicate, -1 fingerprint recorded only
-- (no data), -2 queued in the home stage's queue (the worker is not registered).
local registered = redis.call('ZSCORE', KEYS[5], ARGV[1]) ~= false
local out, fields = {}, {}
local queued, was_empty = 0, nil
for i = 3, #ARGV, 3 do
  local fingerprint, mark, data = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if fingerprint ~= '' and redis.call('SADD', KEYS[1], fingerprint) == 0 then
    out[#out + 1] = 0
  elseif data == '' then
    out[#out + 1] = -1
  elseif registered then
    fields[#fields + 1] = #out + 1  -- its place in out, its id below
    fields[#fields + 1] = ARGV[2] .. mark .. '\n' .. data
    out[#out + 1] = 0
  else
    if was_empty == nil then was_empty = redis.call('EXISTS', KEYS[6], KEYS[7]) == 0 end
    local score, order = string.match(mark, '^{P([^:]+):(%d+)}$')
    if score then
      redis.call('ZADD', KEYS[7], score, order .. data)
    elseif mark == '{L}' then
      redis.call('LPUSH', KEYS[6], data)
    else
      redis.call('RPUSH', KEYS[6], data)
    end
    queued = queued + 1
    out[#out + 1] = -2
  end
end
local count = #fields / 2
if count > 0 then
  local last = new_ids(KEYS[3], count)  -- _lib.lua
  local hash = {}
  for k = 1, count do
    local id = last - count + k
    out[fields[2 * k - 1]] = id
    hash[#hash + 1] = string.format('%d', id)
    hash[#hash + 1] = fields[2 * k]
  end
  for first = 1, #hash, 1000 do
    redis.call('HSET', KEYS[2], unpack(hash, first, math.min(first + 999, #hash)))
  end
  redis.call('INCRBY', KEYS[4], count)
end
if queued > 0 and was_empty and redis.call('LLEN', KEYS[8]) == 0 then redis.call('LPUSH', KEYS[8], '1') end
return out
