-- maintain: one renewal tick of one owner for one lock.
-- Renews exactly the grants listed (never frees a grant because it is not
-- listed), frees the grants of the caller's abandoned waits, re-adopts limbo
-- slots after a data loss, registers the caller, frees the grants handed to
-- blocked waits that their owners did not confirm in time (reclaim_unconfirmed),
-- and (at most once per interval across all processes) frees expired leases and
-- forgets the dead.
-- KEYS[1] slots stream, KEYS[2] meta hash, KEYS[3] owners hash, KEYS[4] ttls hash, KEYS[5] seen zset
-- ARGV[1] owner name, ARGV[2] owner identity (JSON), ARGV[3] its lease ttl in ms,
-- ARGV[4] its renewal interval in ms (how often it reaps at most),
-- ARGV[5] '1' if Redis loses no acknowledged write (see check_restart),
-- ARGV[6] '1' when the grants listed are all the caller holds: only then does it report as a survivor after a data
--   loss (see await_survivors), since a grant it holds but did not list is not re-adopted yet,
-- ARGV[7] number A of abandoned waits that follow,
-- ARGV[8..7+A] consumers of the caller's waits that were cancelled or broke (whatever they were delivered
--   nobody will use: it is freed, the consumer deleted), or grant ids of the caller's that no wait will use
--   (a wait cancelled after its grant moved to the owner's consumer): each is freed,
-- ARGV[8+A..] grant ids the caller holds and wants renewed; '!<id>' for one whose lease ran out on the caller's clock
--   (a stalled holder): renewed if Redis still has it, never re-adopted after a data loss (its slot may be another's).
-- Renewed grants move to the consumer named like the owner.
-- Returns {lost ids, limit, lease ms, freed count, adopted (old, new, old, new ...), roster}: lost ids
-- are listed grants no longer held by the caller (lease expired, whether reaped yet or not
-- (then it is freed now), reset, released by an operator, or a data loss); adopted pairs map a lost grant to the limbo
-- slot it took over (meta 'adopted': the same slot for every renewal that lists it);
-- roster: the owners seen within the lease (at most ROSTER_MAX + 1), whom the caller names as the survivors should
-- Redis lose the lock (setup). The caller reports as a survivor (see await_survivors) once it has re-adopted all it
-- holds (ARGV[6]).
-- Returns error 'NOLOCK' when the lock is gone from Redis (nothing written).
local slots, meta, owners, ttls, seen = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local me = ARGV[1]
if redis.call('EXISTS', slots) == 0 then
  return redis.error_reply('NOLOCK lock is gone from Redis')
end
check_restart(slots, meta, ARGV[5])
local now = now_ms()
local lease = register(meta, owners, ttls, seen, me, ARGV[2], ARGV[3], now)
local limit = tonumber(redis.call('HGET', meta, 'limit') or '0')

local freed = 0
local abandoned = tonumber(ARGV[7])
for i = 8, 7 + abandoned do
  local what = ARGV[i]
  if string.match(what, '^%d+%-%d+$') then
    local consumer = pending_of(slots, what)
    if consumer and owner_of(consumer) == me then freed = freed + free_grant(slots, what) end
  elseif owner_of(what) == me and what ~= me then
    freed = freed + free_consumer(slots, what)
    redis.call('XGROUP', 'DELCONSUMER', slots, GROUP, what)
  end
end

local renew, lost, stale = {}, {}, {}
for i = 8 + abandoned, #ARGV do
  local id = ARGV[i]
  if string.sub(id, 1, 1) == '!' then
    id = string.sub(id, 2)
    stale[id] = true
  end
  local consumer, idle = pending_of(slots, id)
  if consumer and owner_of(consumer) == me and idle < lease then
    table.insert(renew, id)
  else
    -- expired (anybody may have reaped it already) or gone: lost either way
    if consumer and owner_of(consumer) == me then freed = freed + free_grant(slots, id) end
    table.insert(lost, id)
  end
end

-- After a data loss, holders that survived re-adopt the reserved slots, one each. Only grants from before the lock
-- was recreated (ids below 'base') survived a loss. A grant adopted already, by a renewal of the caller's that ran
-- first (a release's, while the loop's waited its turn), is renewed in the slot it took if the caller still holds
-- that (else it was given back: lost), never given a second one that another survivor's grant needs; one whose lease
-- ran out on the caller's clock gives that slot back.
local adopted = {}
if #lost > 0 then
  local base = tonumber(redis.call('HGET', meta, 'base') or '0')
  local limbo = redis.call('XPENDING', slots, GROUP, '-', '+', #lost, LIMBO)
  local slot_of, noted = nil, {}
  local still, next_slot = {}, 1
  for _, id in ipairs(lost) do
    local slot = false
    if seq_of(id) < base then
      slot_of = slot_of or adoptions(meta)
      local before = slot_of[id]
      if before then
        if pending_of(slots, before) == me then
          if stale[id] then freed = freed + free_grant(slots, before) else slot = before end
        end
      elseif limbo[next_slot] and not stale[id] then
        slot = limbo[next_slot][1]
        next_slot = next_slot + 1
        table.insert(noted, id)
        table.insert(noted, slot)
      end
    end
    if slot then
      table.insert(renew, slot)
      table.insert(adopted, id)
      table.insert(adopted, slot)
    else
      table.insert(still, id)
    end
  end
  note_adoptions(meta, noted)
  lost = still
end
for i = 1, #renew, 100 do
  local chunk = {}
  for j = i, math.min(i + 99, #renew) do table.insert(chunk, renew[j]) end
  table.insert(chunk, 'JUSTID')
  redis.call('XCLAIM', slots, GROUP, me, 0, unpack(chunk))
end

if ARGV[6] == '1' then survivor_reported(meta, me) end
freed = freed + reclaim_unconfirmed(slots, lease) + reap(slots, meta, lease, tonumber(ARGV[4]), now)
collect_garbage(slots, meta, owners, ttls, seen, lease, now)
return {lost, limit, lease, freed, adopted, roster(seen, lease, now)}
