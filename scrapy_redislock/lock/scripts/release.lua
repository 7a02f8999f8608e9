-- release: give back one grant held by the caller (a reentrant lock counts its holds in the process: this runs for
-- the last one).
-- KEYS[1] slots stream, KEYS[2] meta hash
-- ARGV[1] owner name, ARGV[2] grant id
-- Returns 1 released (a grant Redis forgot in a data loss: the reserved slot a renewal re-adopted it in, when the
-- caller still holds that and has not heard of it yet), 0 not held by the caller (expired, reaped, or someone
-- else's), 3 not held because Redis restarted and forgot it (its id is below meta 'base') while slots are reserved
-- for the survivors: the caller may re-adopt one by a renewal, and give it back (nothing is written here).
local slots, meta = KEYS[1], KEYS[2]
-- pcall: a lock that is gone from Redis (reset, data loss) means 'not held', not an error.
local mine = redis.pcall('XPENDING', slots, GROUP, ARGV[2], ARGV[2], 1)
if mine.err then return 0 end
if #mine == 0 then
  if seq_of(ARGV[2]) < tonumber(redis.call('HGET', meta, 'base') or '0') then
    local slot = adoptions(meta)[ARGV[2]]
    if slot then
      if pending_of(slots, slot) == ARGV[1] then return free_grant(slots, slot) end
      return 0
    end
    if #redis.call('XPENDING', slots, GROUP, '-', '+', 1, LIMBO) > 0 then return 3 end
  end
  return 0
end
if owner_of(mine[1][2]) ~= ARGV[1] then return 0 end
return free_grant(slots, ARGV[2])
