-- feed_take: up to N entries of a RedisSpider's start-URL feed, popped as scrapy-redis pops them, and kept aside
-- under the worker's number for that take, so that the same call again (its reply lost to a silent network, or sent
-- again by redis-py's own retry) answers the same entries instead of popping the next ones and losing these. A
-- worker numbers its takes and moves to the next number only once a reply brought it entries; a take with another
-- number drops the record before it (those entries are requests in the worker by then). 'give_back', at the
-- worker's close, puts the entries of a take whose reply never came back at the head of the feed and drops the
-- record; the record expires otherwise (ARGV[5]: a worker that dies).
-- KEYS[1] the feed: the spider's redis_key, a list (LPOP), a set (SPOP) or a sorted set (ZPOPMAX)
-- KEYS[2] the worker's last take (a list: the take's number, then its entries; of a sorted set, member and score
--         in turns): '<prefix>:feed:{<the feed's hash tag>}:taken:<worker>:<the feed's key>'
-- ARGV[1] 'take' or 'give_back'
-- ARGV[2] the feed's type: 'list', 'set' or 'zset'
-- ARGV[3] the take's number (a decimal string): of this take, or for 'give_back' of the next take
-- ARGV[4] take: the most entries to pop; give_back: unused
-- ARGV[5] take: milliseconds the record is kept; give_back: unused
-- Returns take: the entries (of a sorted set: member, score, member, score, ...), none when the feed is empty;
-- give_back: how many entries went back to the feed.
local last = redis.call('LINDEX', KEYS[2], 0)
if ARGV[1] == 'give_back' then
  local entries = {}
  if last == ARGV[3] then
    entries = redis.call('LRANGE', KEYS[2], 1, -1)
  end
  redis.call('DEL', KEYS[2])
  if ARGV[2] == 'zset' then
    for i = 1, #entries, 2 do
      redis.call('ZADD', KEYS[1], entries[i + 1], entries[i])
    end
    return #entries / 2
  end
  for i = #entries, 1, -1 do
    if ARGV[2] == 'set' then
      redis.call('SADD', KEYS[1], entries[i])
    else
      redis.call('LPUSH', KEYS[1], entries[i])
    end
  end
  return #entries
end
if last == ARGV[3] then
  return redis.call('LRANGE', KEYS[2], 1, -1)
end
if last then
  redis.call('DEL', KEYS[2])
end
local count = tonumber(ARGV[4])
local entries
if ARGV[2] == 'set' then
  entries = redis.call('SPOP', KEYS[1], count)
elseif ARGV[2] == 'zset' then
  entries = redis.call('ZPOPMAX', KEYS[1], count)
else
  entries = redis.call('LPOP', KEYS[1], count)
end
if not entries or #entries == 0 then
  return {}
end
redis.call('RPUSH', KEYS[2], ARGV[3])
for i = 1, #entries, 1000 do -- in pieces: unpack's limit is Lua's stack
  redis.call('RPUSH', KEYS[2], unpack(entries, i, math.min(i + 999, #entries)))
end
redis.call('PEXPIRE', KEYS[2], ARGV[5])
return entries
