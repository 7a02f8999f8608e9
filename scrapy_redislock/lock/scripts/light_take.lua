-- light_take: a slot of a lock met at run time while nobody waits for it, without a stream (the light path:
-- see _lib.lua and lock/light.py). A lock nobody holds is an empty zset (no key at all): the caller's grant is
-- its first member. Otherwise the limit is the record's LIMIT_MEMBER when an operator or the adaptive controller
-- set one, else the caller's; a lock whose stream is in use, or whose slots are all held (after expired leases are
-- dropped), is left as it was.
-- KEYS[1] light zset
-- ARGV[1] the caller's limit, ARGV[2] the holder's token ('<owner>/L<n>'), ARGV[3] lease ms
-- Returns {1, lease end (ms since the epoch, Redis's clock)} when granted, {0, 'stream'} when the lock's stream
-- is in use (queue there), {0, 'full'} when every slot is held, {0, 'paused', until (ms), now (ms)} while its
-- starts are paused (pause.lua).
-- Costs 5 commands when nobody holds the lock (EVALSHA, TIME, ZCARD, ZADD, PEXPIREAT), 6 when others do.
local light, token = KEYS[1], ARGV[2]
local now = now_ms()
local deadline = now + tonumber(ARGV[3])
local function grant(first)
  redis.call('ZADD', light, deadline, token)
  if first then
    redis.call('PEXPIREAT', light, deadline)
  else
    extend_expiry(light, deadline)
  end
  return {1, deadline}
end
local count = redis.call('ZCARD', light)
if count == 0 then return grant(true) end
local marks = redis.call('ZMSCORE', light, LIMIT_MEMBER, STREAM_MEMBER, PAUSE_MEMBER, PIN_MEMBER)
local pause = tonumber(marks[3])
if pause then
  if pause > now then return {0, 'paused', string.format('%.0f', pause), now} end
  redis.call('ZREM', light, PAUSE_MEMBER)  -- over: dropped, so that it is not counted as a grant
  count = count - 1
  if count == 0 then return grant(true) end
end
if marks[2] then return {0, 'stream'} end
local limit = tonumber(marks[1]) or tonumber(ARGV[1])
local others = (marks[1] and 1 or 0) + (marks[4] and 1 or 0)  -- the record's marks are not grants
if count - others >= limit then
  redis.call('ZREMRANGEBYSCORE', light, LEASE_FLOOR, now)
  count = redis.call('ZCARD', light)
  if count == 0 then return grant(true) end  -- every lease had run out: the zset is gone
  if count - others >= limit then return {0, 'full'} end
end
return grant(false)
