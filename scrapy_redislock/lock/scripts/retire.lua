-- retire: an owner is done with a lock met at run time (a request key gone idle in its process): free what
-- it still holds, forget it, and delete the lock from Redis when nobody else uses it, so that keys nobody
-- uses cost nothing. "Uses" = holds a grant (any pending entry, a dead holder's too, until it is reaped)
-- or is a registered owner seen within 3 leases (every waiter registers before it blocks and renews its
-- registration every renewal interval, so a blocked waiter's lock is never deleted under it).
-- KEYS[1] slots stream, KEYS[2] meta hash, KEYS[3] owners hash, KEYS[4] ttls hash, KEYS[5] seen zset,
-- KEYS[6] light zset and KEYS[7] migrated hash of a lock with a light path (its next taker starts on the light path
-- again; the zset keeps the key's record while it has effect: end_stream in _lib.lua)
-- ARGV[1] owner name, ARGV[2] '1' if Redis loses no acknowledged write (see check_restart)
-- Returns {grants freed, 1 if the lock was deleted else 0}.
local slots, meta, owners, ttls, seen, light = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
if redis.call('EXISTS', slots) == 0 then
  if light then
    local pause = tonumber(redis.call('ZSCORE', light, PAUSE_MEMBER) or '0')
    if redis.call('ZCOUNT', light, '(' .. now_ms(), '+inf') > ((pause > now_ms()) and 1 or 0) then
      return {0, 0}  -- a light grant is held: the lock is in use on its light path
    end
  end
  redis.call('DEL', meta, owners, ttls, seen)
  if light then end_stream(light, KEYS[7]) end
  return {0, 1}
end
if check_restart(slots, meta, ARGV[2]) then
  release_owner(slots, owners, ttls, seen, ARGV[1])
  return {0, 0}  -- restarted: the reserved slots may be somebody's, the lock stays for their re-adoption
end
local freed = release_owner(slots, owners, ttls, seen, ARGV[1])
local lease = lease_of(meta)
local _, _, held = stream_state(slots)
if held > 0 or redis.call('ZCOUNT', seen, now_ms() - 3 * lease, '+inf') > 0 then
  return {freed, 0}
end
redis.call('DEL', slots, meta, owners, ttls, seen)
if light then end_stream(light, KEYS[7]) end
return {freed, 1}
