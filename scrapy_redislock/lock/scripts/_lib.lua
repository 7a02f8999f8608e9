-- Shared helpers, prepended to every script by scrapy_redislock.core.
--
-- Data model of one lock (all keys share the hash tag of the lock name):
--   slots   stream; one entry per slot grant. An entry not yet delivered to
--           the consumer group is a free slot; a delivered entry in the
--           group's pending list (PEL) is a held slot, its lease age is the
--           PEL idle time (server clock). Freed entries are deleted at once.
--   Consumers are named '<owner>' (grants it renewed) or '<owner>#<n>' (one
--   name per wait in flight, reused only once it is known to be empty), so a
--   wait that was cancelled can have its grant found and freed exactly.
--   Entry ids are 0-N: N is the fencing token. A lock is created with N
--   starting at Redis's clock in microseconds (meta 'base'), so a lock
--   recreated after a data loss hands out fences above every earlier one,
--   and a grant id below 'base' is known to come from before the loss.
--   Lowering the limit moves the group's last-delivered id past entries that
--   were never delivered, or past entries still to come ("debt"); meta's
--   'skip_until' remembers the last skipped id: the reaper deletes the skipped
--   entries once they exist.
--   meta 'run' names the server run (INFO's run_id) that last wrote the lock.
--   Another run means Redis restarted (from a snapshot, from AOF, or a promoted
--   replica) and its state may be older than what the processes saw: unless the
--   caller declares the deployment durable, the first script to see it recreates
--   the lock in limbo (check_restart).
--   owners  hash owner -> identity JSON (what status shows)
--   ttls    hash owner -> lease ttl in ms; a lease expires after the longest
--           ttl of the registered owners (meta 'ttl', raised at registration,
--           recomputed when owners are forgotten), so mixed ttls never cut a lease short
--   seen    zset owner -> Redis time (ms) of its last setup or maintain
local GROUP = 'holders'
-- The most slots a lock may have: scrapy_redislock._redis.MAX_LIMIT (tests/lock/test_max_limit.py checks they agree).
-- A lock costs Redis one stream entry per slot, and a resize one command per slot added or removed.
local MAX_LIMIT = 1000
local LIMBO = '__limbo__'
local REAPER = '__reaper__'

-- Sequence number of a stream id "0-N".
local function seq_of(id)
  return tonumber(string.match(id, '%-(%d+)$'))
end

-- The id "0-N" (plain digits: Lua would print a large N in exponent form).
local function id_of(seq)
  return string.format('0-%.0f', seq)
end

-- The owner of a consumer name ('<owner>#<n>' -> '<owner>').
local function owner_of(consumer)
  return string.match(consumer, '^(.+)#%d+$') or consumer
end

-- Which dataset this server serves: INFO's run_id (new at every start, another on a promoted replica) and, on Redis
-- 7+, the key counts of the run's last load, which a DEBUG RELOAD changes within one run (it replaces the dataset
-- with the last snapshot). Not told apart: a DEBUG RELOAD that loads exactly as many keys, loaded and expired, as
-- the run's previous load, and any reload on Redis 6.2 (INFO takes one section there).
local function run_id()
  if not redis.REDIS_VERSION_NUM then return string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') end
  local info = redis.call('INFO', 'server', 'persistence')
  return string.match(info, 'run_id:(%x+)') .. '/' .. (string.match(info, 'rdb_last_load_keys_loaded:(%d+)') or '')
    .. '/' .. (string.match(info, 'rdb_last_load_keys_expired:(%d+)') or '')
end

-- Redis's clock in milliseconds.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Value of a field in a flat XINFO reply.
local function info_field(reply, name)
  for i = 1, #reply, 2 do
    if reply[i] == name then return reply[i + 1] end
  end
  return nil
end

-- A limit as a number: an integer from 0 to MAX_LIMIT; else nil.
local function valid_limit(value)
  local n = tonumber(value)
  if not n or n ~= math.floor(n) or n < 0 or n > MAX_LIMIT then return nil end
  return n
end

-- A limit as a number, else a script error 'BADLIMIT ...' naming the bad value (raised before anything is written).
local function checked_limit(value)
  local n = valid_limit(value)
  if not n then
    local message = 'BADLIMIT limit must be an integer from 0 to ' .. MAX_LIMIT .. ', got ' ..
      string.sub(tostring(value), 1, 40)
    if not redis.REDIS_VERSION_NUM then error(message) end  -- Redis 6.2 raises strings only
    error({err = message})
  end
  return n
end

-- Add one free slot (hands off to the first blocked waiter, if any); returns its id.
local function add_slot(slots)
  if redis.REDIS_VERSION_NUM then
    return redis.call('XADD', slots, '0-*', 's', '1')        -- Redis 7+
  end
  local last = info_field(redis.call('XINFO', 'STREAM', slots), 'last-generated-id')
  return redis.call('XADD', slots, id_of(seq_of(last) + 1), 's', '1')  -- Redis 6.2
end

-- Free a held grant: acknowledge it, delete its entry, put a new slot in its place.
local function free_grant(slots, id)
  if redis.call('XACK', slots, GROUP, id) == 1 then
    redis.call('XDEL', slots, id)
    add_slot(slots)
    return 1
  end
  return 0
end

-- Free every grant of one consumer; returns how many.
local function free_consumer(slots, consumer)
  local freed = 0
  while true do
    local batch = redis.call('XPENDING', slots, GROUP, '-', '+', 1000, consumer)
    if #batch == 0 then return freed end
    for _, p in ipairs(batch) do freed = freed + free_grant(slots, p[1]) end
  end
end

-- The pending entry of one grant: {consumer, idle ms}, or nil when it is not held.
local function pending_of(slots, id)
  local p = redis.call('XPENDING', slots, GROUP, id, id, 1)
  if #p == 0 then return nil end
  return p[1][2], tonumber(p[1][3])
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
-- Ids start at Redis's clock in microseconds, and above any id the old stream generated: fences never
-- repeat and never go back, even after a data loss or a restart from an older snapshot.
local function create_lock(slots, meta, limit, ttl)
  limit = checked_limit(limit)
  local floor = 0
  if redis.call('EXISTS', slots) == 1 then
    floor = seq_of(info_field(redis.call('XINFO', 'STREAM', slots), 'last-generated-id')) + 1
  end
  redis.call('DEL', slots)
  local t = redis.call('TIME')
  local base = math.max(tonumber(t[1]) * 1000000 + tonumber(t[2]), floor)
  redis.call('XADD', slots, id_of(base), 's', '0')
  redis.call('XDEL', slots, id_of(base))
  redis.call('XGROUP', 'CREATE', slots, GROUP, id_of(base))
  for _ = 1, limit do add_slot(slots) end
  redis.call('HSET', meta, 'limit', limit, 'ttl', ttl, 'base', string.format('%.0f', base), 'run', run_id())
  redis.call('HDEL', meta, 'skip_until', 'reap_at', 'gc_at', 'awaiting', 'recover_floor', 'adopted')
end

-- The reserved slots that grants forgotten in a data loss were re-adopted in (maintain), from meta 'adopted'
-- ('<grant> <slot> ...', at most one pair per slot of the lock, gone when it is recreated): grant -> slot. A second
-- renewal that lists such a grant renews its slot instead of adopting another, and its release frees that slot.
local function adoptions(meta)
  local slot_of = {}
  for grant, slot in string.gmatch(redis.call('HGET', meta, 'adopted') or '', '(%S+) (%S+)') do
    slot_of[grant] = slot
  end
  return slot_of
end

-- Note new adoptions ({grant, slot, grant, slot ...}) in meta 'adopted'.
local function note_adoptions(meta, pairs)
  if #pairs == 0 then return end
  local before = redis.call('HGET', meta, 'adopted')
  local added = table.concat(pairs, ' ')
  redis.call('HSET', meta, 'adopted', before and (before .. ' ' .. added) or added)
end

-- True when the lock's stream and limit are both in Redis.
local function lock_exists(slots, meta)
  return redis.call('EXISTS', slots) == 1 and redis.call('HEXISTS', meta, 'limit') == 1
end

-- Reserve every slot of a lock for one lease: the consumer '__limbo__' holds them, so holders that survived a
-- data loss re-adopt theirs (maintain) before anybody new is granted one; the reaper frees the rest.
local function reserve_all(slots, meta)
  local limit = tonumber(redis.call('HGET', meta, 'limit'))
  if limit > 0 then
    redis.call('XREADGROUP', 'GROUP', GROUP, LIMBO, 'COUNT', limit, 'STREAMS', slots, '>')
  end
end

-- Notice a restart of Redis before anything else happens to the lock: returns true when this server run has not
-- written the lock yet and the lock was recreated in limbo. Redis may have come back from a snapshot, from AOF
-- after a crash, or as a replica that lagged: grants made since are forgotten, and their slots look free. So the
-- lock is made anew (fences above any the old stream generated) with every slot reserved for one lease.
-- With durable = '1' the caller vouches that Redis loses no acknowledged write (AOF with appendfsync always,
-- no failover to a replica that lags): the state is kept and only the run is noted.
local function check_restart(slots, meta, durable)
  local run = run_id()
  local known = redis.call('HGET', meta, 'run')
  if known == run or not lock_exists(slots, meta) then return false end
  redis.call('HSET', meta, 'run', run)
  if durable == '1' or not known then return false end  -- no run noted: written before runs were noted
  create_lock(slots, meta, tonumber(redis.call('HGET', meta, 'limit')), redis.call('HGET', meta, 'ttl'))
  reserve_all(slots, meta)
  return true
end

-- Register (or refresh) an owner: identity, ttl, last seen; returns the lease ttl in force (ms):
-- the longest ttl of the registered owners.
local function register(meta, owners, ttls, seen, owner, identity, ttl, now)
  redis.call('HSET', owners, owner, identity)
  redis.call('HSET', ttls, owner, ttl)
  redis.call('ZADD', seen, now, owner)
  local lease = tonumber(redis.call('HGET', meta, 'ttl') or '0')
  if tonumber(ttl) > lease then
    lease = tonumber(ttl)
    redis.call('HSET', meta, 'ttl', lease)
  end
  return lease
end

-- The lease in force (ms): meta 'ttl', the longest ttl of the registered owners (O(1): register raises it).
local function lease_of(meta)
  return tonumber(redis.call('HGET', meta, 'ttl') or '30000')
end

-- One renewal interval of a lease (ms): a third of it, at most 1 s, as a holder renews (core.py renew_interval),
-- rounded up; never shorter than any owner's own interval, since the lease is the longest ttl.
local function renewal_interval(lease)
  return math.max(1, math.ceil(math.min(lease, 3000) / 3))
end

-- The most owners a renewal names back (maintain's roster); with more, a recovery waits out its lease.
local ROSTER_MAX = 32

-- The owners seen within the lease (which alone can hold a live grant), for the caller to name the survivors
-- should Redis lose the lock (setup in recovery mode); ROSTER_MAX + 1 names at most (too many to name).
local function roster(seen, lease, now)
  return redis.call('ZRANGEBYSCORE', seen, now - lease, '+inf', 'LIMIT', 0, ROSTER_MAX + 1)
end

-- A lock recreated in limbo by a survivor that named the owners alive at its last renewal (ARGV[first..]):
-- the reservation ends early once each of them has reported (setup holding nothing, a renewal of all it holds, or
-- release_owner: after re-adopting what it held) and two renewal intervals (the longest a live holder waits between
-- renewals, three times over at most) have passed since, for holders that started after that renewal; else after
-- its lease, as before.
local function await_survivors(meta, argv, first, now)
  local names = {}
  for i = first, #argv do names[#names + 1] = argv[i] end
  local floor = now + 2 * renewal_interval(lease_of(meta))
  redis.call('HSET', meta, 'awaiting', table.concat(names, '\n'), 'recover_floor', string.format('%.0f', floor))
end

-- An owner reported after a data loss (a setup holding nothing, a renewal of all it holds, or a release of all): no
-- longer awaited.
local function survivor_reported(meta, owner)
  local awaiting = redis.call('HGET', meta, 'awaiting')
  if not awaiting or awaiting == '' then return end
  local left = {}
  for name in string.gmatch(awaiting, '[^\n]+') do
    if name ~= owner then left[#left + 1] = name end
  end
  redis.call('HSET', meta, 'awaiting', table.concat(left, '\n'))
end

-- Delete the entries a lowered limit skipped (never to be delivered); the
-- entries at or below 'skip_until' that are still pending are held grants.
local function delete_skipped(slots, meta)
  local skip = redis.call('HGET', meta, 'skip_until')
  if not skip then return end
  for _, entry in ipairs(redis.call('XRANGE', slots, '-', id_of(tonumber(skip)))) do
    if not pending_of(slots, entry[1]) then redis.call('XDEL', slots, entry[1]) end
  end
  if stream_state(slots) >= tonumber(skip) then redis.call('HDEL', meta, 'skip_until') end
end

-- End a recovery window early (see await_survivors): every survivor named has reported and the floor passed; the
-- slots still reserved are freed (handed to waiters at once). Returns how many.
local function end_recovery(slots, meta, now)
  local state = redis.call('HMGET', meta, 'awaiting', 'recover_floor')
  if not state[1] or state[1] ~= '' or now < tonumber(state[2]) then return 0 end
  redis.call('HDEL', meta, 'awaiting', 'recover_floor')
  local freed = free_consumer(slots, LIMBO)
  redis.call('XGROUP', 'DELCONSUMER', slots, GROUP, LIMBO)
  return freed
end

-- Free leases that expired (holders that died or stalled), following the
-- XAUTOCLAIM cursor through the whole pending list. Runs at most once per
-- `interval` ms across all processes (meta 'reap_at'); returns how many were freed.
local function reap(slots, meta, lease, interval, now)
  local due = tonumber(redis.call('HGET', meta, 'reap_at') or '0')
  if now < due then return 0 end
  redis.call('HSET', meta, 'reap_at', now + interval)
  local freed, cursor = end_recovery(slots, meta, now), '0-0'
  repeat
    local claimed = redis.call('XAUTOCLAIM', slots, GROUP, REAPER, lease, cursor, 'COUNT', 100, 'JUSTID')
    cursor = claimed[1]
    for _, id in ipairs(claimed[2]) do freed = freed + free_grant(slots, id) end
  until cursor == '0-0'
  redis.call('XGROUP', 'DELCONSUMER', slots, GROUP, REAPER)
  delete_skipped(slots, meta)
  return freed
end

-- Free the grants that Redis handed to a blocked wait ('<owner>#<n>', delivered once) and that their owner has not
-- confirmed within one renewal interval of the lease in force: a live owner confirms at once (hold_again, one round
-- trip after the reply); a process whose connections went silent (a partition, a VM pause) cannot, and without this
-- its waits would keep every slot freed meanwhile for a whole lease. Grants taken by take.lua are marked confirmed
-- (delivery count 2), grants renewed sit under the owner's own consumer: neither is touched. Returns how many were
-- freed.
local function reclaim_unconfirmed(slots, lease)
  local freed, start = 0, '-'
  local window = renewal_interval(lease)
  while true do
    local batch = redis.call('XPENDING', slots, GROUP, 'IDLE', window, start, '+', 100)
    for _, p in ipairs(batch) do
      if tonumber(p[4]) == 1 and owner_of(p[2]) ~= p[2] then freed = freed + free_grant(slots, p[1]) end
    end
    if #batch < 100 then return freed end
    start = '(' .. batch[#batch][1]
  end
end

-- Forget consumers with nothing held that have been idle for 3 leases, and owners
-- not seen for 3 leases; recompute the lease from the owners left. Runs at most once per lease across all processes (meta 'gc_at').
local function collect_garbage(slots, meta, owners, ttls, seen, lease, now)
  local due = tonumber(redis.call('HGET', meta, 'gc_at') or '0')
  if now < due then return end
  redis.call('HSET', meta, 'gc_at', now + lease)
  for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', slots, GROUP)) do
    if tonumber(info_field(c, 'pending')) == 0 and tonumber(info_field(c, 'idle')) > 3 * lease then
      redis.call('XGROUP', 'DELCONSUMER', slots, GROUP, info_field(c, 'name'))
    end
  end
  for _, owner in ipairs(redis.call('ZRANGEBYSCORE', seen, '-inf', now - 3 * lease)) do
    redis.call('ZREM', seen, owner)
    redis.call('HDEL', owners, owner)
    redis.call('HDEL', ttls, owner)
  end
  -- The lease shortens once the owners with the longest ttl are gone (here, once per lease: not per renewal).
  local longest = 0
  for _, v in ipairs(redis.call('HVALS', ttls)) do longest = math.max(longest, tonumber(v)) end
  if longest > 0 then redis.call('HSET', meta, 'ttl', longest) end
end

-- Free every grant of one owner (all its consumers) and forget it; with a consumer name '<owner>#<n>',
-- that consumer only. Returns the number of grants freed. The stream must exist.
local function release_owner(slots, owners, ttls, seen, target)
  local freed = 0
  for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', slots, GROUP)) do
    local name = info_field(c, 'name')
    if name == target or (owner_of(name) == target and name ~= owner_of(name)) then
      freed = freed + free_consumer(slots, name)
      redis.call('XGROUP', 'DELCONSUMER', slots, GROUP, name)
    end
  end
  if owner_of(target) == target then
    redis.call('HDEL', owners, target)
    redis.call('HDEL', ttls, target)
    redis.call('ZREM', seen, target)
  end
  return freed
end

-- XDEL the entries of an XRANGE reply, a bounded batch of ids per call (one call per entry costs twice the time).
local function delete_entries(slots, entries)
  local ids = {}
  for _, entry in ipairs(entries) do
    ids[#ids + 1] = entry[1]
    if #ids == 500 then
      redis.call('XDEL', slots, unpack(ids))
      ids = {}
    end
  end
  if #ids > 0 then redis.call('XDEL', slots, unpack(ids)) end
end

-- Change the limit of an existing lock, live. Lowering never revokes a grant: surplus free slots are skipped
-- (and deleted), and the slots of the next releases are not handed out again (meta 'skip_until' marks them
-- for deletion as they come). Returns the previous limit.
local function change_limit(slots, meta, new)
  new = checked_limit(new)
  local previous = valid_limit(redis.call('HGET', meta, 'limit')) or -1  -- -1: not a limit (written by hand?)
  local stream_last, group_last, held = stream_state(slots)
  -- Entries at or below the last delivered id that nobody holds can never be handed out: a lowered limit
  -- skipped them. Delete them now, before a raise moves the group's position and forgets which they were.
  -- (one XPENDING for them all: one per entry made a resize of a lock whose slots are held twice as long)
  local below = redis.call('XRANGE', slots, '-', id_of(group_last))
  if #below > 0 then
    local held_ids = {}
    for _, p in ipairs(redis.call('XPENDING', slots, GROUP, '-', id_of(group_last), #below)) do
      held_ids[p[1]] = true
    end
    local unheld = {}
    for _, entry in ipairs(below) do
      if not held_ids[entry[1]] then unheld[#unheld + 1] = entry end
    end
    delete_entries(slots, unheld)
  end
  local free = math.max(0, stream_last - group_last)
  local debt = math.max(0, group_last - stream_last)
  local delta = new - (held + free - debt)
  local target = group_last
  if delta < 0 then
    target = group_last - delta
    local skipped = redis.call('XRANGE', slots, id_of(group_last + 1), id_of(math.min(target, stream_last)))
    delete_entries(slots, skipped)
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
end

-- The light path of a lock met at run time (a request key; see lock/light.py). While nobody waits for the lock,
-- its grants are the members of one zset, 'light', scored by the end of their lease (ms, Redis's clock), and the
-- lock has no stream. The same zset is the key's record: marks that every path reads and that no transition
-- (escalation, the stream's end, a retire, an operator's reset, a restart's recovery) erases while they have effect:
--   LIMIT_MEMBER  '#limit'  scored by the limit every process obeys (an operator's, or the adaptive controller's)
--   PIN_MEMBER    '#pinned' scored 1 while the operator's limit stands (set-limit; the controller applies nothing)
--   PAUSE_MEMBER  '~pause'  scored by the end of a Retry-After pause of the key's starts (pause.lua), ms
--   STREAM_MEMBER '~stream' scored -1 while the lock's stream is in use
-- The first caller that finds every slot held sets the stream up, which escalates the lock (each live light grant
-- moves into the stream as a held grant of its owner, hash 'migrated': token -> grant id); later takers see
-- STREAM_MEMBER and queue there, first come, first served. Lifetime (keep_record): no expiry while pinned or while
-- the stream is in use; else until its last lease, pause or controller's limit ends; gone with nothing left.
local LIMIT_MEMBER = '#limit'
local PIN_MEMBER = '#pinned'
local STREAM_MEMBER = '~stream'
local PAUSE_MEMBER = '~pause'
local LEASE_FLOOR = 1000000000000  -- scores at or above are lease ends (ms since the epoch), below: the limit
-- How long a key's record keeps the adaptive controller's limit once the key has no lease nor stream (ms): the
-- controller writes it again at its next commit.
local ADAPTED_KEEP = 60000

-- The owner of a light token '<owner>/L<n>'.
local function token_owner(token)
  return string.match(token, '^(.+)/L%d+$') or token
end

-- Make a key live at least until `deadline` (ms since the epoch); a key without expiry keeps none.
local function extend_expiry(key, deadline)
  if redis.REDIS_VERSION_NUM and redis.REDIS_VERSION_NUM >= 0x070000 then
    redis.call('PEXPIREAT', key, deadline, 'GT')  -- Redis 7+
    return
  end
  local left = tonumber(redis.call('PTTL', key))
  if left >= 0 and left < deadline - now_ms() then redis.call('PEXPIREAT', key, deadline) end
end

-- Give a key's record (its light zset) the lifetime its members need: none while pinned or while the stream is in
-- use, else until its last lease or pause ends (and ADAPTED_KEEP for a controller's limit); deleted when nothing in
-- it has effect any more.
local function keep_record(light, now)
  local marks = redis.call('ZMSCORE', light, PIN_MEMBER, STREAM_MEMBER, LIMIT_MEMBER, PAUSE_MEMBER)
  if marks[1] or marks[2] then
    redis.call('PERSIST', light)
    return
  end
  local pause = tonumber(marks[4] or '0')
  if marks[4] and pause <= now then redis.call('ZREM', light, PAUSE_MEMBER) end
  local deadline = 0
  local top = redis.call('ZREVRANGEBYSCORE', light, '+inf', '(' .. now, 'WITHSCORES', 'LIMIT', 0, 1)
  if #top > 0 then deadline = tonumber(top[2]) end
  if marks[3] then deadline = math.max(deadline, now + ADAPTED_KEEP) end
  if deadline <= now then
    redis.call('DEL', light)
  else
    redis.call('PEXPIREAT', light, deadline)
  end
end

-- Move the live light grants into the lock's stream (which must exist), each held by its owner's consumer with
-- the rest of its lease, and mark the stream in use; the limit stays what it was, the record's marks stay. Idempotent.
local function escalate(light, migrated, slots, meta)
  if redis.call('ZSCORE', light, STREAM_MEMBER) then return end
  local now = now_ms()
  local lease = lease_of(meta)
  local pause = redis.call('ZSCORE', light, PAUSE_MEMBER)
  local live = redis.call('ZRANGEBYSCORE', light, '(' .. now, '+inf', 'WITHSCORES')
  redis.call('ZREMRANGEBYSCORE', light, LEASE_FLOOR, '+inf')
  if pause then redis.call('ZADD', light, pause, PAUSE_MEMBER) end
  local limit = tonumber(redis.call('HGET', meta, 'limit'))
  for i = 1, #live, 2 do
    local token, owner = live[i], token_owner(live[i])
    if token ~= PAUSE_MEMBER then
      add_slot(slots)
      local reply = redis.call('XREADGROUP', 'GROUP', GROUP, owner, 'COUNT', 1, 'STREAMS', slots, '>')
      local id = reply[1][2][1][1]
      local idle = math.max(0, lease - (tonumber(live[i + 1]) - now))
      redis.call('XCLAIM', slots, GROUP, owner, 0, id, 'IDLE', idle, 'JUSTID')
      redis.call('HSET', migrated, token, id)
    end
  end
  if #live > 0 then change_limit(slots, meta, limit) end
  redis.call('ZADD', light, -1, STREAM_MEMBER)
  redis.call('PERSIST', light)
end

-- The lock's stream is over (deleted): the light grants that moved into it go, and so does STREAM_MEMBER; the
-- record's marks stay for as long as they have effect (keep_record), so that an operator's limit or a site's pause
-- holds on the light path too. Leases left in the zset have run out (a live light grant keeps a lock from being
-- retired), a pause that has not is kept.
local function end_stream(light, migrated)
  redis.call('DEL', migrated)
  local now = now_ms()
  local pause = redis.call('ZSCORE', light, PAUSE_MEMBER)
  redis.call('ZREMRANGEBYSCORE', light, LEASE_FLOOR, '+inf')
  if pause and tonumber(pause) > now then redis.call('ZADD', light, pause, PAUSE_MEMBER) end
  redis.call('ZREM', light, STREAM_MEMBER)
  keep_record(light, now)
end
