-- release: give back one grant held by the caller.
-- KEYS[1] slots stream, KEYS[2] holds hash (reentrant hold counts), KEYS[3] meta hash
-- ARGV[1] owner name, ARGV[2] grant id, ARGV[3] '1' if reentrant
-- Returns 1 released, 2 one reentrant hold dropped (still held),
-- 0 not held by the caller (expired, reaped, or someone else's),
-- 3 not held because Redis restarted and forgot it (its id is below meta 'base') while slots are reserved for the
--   survivors: the caller may re-adopt one by a renewal, and give it back (nothing is written here).
local slots, holds, meta = KEYS[1], KEYS[2], KEYS[3]
-- pcall: a lock that is gone from Redis (reset, data loss) means 'not held', not an error.
local mine = redis.pcall('XPENDING', slots, GROUP, ARGV[2], ARGV[2], 1)
if mine.err then return 0 end
if #mine == 0 then
  if seq_of(ARGV[2]) < tonumber(redis.call('HGET', meta, 'base') or '0')
      and #redis.call('XPENDING', slots, GROUP, '-', '+', 1, LIMBO) > 0 then
    return 3
  end
  return 0
end
if owner_of(mine[1][2]) ~= ARGV[1] then return 0 end
if ARGV[3] == '1' and redis.call('HINCRBY', holds, ARGV[2], -1) >= 0 then
  return 2
end
-- Only reentrant locks keep hold counts.
return free_grant(slots, ARGV[3] == '1' and holds or nil, ARGV[2])
