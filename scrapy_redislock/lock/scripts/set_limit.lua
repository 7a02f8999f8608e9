-- set_limit: change the number of slots of a lock, live; creates the lock if
-- it does not exist. Lowering never revokes a grant: surplus free slots are
-- skipped (and deleted), and the slots of the next releases are not handed out
-- again (meta 'skip_until' marks them for deletion as they come).
-- The operator's word is kept in the lock's record, where every path reads it and no transition erases it: a key's
-- limit in its light zset (LIMIT_MEMBER, with PIN_MEMBER: the zset then lasts until the lock is forgotten), a stage's
-- in meta; a pinned lock's adaptive controller (lock/adaptive.py) measures on and applies nothing until
-- adapt_unpin.lua, even after its own hash expired.
-- KEYS[1] slots stream, KEYS[2] meta hash, KEYS[3] the lock's adaptive controller hash,
-- KEYS[4] light zset of a lock met at run time (a key: see _lib.lua): the limit is written there, and into the
--   stream when it is in use; the stream is never created here (its first waiter sets it up)
-- ARGV[1] new limit (integer from 0 to MAX_LIMIT, else error 'BADLIMIT ...'), ARGV[2] ttl in ms to create with,
-- ARGV[3] '1' to create a missing lock in recovery mode (every slot reserved for one lease: see setup.lua),
-- ARGV[4] '1' if Redis loses no acknowledged write (see check_restart),
-- ARGV[5] '1' when an operator sets it (pins it; a key's limit is always pinned); else a stage is pinned only while
--   its adaptive controller lives
-- Returns the previous limit (-1 if the lock did not exist, or had no valid limit in Redis).
local slots, meta, adapt, light = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local new = checked_limit(ARGV[1])  -- 'BADLIMIT ...' for anything but an integer from 0 to MAX_LIMIT
if light then
  local previous = tonumber(redis.call('ZSCORE', light, LIMIT_MEMBER) or '-1')
  redis.call('ZADD', light, new, LIMIT_MEMBER, 1, PIN_MEMBER)
  redis.call('PERSIST', light)
  if lock_exists(slots, meta) then previous = change_limit(slots, meta, new) end
  return previous
end
local pin = ARGV[5] == '1' or (adapt and redis.call('EXISTS', adapt) == 1)
check_restart(slots, meta, ARGV[4])
local previous = -1
if not lock_exists(slots, meta) then
  create_lock(slots, meta, new, ARGV[2])
  if ARGV[3] == '1' then reserve_all(slots, meta) end
else
  previous = change_limit(slots, meta, new)
end
if pin then redis.call('HSET', meta, 'pinned', 1) end
return previous
