-- queue_requeue: give a worker's in-flight requests back to the front of their stage queues and forget the
-- worker, if it is dead (past the deadline its last beat or pop set in the due zset; a worker with no deadline
-- there: silent for ARGV[2] ms), or unconditionally when ARGV[2] is '0' (its own close, or an operator's
-- requeue). Each goes back where its in-flight value's mark says ("<stage><mark>\n<data>", see queue_pop.lua): ''
-- the list's right end, '{L}' its left end, '{P<score>:<order number>}' its own place in the sorted set. Entries of
-- a stage not listed (a worker with other stage names), or with a mark it does not know, stay in the hash,
-- uncounted. A stage whose queue (both parts) was empty gets a token on its signal list, so that an idle worker
-- takes the requests at once.
-- KEYS[1] alive zset, KEYS[2] the worker's in-flight hash, KEYS[3] working hash, KEYS[4] in-flight counter,
-- KEYS[5..4+n] stage lists, KEYS[5+n..4+2n] their sorted sets, KEYS[5+2n..4+3n] their signal lists, in ARGV[3..]
-- order, KEYS[5+3n] due zset
-- ARGV[1] worker id, ARGV[2] silence in ms that makes a worker with no deadline dead ('0' = now: unconditional),
-- ARGV[3..] stage names
-- Returns {requeued, left in the hash}, or {-1, 0} if the worker is alive.
local n = #ARGV - 2
local due_key = KEYS[5 + 3 * n]
if ARGV[2] ~= '0' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local due = redis.call('ZSCORE', due_key, ARGV[1])
  if due then
    if tonumber(due) >= now then return {-1, 0} end
  else
    local beat = redis.call('ZSCORE', KEYS[1], ARGV[1])
    if beat and now - tonumber(beat) < tonumber(ARGV[2]) then return {-1, 0} end
  end
end
local index = {}
for i = 3, #ARGV do index[ARGV[i]] = i - 2 end
local entries = redis.call('HGETALL', KEYS[2])
local ids = {}
for i = 1, #entries, 2 do table.insert(ids, {tonumber(entries[i]), entries[i], entries[i + 1]}) end
table.sort(ids, function(a, b) return a[1] < b[1] end)
local was_empty = {}  -- stage -> whether its queue was empty before the first request given back
local moved, left = 0, 0
-- Newest first onto the front (the popping end), so the oldest is popped first again.
for i = #ids, 1, -1 do
  local head, data = string.match(ids[i][3], '^([^\n]*)\n(.*)$')
  local stage, mark, score, order
  if head then stage, mark = string.match(head, '^([^{]*)(.*)$') end
  local q = stage and index[stage]
  if q and mark ~= '' and mark ~= '{L}' then score, order = string.match(mark, '^{P([^:]+):(%d+)}$') end
  if q and (mark == '' or mark == '{L}' or score) then
    local list, zset = KEYS[4 + q], KEYS[4 + n + q]
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
    redis.call('HDEL', KEYS[2], ids[i][2])
    moved = moved + 1
  else
    left = left + 1
  end
end
for q, empty in pairs(was_empty) do
  local signal = KEYS[4 + 2 * n + q]
  if empty and redis.call('LLEN', signal) == 0 then redis.call('LPUSH', signal, '1') end
end
if #ids > 0 and redis.call('DECRBY', KEYS[4], #ids) < 0 then redis.call('SET', KEYS[4], 0) end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', due_key, ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return {moved, left}
