-- Shared helpers of the worker front's scripts, prepended to each (scrapy_redislock.workers.queue.worker_scripts).

-- ids for `count` new in-flight entries from the id counter `key`: the last one. A counter made just now (a new
-- crawl state) starts at Redis's clock in units of 100 µs, so that no id is one of a state Redis lost, which an ack
-- of that state still on its way would drop, as long as that state gave out fewer than 10,000 ids a second. 14
-- digits: exact in Lua's numbers, and printed whole by an earlier version's tostring (%.14g) while a crawl's
-- workers are upgraded one by one. Print ids with string.format('%d', id).
local function new_ids(key, count)
  local last = redis.call('INCRBY', key, count)
  if last == count then
    local now = redis.call('TIME')
    last = tonumber(now[1] .. string.format('%04d', math.floor(now[2] / 100))) + count
    redis.call('SET', key, string.format('%d', last))
  end
  return last
end
