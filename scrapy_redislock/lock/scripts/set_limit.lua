-- set_limit: change the number of slots of a lock, live; creates the lock if
-- it does not exist. Lowering never revokes a grant: surplus free slots are
-- skipped (and deleted), and the slots of the next releases are not handed out
-- again (meta 'skip_until' marks them for deletion as they come).
-- KEYS[1] slots stream, KEYS[2] meta hash
-- ARGV[1] new limit (integer >= 0), ARGV[2] ttl in ms to create with,
-- ARGV[3] '1' to create a missing lock in recovery mode (every slot reserved for one lease: see setup.lua),
-- ARGV[4] '1' if Redis loses no acknowledged write (see check_restart)
-- Returns the previous limit (-1 if the lock did not exist).
local slots, meta = KEYS[1], KEYS[2]
local new = tonumber(ARGV[1])
check_restart(slots, meta, ARGV[4])
if not lock_exists(slots, meta) then
  create_lock(slots, meta, new, ARGV[2])
  if ARGV[3] == '1' then reserve_all(slots, meta) end
  return -1
end
local previous = tonumber(redis.call('HGET', meta, 'limit'))
local stream_last, group_last, held = stream_state(slots)
-- Entries at or below the last delivered id that nobody holds can never be handed out: a lowered limit
-- skipped them. Delete them now, before a raise moves the group's position and forgets which they were.
for _, entry in ipairs(redis.call('XRANGE', slots, '-', id_of(group_last))) do
  if not pending_of(slots, entry[1]) then redis.call('XDEL', slots, entry[1]) end
end
local free = math.max(0, stream_last - group_last)
local debt = math.max(0, group_last - stream_last)
local delta = new - (held + free - debt)
local target = group_last
if delta < 0 then
  target = group_last - delta
  local skipped = redis.call('XRANGE', slots, id_of(group_last + 1), id_of(math.min(target, stream_last)))
  for _, entry in ipairs(skipped) do redis.call('XDEL', slots, entry[1]) end
elseif delta > 0 then
  local cancel = math.min(debt, delta)
  target = group_last - cancel
  for _ = 1, delta - cancel do add_slot(slots) end
end
if target ~= group_last then
  redis.call('XGROUP', 'SETID', slots, GROUP, id_of(target))
end
if target > stream_last then
  redis.call('HSET', meta, 'skip_until', string.format('%.0f', target))
else
  redis.call('HDEL', meta, 'skip_until')
end
redis.call('HSET', meta, 'limit', new)
return previous
