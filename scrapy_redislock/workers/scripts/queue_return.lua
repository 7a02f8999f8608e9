-- queue_return: give some of the caller's in-flight requests back to the front of their stage queues
-- (popped but not started: the worker lost its stage slot, or is closing). Each goes back where its in-flight value's
-- mark says ("<stage><mark>\n<data>", see queue_pop.lua): '' the list's right end, '{L}' its left end,
-- '{P<score>:<order number>}' its own place in the sorted set; so the oldest is popped first again. A stage whose
-- queue (both parts) was empty gets a token on its signal list, so that an idle worker takes them at once. An entry
-- of a stage not listed, or with a mark it does not know, stays in the record.
-- KEYS[1] the worker's in-flight hash, KEYS[2] in-flight counter, KEYS[3..2+n] stage lists, KEYS[3+n..2+2n] their
-- sorted sets, KEYS[3+2n..2+3n] their signal lists, in ARGV[2..1+n] order
-- ARGV[1] n (number of stages), ARGV[2..1+n] stage names, ARGV[2+n..] in-flight ids, oldest first
-- Returns the number of requests given back.
local n = tonumber(ARGV[1])
local index = {}
for i = 1, n do index[ARGV[1 + i]] = i end
local was_empty = {}  -- stage -> whether its queue was empty before the first request given back
local moved = 0
-- Newest first onto the front (the popping end), so the oldest is popped first again.
for i = #ARGV, n + 2, -1 do
  local value = redis.call('HGET', KEYS[1], ARGV[i])
  if value then
    local head, data = string.match(value, '^([^\n]*)\n(.*)$')
    local stage, mark, score, order
    if head then stage, mark = string.match(head, '^([^{]*)(.*)$') end
    local q = stage and index[stage]
    if q and mark ~= '' and mark ~= '{L}' then score, order = string.match(mark, '^{P([^:]+):(%d+)}$') end
    if q and (mark == '' or mark == '{L}' or score) then
      local list, zset = KEYS[2 + q], KEYS[2 + n + q]
      if was_empty[q] == nil then
        was_empty[q] = redis.call('EXISTS', list, zset) == 0  -- an empty list or sorted set is no key
      end
      if mark == '' then
        redis.call('RPUSH', list, data)
      elseif mark == '{L}' then
        redis.call('LPUSH', list, data)
      else
        redis.call('ZADD', zset, score, order .. data)
      end
      redis.call('HDEL', KEYS[1], ARGV[i])
      moved = moved + 1
    end
  end
end
for q, empty in pairs(was_empty) do
  local signal = KEYS[2 + 2 * n + q]
  if empty and redis.call('LLEN', signal) == 0 then redis.call('LPUSH', signal, '1') end
end
if moved > 0 and redis.call('DECRBY', KEYS[2], moved) < 0 then redis.call('SET', KEYS[2], 0) end
return moved
