-- queue_pop: take up to N requests from a stage's queue into the worker's in-flight record.
-- Only a registered worker may pop: one the others took for dead (its in-flight requests already requeued) must
-- beat first, which tells it so and makes it drop what it had taken ahead. Otherwise its pop would land in an
-- in-flight record that nobody reaps while it goes on beating, and it would drop those requests with the rest.
-- A pop is also a sign of life: it refreshes the worker's beat (a busy worker on a starved CPU is not taken for
-- dead between two heartbeats). The spider's in-flight counter counts what every worker holds (the crawl has
-- ended when it is 0 and the queues are empty). With ARGV[4] = '1' (a worker that has
-- just been woken for this stage) and a full pop, the stage's signal gets a token for the next idle worker.
-- KEYS[1] the stage's queue, KEYS[2] the worker's in-flight hash, KEYS[3] id counter, KEYS[4] alive zset,
-- KEYS[5] in-flight counter, KEYS[6] the stage's signal list
-- ARGV[1] N, ARGV[2] stage name, ARGV[3] worker id, ARGV[4] '1' = pass the signal on if the queue may hold more
-- Returns nil if the worker is not registered (nothing popped), else a flat list id1, data1, id2, data2, ... ;
-- each in-flight value is "<stage>\n<data>". Fewer than N: the queue is empty now.
if not redis.call('ZSCORE', KEYS[4], ARGV[3]) then return false end
local want = tonumber(ARGV[1])
local popped = redis.call('RPOP', KEYS[1], want)
if not popped then return {} end
local last = redis.call('INCRBY', KEYS[3], #popped)
local out, fields = {}, {}
for i, data in ipairs(popped) do
  local id = tostring(last - #popped + i)
  fields[#fields + 1] = id
  fields[#fields + 1] = ARGV[2] .. '\n' .. data
  out[#out + 1] = id
  out[#out + 1] = data
end
redis.call('HSET', KEYS[2], unpack(fields))
redis.call('INCRBY', KEYS[5], #popped)
local t = redis.call('TIME')
redis.call('ZADD', KEYS[4], 'XX', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), ARGV[3])
if ARGV[4] == '1' and #popped == want and redis.call('LLEN', KEYS[6]) == 0 then
  redis.call('LPUSH', KEYS[6], '1')
end
return out
