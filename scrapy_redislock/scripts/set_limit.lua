-- set_limit: change the number of slots of a lock, live; creates the lock if
-- it does not exist. Lowering never revokes a grant: surplus free slots are
-- skipped, and the slots of the next releases are not handed out again.
-- KEYS[1] slots stream, KEYS[2] meta hash
-- ARGV[1] new limit (integer >= 0), ARGV[2] ttl in ms to create with
-- Returns the previous limit (-1 if the lock did not exist).
local slots, meta = KEYS[1], KEYS[2]
local new = tonumber(ARGV[1])
if not lock_exists(slots, meta) then
  create_lock(slots, meta, new, ARGV[2])
  return -1
end
local previous = tonumber(redis.call('HGET', meta, 'limit'))
local stream_last, group_last, held = stream_state(slots)
local free = math.max(0, stream_last - group_last)
local debt = math.max(0, group_last - stream_last)
local delta = new - (held + free - debt)
if delta < 0 then
  redis.call('XGROUP', 'SETID', slots, GROUP, '0-' .. (group_last - delta))
elseif delta > 0 then
  local cancel = math.min(debt, delta)
  if cancel > 0 then
    redis.call('XGROUP', 'SETID', slots, GROUP, '0-' .. (group_last - cancel))
  end
  for _ = 1, delta - cancel do add_slot(slots) end
end
redis.call('HSET', meta, 'limit', new)
return previous
