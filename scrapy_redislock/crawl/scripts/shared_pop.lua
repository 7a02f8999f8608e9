-- shared_pop: one request from a sub-queue of a shared scrapy-redis queue, popped as scrapy-redis pops it, and kept
-- aside under the popping process's number for that pop, so that the same call again (its reply lost to a silent
-- network, or sent again by redis-py's own retry) answers the same request instead of popping the next and losing
-- this one. A process numbers its pops of a sub-queue and moves to the next number only once a reply brought it a
-- request; each pop's record replaces the one before, and goes at the process's close or expires (ARGV[3]).
-- KEYS[1] the sub-queue, scrapy-redis's own key: a sorted set (PriorityQueue) or a list (FifoQueue, LifoQueue)
-- KEYS[2] the process's last pop of it (a hash: seq, request):
--         '<prefix>:shared:{<the sub-queue's hash tag>}:popped:<process>:<the sub-queue's key>'
-- ARGV[1] how scrapy-redis pops: 'priority' (the lowest score: ZRANGE 0 0, ZREMRANGEBYRANK 0 0), 'fifo' (RPOP),
--         'lifo' (LPOP); or 'forget': the record goes (the process closes)
-- ARGV[2] the pop's number (a decimal string)
-- ARGV[3] milliseconds the record is kept
-- Returns the request as scrapy-redis stored it, or false when the sub-queue is empty (or on 'forget').
if ARGV[1] == 'forget' then
  redis.call('DEL', KEYS[2])
  return false
end
local last = redis.call('HMGET', KEYS[2], 'seq', 'request')
if last[1] == ARGV[2] and last[2] then
  return last[2]
end
local data
if ARGV[1] == 'priority' then
  data = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if data then
    redis.call('ZREMRANGEBYRANK', KEYS[1], 0, 0)
  end
elseif ARGV[1] == 'fifo' then
  data = redis.call('RPOP', KEYS[1])
else
  data = redis.call('LPOP', KEYS[1])
end
if not data then
  return false
end
redis.call('HSET', KEYS[2], 'seq', ARGV[2], 'request', data)
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return data
