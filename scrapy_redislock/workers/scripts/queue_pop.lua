-- queue_pop: take up to N requests from a stage's queue into the worker's in-flight record.
-- Only a registered worker may pop: one the others took for dead (its in-flight requests already requeued) must
-- beat first, which tells it so and makes it drop what it had taken ahead. Otherwise its pop would land in an
-- in-flight record that nobody reaps while it goes on beating, and it would drop those requests with the rest.
-- A pop is also a sign of life: it moves the worker's deadline (due zset) ARGV[5] ms ahead (a busy worker on a
-- starved CPU is not taken for dead between two heartbeats). The spider's in-flight counter counts what every
-- worker holds (the crawl has ended when it is 0 and the queues are empty). With ARGV[4] = '1' (a worker that has
-- just been woken for this stage) and a full pop, the stage's signal gets a token for the next idle worker.
-- Any N works: the requests are read first (LRANGE) and leave the queue (RPOP) only once they are recorded, because
-- Redis keeps what a script wrote before an error; HSET gets its fields 1000 at a time (Lua's unpack stops at
-- about 8000 values).
-- KEYS[1] the stage's queue, KEYS[2] the worker's in-flight hash, KEYS[3] id counter, KEYS[4] alive zset,
-- KEYS[5] in-flight counter, KEYS[6] the stage's signal list, KEYS[7] due zset
-- ARGV[1] N (below 1: nothing is popped), ARGV[2] stage name, ARGV[3] worker id, ARGV[4] '1' = pass the signal
-- on if the queue may hold more, ARGV[5] ms within which the worker beats again
-- Returns nil if the worker is not registered (nothing popped), else a flat list id1, data1, id2, data2, ... ;
-- each in-flight value is "<stage>\n<data>". Fewer than N: the queue is empty now.
if not redis.call('ZSCORE', KEYS[4], ARGV[3]) then return false end
local want = tonumber(ARGV[1])
if want < 1 then return {} end
-- The queue's right end, oldest last: what RPOP would take, in reverse order.
local taken = redis.call('LRANGE', KEYS[1], -want, -1)
local count = #taken
if count == 0 then return {} end
local last = redis.call('INCRBY', KEYS[3], count)
local out, fields = {}, {}
for i = 1, count do
  local id, data = tostring(last - count + i), taken[count + 1 - i]
  fields[#fields + 1] = id
  fields[#fields + 1] = ARGV[2] .. '\n' .. data
  out[#out + 1] = id
  out[#out + 1] = data
end
for first = 1, #fields, 1000 do
  redis.call('HSET', KEYS[2], unpack(fields, first, math.min(first + 999, #fields)))
end
redis.call('INCRBY', KEYS[5], count)
redis.call('RPOP', KEYS[1], count)  -- recorded: now they may leave the queue
local t = redis.call('TIME')
redis.call('ZADD', KEYS[7], 'XX', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[5]),
  ARGV[3])
if ARGV[4] == '1' and count == want and redis.call('LLEN', KEYS[6]) == 0 then
  redis.call('LPUSH', KEYS[6], '1')
end
return out
