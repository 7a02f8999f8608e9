-- reset: free every slot of a lock and forget every holder (an operator's reset); limit and ttl stay.
-- Held grants are acknowledged (their holders find them lost at their next renewal, and a release of
-- them returns 'not held'), free slots and debt are dropped, and `limit` new free slots are added: the
-- lock is as new, but its entry ids, the fencing tokens, go on increasing. Consumers blocked in
-- XREADGROUP stay blocked and are served the new slots first come, first served.
-- KEYS[1] slots stream, KEYS[2] meta hash, KEYS[3] owners hash, KEYS[4] ttls hash, KEYS[5] seen zset,
-- KEYS[6] light zset of a lock met at run time (its light grants are dropped, its record's marks stay: a limit and a
-- site's pause still hold; without a stream that is the whole reset, and the limit is the record's, else -1)
-- ARGV[1] none (takes no arguments). A restart of Redis not noticed yet is noticed first, so the new slots' fences start above every
-- fence the old stream could have handed out.
-- Returns {grants freed, limit} (limit -2: the one in Redis is no valid limit, and no slot was added), or error 'NOLOCK ...' when the lock does not exist (nothing written).
local slots, meta, owners, ttls, seen, light = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local light_freed = 0
if light then
  local pause = redis.call('ZSCORE', light, PAUSE_MEMBER)
  light_freed = redis.call('ZREMRANGEBYSCORE', light, LEASE_FLOOR, '+inf')
  if pause then
    redis.call('ZADD', light, pause, PAUSE_MEMBER)
    light_freed = light_freed - 1
  end
  keep_record(light, now_ms())
  if not lock_exists(slots, meta) then
    return {light_freed, tonumber(redis.call('ZSCORE', light, LIMIT_MEMBER) or '-1')}
  end
end
if not lock_exists(slots, meta) then
  return redis.error_reply('NOLOCK lock does not exist')
end
check_restart(slots, meta, '0')
local limit = valid_limit(redis.call('HGET', meta, 'limit'))  -- nil: not a limit (written by hand?): no fresh slots
local freed = 0
while true do
  local batch = redis.call('XPENDING', slots, GROUP, '-', '+', 1000)
  if #batch == 0 then break end
  local ids = {}
  for _, p in ipairs(batch) do ids[#ids + 1] = p[1] end
  freed = freed + redis.call('XACK', slots, GROUP, unpack(ids))  -- one XACK a batch
end
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', slots, GROUP)) do
  redis.call('XGROUP', 'DELCONSUMER', slots, GROUP, info_field(c, 'name'))
end
redis.call('DEL', owners, ttls, seen)
redis.call('HDEL', meta, 'skip_until')
-- No free slot, no debt: the group has been delivered everything generated so far.
local stream_last = stream_state(slots)
redis.call('XGROUP', 'SETID', slots, GROUP, id_of(stream_last))
redis.call('XTRIM', slots, 'MINID', id_of(stream_last + 1))
for _ = 1, limit or 0 do add_slot(slots) end
return {freed + light_freed, limit or -2}
