-- release_owner: free every grant of one owner (all its consumers) and forget it
-- (spider close, or an operator freeing a worker known to be dead).
-- KEYS[1] slots stream, KEYS[2] meta hash, KEYS[3] owners hash, KEYS[4] holds hash,
-- KEYS[5] ttls hash, KEYS[6] seen zset, KEYS[7] light zset of a lock met at run time (its light grants of the
-- owner are dropped too)
-- ARGV[1] owner name (or one of its consumers '<owner>#<n>': then that consumer only)
-- Returns the number of grants freed.
local slots, meta, owners, holds, ttls, seen = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local freed = 0
if KEYS[7] then
  for _, token in ipairs(redis.call('ZRANGEBYSCORE', KEYS[7], LEASE_FLOOR, '+inf')) do
    if token_owner(token) == ARGV[1] then freed = freed + redis.call('ZREM', KEYS[7], token) end
  end
end
if redis.call('EXISTS', slots) == 0 then return freed end
return freed + release_owner(slots, owners, holds, ttls, seen, ARGV[1])
