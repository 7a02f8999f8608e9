-- queue_pop: take up to N requests from a stage's queue into the worker's in-flight record.
-- Only a registered worker may pop: one the others took for dead (its in-flight requests already requeued) must
-- beat first, which tells it so and makes it drop what it had taken ahead. Otherwise its pop would land in an
-- in-flight record that nobody reaps while it goes on beating, and it would drop those requests with the rest.
-- A pop is also a sign of life: it moves the worker's deadline (due zset) ARGV[5] ms ahead (a busy worker on a
-- starved CPU is not taken for dead between two heartbeats). The spider's in-flight counter counts what every
-- worker holds (the crawl has ended when it is 0 and the queues are empty). With ARGV[4] = '1' (a worker that has
-- just been woken for this stage) and a full pop, the stage's signal gets a token for the next idle worker.
-- The order (ARGV[6], from SCHEDULER_QUEUE_CLASS): 'priority' takes the sorted set's negative scores (priority > 0,
-- highest first), then the list (priority 0, oldest first), then the rest of the sorted set (priority < 0): as
-- scrapy-redis's PriorityQueue, equal priorities in push order. 'fifo' takes the list's right end (oldest first),
-- 'lifo' its left end (newest first); either then takes what the sorted set holds (left by workers in priority
-- order), so that nothing any worker queued is stranded.
-- Each in-flight value is "<stage><mark>\n<data>", the mark saying where the request goes back to: '' the list's
-- right end, '{L}' its left end, '{P<score>:<order number>}' its place in the sorted set.
-- Any N works: the requests are read first (LRANGE, ZRANGEBYSCORE) and leave the queue (RPOP or LPOP, ZREM) only
-- once they are recorded, because Redis keeps what a script wrote before an error; HSET and ZREM get their
-- arguments 1000 at a time (Lua's unpack stops at about 8000 values).
-- KEYS[1] the stage's list, KEYS[2] its sorted set, KEYS[3] the worker's in-flight hash, KEYS[4] id counter (made
-- from Redis's clock: see below),
-- KEYS[5] alive zset, KEYS[6] in-flight counter, KEYS[7] the stage's signal list, KEYS[8] due zset
-- ARGV[1] N (below 1: nothing is popped), ARGV[2] stage name, ARGV[3] worker id, ARGV[4] '1' = pass the signal
-- on if the queue may hold more, ARGV[5] ms within which the worker beats again, ARGV[6] 'priority', 'fifo' or
-- 'lifo'
-- Returns nil if the worker is not registered (nothing popped), else a flat list id1, data1, mark1, id2, data2,
-- mark2, ... in the order taken. Fewer than N: the queue is empty now.
if not redis.call('ZSCORE', KEYS[5], ARGV[3]) then return false end
local want = tonumber(ARGV[1])
if want < 1 then return {} end
local lifo = ARGV[6] == 'lifo'
local taken = {}  -- {data, mark}
local listed, members = 0, {}  -- how many were taken from the list; the sorted set's members taken

local function take_scored(min, max)
  local rest = want - #taken
  if rest < 1 then return end
  local found = redis.call('ZRANGEBYSCORE', KEYS[2], min, max, 'WITHSCORES', 'LIMIT', 0, rest)
  for i = 1, #found, 2 do
    local member = found[i]
    taken[#taken + 1] = {string.sub(member, 17), '{P' .. found[i + 1] .. ':' .. string.sub(member, 1, 16) .. '}'}
    members[#members + 1] = member
  end
end

local function take_listed()
  local rest = want - #taken
  if rest < 1 then return end
  if lifo then
    local found = redis.call('LRANGE', KEYS[1], 0, rest - 1)  -- the left end, newest first
    for i = 1, #found do taken[#taken + 1] = {found[i], '{L}'} end
    listed = #found
  else
    local found = redis.call('LRANGE', KEYS[1], -rest, -1)  -- the right end, oldest last
    for i = #found, 1, -1 do taken[#taken + 1] = {found[i], ''} end
    listed = #found
  end
end

if ARGV[6] == 'priority' then
  take_scored('-inf', '(0')
  take_listed()
  take_scored('0', '+inf')
else
  take_listed()
  take_scored('-inf', '+inf')
end
local count = #taken
if count == 0 then return {} end
local last = new_ids(KEYS[4], count)  -- _lib.lua
local out, fields = {}, {}
for i = 1, count do
  local id, data, mark = string.format('%d', last - count + i), taken[i][1], taken[i][2]
  fields[#fields + 1] = id
  fields[#fields + 1] = ARGV[2] .. mark .. '\n' .. data
  out[#out + 1] = id
  out[#out + 1] = data
  out[#out + 1] = mark
end
for first = 1, #fields, 1000 do
  redis.call('HSET', KEYS[3], unpack(fields, first, math.min(first + 999, #fields)))
end
redis.call('INCRBY', KEYS[6], count)
-- Recorded: now they may leave the queue.
if listed > 0 then
  if lifo then redis.call('LPOP', KEYS[1], listed) else redis.call('RPOP', KEYS[1], listed) end
end
for first = 1, #members, 1000 do
  redis.call('ZREM', KEYS[2], unpack(members, first, math.min(first + 999, #members)))
end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[8], 'XX', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[5]),
  ARGV[3])
if ARGV[4] == '1' and count == want and redis.call('LLEN', KEYS[7]) == 0 then
  redis.call('LPUSH', KEYS[7], '1')
end
return out
