-- adapt_commit: store the next state of a lock's adaptive limit (lock/adaptive.py), computed from the window
-- adapt_report.lua handed over, if the controller is still at the version it was computed from: of several
-- processes that got the same window, exactly one commits (the others' commits change nothing). The window
-- restarts with fresh counters on Redis's clock, the lock gets the new integer limit (change_limit: lowering
-- never revokes a grant) when it is in Redis and its limit differs, and one history record is pushed to the
-- log, which is bounded and expires. A controller an operator pinned (set_limit.lua: the pin is in the lock's
-- record, a stage's meta or a key's light zset, so it outlives this hash) follows the pin and applies nothing.
-- KEYS[1] adapt hash, KEYS[2] adapt_log list, KEYS[3] the lock's slots stream, KEYS[4] the lock's meta hash,
-- KEYS[5] a key's light zset (optional: the limit is written there too, as the light path's limit, kept while the
-- controller lives; see _lib.lua)
-- ARGV[1] the version the state was computed from, ARGV[2] limit (float), ARGV[3] applied (integer limit),
-- ARGV[4] noload (s), ARGV[5] noload_error (s), ARGV[6] since_probe, ARGV[7] probe,
-- ARGV[8] the window's mean latency in ms ('' when none), ARGV[9] noload in ms, ARGV[10] overload rate,
-- ARGV[11] error rate, ARGV[12] mean slots in use ('' when none), ARGV[13] log length (0: no log),
-- ARGV[14] ms to keep the log, ARGV[15] ms to keep the hash, ARGV[16] '1' if Redis loses no acknowledged write
-- (see check_restart)
-- Returns 1 when committed, 0 when the version is stale (or the controller expired).
local adapt, log, slots, meta = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local version = redis.call('HGET', adapt, 'version')
if not version or tonumber(version) ~= tonumber(ARGV[1]) then return 0 end
local now = now_ms()
local limit, applied, probe = ARGV[2], tonumber(ARGV[3]), ARGV[7]
local light = KEYS[5]
local pinned
if light then
  local marks = redis.call('ZMSCORE', light, LIMIT_MEMBER, PIN_MEMBER)
  if marks[2] then pinned = tonumber(marks[1]) end
else
  local record = redis.call('HMGET', meta, 'pinned', 'limit')
  if record[1] then pinned = tonumber(record[2] or '') end
end
if pinned then
  pinned = math.floor(pinned)
  limit, applied, probe = pinned, pinned, '0'
end
redis.call('HSET', adapt, 'version', string.format('%.0f', tonumber(ARGV[1]) + 1), 'start', string.format('%.0f', now),
  'responses', 0, 'latency', 0, 'latency_sq', 0, 'overloads', 0, 'errors', 0, 'in_use', 0, 'observations', 0, 'hold', 0,
  'limit', limit, 'applied', applied, 'noload', ARGV[4], 'noload_error', ARGV[5], 'since_probe', ARGV[6],
  'probe', probe)
redis.call('PEXPIRE', adapt, ARGV[15])
local light = KEYS[5]
if light and not pinned then
  local fresh = redis.call('EXISTS', light) == 0
  redis.call('ZADD', light, applied, LIMIT_MEMBER)
  if fresh then redis.call('PEXPIRE', light, ARGV[15]) else extend_expiry(light, now + tonumber(ARGV[15])) end
end
if not pinned then
  local previous = tonumber(redis.call('HGET', meta, 'limit') or '')
  if previous and previous ~= applied and lock_exists(slots, meta) then
    check_restart(slots, meta, ARGV[16])  -- a restarted Redis: the lock is recreated (in limbo) before it moves
    change_limit(slots, meta, applied)
  end
end
if tonumber(ARGV[13]) > 0 then
  local function optional(value) if value == '' then return cjson.null end return tonumber(value) end
  redis.call('LPUSH', log, cjson.encode({now, applied, optional(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10]),
    tonumber(ARGV[11]), optional(ARGV[12])}))
  redis.call('LTRIM', log, 0, tonumber(ARGV[13]) - 1)
  redis.call('PEXPIRE', log, ARGV[14])
end
return 1
