-- setup: create the lock if it does not exist, register the caller.
-- KEYS[1] slots stream, KEYS[2] meta hash, KEYS[3] owners hash, KEYS[4] ttls hash, KEYS[5] seen zset,
-- KEYS[6] light zset and KEYS[7] migrated hash for a lock with a light path (see _lib.lua): its limit is the light
-- path's when it has one, and its live light grants move into the stream (escalate)
-- ARGV[1] limit to create with ('' = the lock must exist already)
-- ARGV[2] the caller's lease ttl in ms
-- ARGV[3] owner name, ARGV[4] owner identity (JSON)
-- ARGV[5] '1' to create in recovery mode: every slot starts held by the
--         consumer '__limbo__' for one lease, so holders that survived a Redis
--         data loss can re-adopt them before anybody new is granted one.
-- ARGV[6] '1' if Redis loses no acknowledged write (see check_restart)
-- ARGV[7] '1' when the caller holds no grant: it reports as a survivor now (see survivor_reported); one that holds
--         some reports at its first renewal of all of them (maintain), once it has re-adopted them
-- ARGV[8] '1' when ARGV[5] is '1' and the caller names the owners alive at its last renewal (ARGV[9..], itself
--         among them): the reservation then ends once each has reported (see await_survivors); else its lease
-- Returns {created (0/1), limit, lease ttl in force (ms)}, or an error reply
-- 'NOLOCK ...' when the lock does not exist and no limit was given (nothing is written).
local slots, meta, owners, ttls, seen = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local created = 0
check_restart(slots, meta, ARGV[6])
if not lock_exists(slots, meta) then
  if ARGV[1] == '' then
    return redis.error_reply('NOLOCK lock has no limit in Redis yet')
  end
  local limit = tonumber(ARGV[1])
  if KEYS[6] then limit = tonumber(redis.call('ZSCORE', KEYS[6], LIMIT_MEMBER)) or limit end
  create_lock(slots, meta, limit, ARGV[2])
  -- Live light grants move in before the reservation: a newcomer's grant after a data loss is a held slot, and
  -- the survivors re-adopt only what is left of the limit (or learn they lost theirs).
  if KEYS[6] then escalate(KEYS[6], KEYS[7], slots, meta) end
  if ARGV[5] == '1' then
    reserve_all(slots, meta)
    if ARGV[8] == '1' then await_survivors(meta, ARGV, 9, now_ms()) end
  end
  created = 1
end
if KEYS[6] then escalate(KEYS[6], KEYS[7], slots, meta) end
local lease = register(meta, owners, ttls, seen, ARGV[3], ARGV[4], ARGV[2], now_ms())
if ARGV[7] == '1' then survivor_reported(meta, ARGV[3]) end
return {created, tonumber(redis.call('HGET', meta, 'limit')), lease}
