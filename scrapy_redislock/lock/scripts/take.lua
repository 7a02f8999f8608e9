-- take: a slot if one is free now (a non-blocking acquire); frees expired
-- leases first when none is free and a reap is due, so a dead holder's slot
-- comes back to whoever asks, not only to processes that renew.
-- KEYS[1] slots stream, KEYS[2] meta hash
-- ARGV[1] consumer to deliver to ('<owner>#<n>'), ARGV[2] the caller's renewal interval in ms,
-- ARGV[3] '1' if Redis loses no acknowledged write (see check_restart)
-- Returns the granted entry id, or false when every slot is held. The grant is marked confirmed (its delivery count
-- set to 2): the caller hears of it in this reply, so the confirm window for blocked waits (reclaim_unconfirmed) does
-- not apply to it. Before a reap, grants handed to blocked waits and not confirmed in time are freed.
-- Returns error 'NOLOCK' when the lock is gone from Redis (nothing written).
local slots, meta = KEYS[1], KEYS[2]
if redis.call('EXISTS', slots) == 0 then
  return redis.error_reply('NOLOCK lock is gone from Redis')
end
check_restart(slots, meta, ARGV[3])
local function read()
  local reply = redis.call('XREADGROUP', 'GROUP', GROUP, ARGV[1], 'COUNT', 1, 'STREAMS', slots, '>')
  if reply and reply[1] and #reply[1][2] > 0 then
    local id = reply[1][2][1][1]
    redis.call('XCLAIM', slots, GROUP, ARGV[1], 0, id, 'RETRYCOUNT', 2, 'JUSTID')
    return id
  end
  return false
end
local id = read()
if id then return id end
local lease = lease_of(meta)
if reclaim_unconfirmed(slots, lease) + reap(slots, meta, lease, tonumber(ARGV[2]), now_ms()) > 0 then
  return read()
end
return false
