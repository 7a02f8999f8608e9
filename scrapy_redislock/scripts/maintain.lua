-- maintain: one renewal tick of one process for one lock.
-- Renews the caller's grants, frees expired leases of anybody (reaper),
-- forgets consumers that left, trims acknowledged entries.
-- KEYS[1] slots stream, KEYS[2] meta hash, KEYS[3] owners hash, KEYS[4] holds hash
-- ARGV[1] consumer (owner) name, ARGV[2] owner identity (JSON)
-- ARGV[3] '1' to also free grants of the caller that are not listed
--         (delivered to a wait that was cancelled before it saw them)
-- ARGV[4..] grant ids the caller believes it holds
-- Returns {lost ids, limit, ttl_ms, freed count, adopted}; lost ids are the listed
-- grants that are no longer held (lease expired, reset, or data loss).
-- Returns error 'NOLOCK' when the lock is gone from Redis (nothing written).
local slots, meta, owners, holds = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local me = ARGV[1]
if redis.call('EXISTS', slots) == 0 then
  return redis.error_reply('NOLOCK lock is gone from Redis')
end
local ttl = tonumber(redis.call('HGET', meta, 'ttl') or '30000')
local limit = tonumber(redis.call('HGET', meta, 'limit') or '0')

local wanted = {}
for i = 4, #ARGV do wanted[ARGV[i]] = true end

local renew, lost, freed = {}, {}, 0
for _, p in ipairs(redis.call('XPENDING', slots, GROUP, '-', '+', 100000, me)) do
  local id, idle = p[1], tonumber(p[3])
  if wanted[id] and idle < ttl then
    table.insert(renew, id)
    wanted[id] = nil
  elseif wanted[id] or ARGV[3] == '1' then
    freed = freed + free_grant(slots, holds, id)
  end
end
for id in pairs(wanted) do table.insert(lost, id) end

-- After a data loss, holders that survived re-adopt the reserved slots.
local adopted = {}
if #lost > 0 then
  local limbo = redis.call('XPENDING', slots, GROUP, '-', '+', #lost, '__limbo__')
  for i, p in ipairs(limbo) do
    table.insert(renew, p[1])
    table.insert(adopted, {lost[i], p[1]})
    lost[i] = false
  end
  local still = {}
  for _, id in ipairs(lost) do if id then table.insert(still, id) end end
  lost = still
end
if #renew > 0 then
  table.insert(renew, 'JUSTID')
  redis.call('XCLAIM', slots, GROUP, me, 0, unpack(renew))
end

-- Reap leases that expired (their holders died or stalled).
local claimed = redis.call('XAUTOCLAIM', slots, GROUP, '__reaper__', ttl, '0-0', 'COUNT', 100, 'JUSTID')
for _, id in ipairs(claimed[2]) do
  freed = freed + free_grant(slots, holds, id)
end
redis.call('XGROUP', 'DELCONSUMER', slots, GROUP, '__reaper__')

-- Forget consumers with nothing held that have not been seen for 3 ttl.
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', slots, GROUP)) do
  local name = info_field(c, 'name')
  if name ~= me and tonumber(info_field(c, 'pending')) == 0
      and tonumber(info_field(c, 'idle')) > 3 * ttl then
    redis.call('XGROUP', 'DELCONSUMER', slots, GROUP, name)
    redis.call('HDEL', owners, name)
  end
end
redis.call('HSET', owners, me, ARGV[2])

-- Drop acknowledged entries below the oldest live one.
local summary = redis.call('XPENDING', slots, GROUP)
local _, group_last = stream_state(slots)
local oldest = '0-' .. (group_last + 1)
if summary[2] and seq_of(summary[2]) < group_last + 1 then oldest = summary[2] end
redis.call('XTRIM', slots, 'MINID', '~', oldest)

local flat = {}
for _, pair in ipairs(adopted) do table.insert(flat, pair[1]); table.insert(flat, pair[2]) end
return {lost, limit, ttl, freed, flat}
