-- Shared helpers, prepended to every script by scrapy_redislock.core.
--
-- Data model of one lock (all keys share the hash tag of the lock name):
--   slots   stream; one entry per slot grant. An entry not yet delivered to
--           the consumer group is a free slot; a delivered entry in the
--           group's pending list (PEL) is a held slot, its owner is the PEL
--           consumer and its lease age is the PEL idle time (server clock).
--   Entry ids are 0-1, 0-2, ...: the sequence part is the fencing token.
--   Lowering the limit moves the group's last-delivered id past entries that
--   were never delivered, or past entries still to come ("debt"), so that
--   they are never granted.
local GROUP = 'holders'

-- Sequence number of a stream id "0-N".
local function seq_of(id)
  return tonumber(string.match(id, '%-(%d+)$'))
end

-- Value of a field in a flat XINFO reply.
local function info_field(reply, name)
  for i = 1, #reply, 2 do
    if reply[i] == name then return reply[i + 1] end
  end
  return nil
end

-- Add one free slot (hands off to the first blocked waiter, if any).
local function add_slot(slots)
  if redis.REDIS_VERSION_NUM then
    return redis.call('XADD', slots, '0-*', 's', '1')        -- Redis 7+
  end
  local last = info_field(redis.call('XINFO', 'STREAM', slots), 'last-generated-id')
  return redis.call('XADD', slots, '0-' .. (seq_of(last) + 1), 's', '1')  -- Redis 6.2
end

-- Free a held grant: acknowledge it and put a new slot in its place.
local function free_grant(slots, holds, id)
  if redis.call('XACK', slots, GROUP, id) == 1 then
    if holds then redis.call('HDEL', holds, id) end
    add_slot(slots)
    return 1
  end
  return 0
end

-- Sequence numbers: last generated entry and last delivered to the group.
local function stream_state(slots)
  local stream_last = seq_of(info_field(redis.call('XINFO', 'STREAM', slots), 'last-generated-id'))
  local groups = redis.call('XINFO', 'GROUPS', slots)
  local group_last, held = 0, 0
  for _, g in ipairs(groups) do
    if info_field(g, 'name') == GROUP then
      group_last = seq_of(info_field(g, 'last-delivered-id'))
      held = tonumber(info_field(g, 'pending'))
    end
  end
  return stream_last, group_last, held
end

-- Create a lock with `limit` free slots (any old stream under the key is replaced).
local function create_lock(slots, meta, limit, ttl)
  redis.call('DEL', slots)
  redis.call('XGROUP', 'CREATE', slots, GROUP, '$', 'MKSTREAM')
  for _ = 1, limit do add_slot(slots) end
  redis.call('HSET', meta, 'limit', limit, 'ttl', ttl)
end

-- True when the lock's stream and limit are both in Redis.
local function lock_exists(slots, meta)
  return redis.call('EXISTS', slots) == 1 and redis.call('HEXISTS', meta, 'limit') == 1
end
