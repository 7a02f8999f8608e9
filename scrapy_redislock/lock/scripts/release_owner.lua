-- release_owner: free every grant of one owner (all its consumers) and forget it
-- (spider close, or an operator freeing a worker known to be dead); then free the leases that expired
-- (reap, at most once per renewal interval across all processes, as maintain does): a process that closes
-- after a dead one's lease ran out leaves nothing of it in Redis, even when no one renews the lock again.
-- KEYS[1] slots stream, KEYS[2] meta hash, KEYS[3] owners hash, KEYS[4] ttls hash, KEYS[5] seen zset,
-- KEYS[6] light zset of a lock met at run time (its light grants of the
-- owner are dropped too)
-- ARGV[1] owner name (or one of its consumers '<owner>#<n>': then that consumer only)
-- Returns the number of grants freed.
local slots, owners, ttls, seen, light = KEYS[1], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local meta = KEYS[2]
local freed = 0
if light then
  for _, token in ipairs(redis.call('ZRANGEBYSCORE', light, LEASE_FLOOR, '+inf')) do
    if token ~= PAUSE_MEMBER and token_owner(token) == ARGV[1] then freed = freed + redis.call('ZREM', light, token) end
  end
end
if redis.call('EXISTS', slots) == 0 then return freed end
freed = freed + release_owner(slots, owners, ttls, seen, ARGV[1])
survivor_reported(meta, ARGV[1])  -- it holds nothing now: not awaited after a data loss
if redis.call('EXISTS', meta) == 1 then
  local lease = lease_of(meta)
  reap(slots, meta, lease, renewal_interval(lease), now_ms())
end
return freed
