-- retire: an owner is done with a lock met at run time (a request key gone idle in its process): free what
-- it still holds, forget it, and delete the lock from Redis when nobody else uses it, so that keys nobody
-- uses cost nothing. "Uses" = holds a grant (any pending entry, a dead holder's too, until it is reaped)
-- or is a registered owner seen within 3 leases (every waiter registers before it blocks and renews its
-- registration every renewal interval, so a blocked waiter's lock is never deleted under it).
-- KEYS[1] slots stream, KEYS[2] meta hash, KEYS[3] owners hash, KEYS[4] holds hash,
-- KEYS[5] ttls hash, KEYS[6] seen zset, KEYS[7] light zset and KEYS[8] migrated hash of a lock with a light path
-- (deleted with the lock: its next taker starts on the light path again)
-- ARGV[1] owner name, ARGV[2] '1' if Redis loses no acknowledged write (see check_restart)
-- Returns {grants freed, 1 if the lock was deleted else 0}.
local slots, meta, owners, holds, ttls, seen = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
if redis.call('EXISTS', slots) == 0 then
  if KEYS[7] and #redis.call('ZRANGEBYSCORE', KEYS[7], '(' .. now_ms(), '+inf', 'LIMIT', 0, 1) > 0 then
    return {0, 0}  -- a light grant is held: the lock is in use on its light path
  end
  redis.call('DEL', meta, owners, holds, ttls, seen)
  if KEYS[7] then end_stream(KEYS[7], KEYS[8]) end
  return {0, 1}
end
if check_restart(slots, meta, ARGV[2]) then
  release_owner(slots, owners, holds, ttls, seen, ARGV[1])
  return {0, 0}  -- restarted: the reserved slots may be somebody's, the lock stays for their re-adoption
end
local freed = release_owner(slots, owners, holds, ttls, seen, ARGV[1])
local lease = lease_of(meta)
local _, _, held = stream_state(slots)
if held > 0 or redis.call('ZCOUNT', seen, now_ms() - 3 * lease, '+inf') > 0 then
  return {freed, 0}
end
redis.call('DEL', slots, meta, owners, holds, ttls, seen)
if KEYS[7] then end_stream(KEYS[7], KEYS[8]) end
return {freed, 1}
