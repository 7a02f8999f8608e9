-- adapt_report: merge one process's sample of a lock's requests into the current window of the lock's adaptive
-- limit (lock/adaptive.py), on Redis's clock, and hand the window over when it is due. Every process reports;
-- whoever reports when the window is due computes the next state and commits it (adapt_commit.lua) against the
-- version returned here: no leader, and nobody whose death stops adaptation. A missing controller (new, or
-- expired: every report keeps the hash ARGV[13] ms longer) starts at the lock's limit (a key's record's, else the
-- stream's, else the minimum), clamped to [minimum, maximum] unless an operator pinned it (the pin lives in the
-- lock's record, not in this hash), with nothing measured yet, its window starting where the sample does.
-- A sample that began before the window (it covers ARGV[8] ms up to now) is clipped to it: only the share of it
-- that falls within the window is added, as if its outcomes were spread evenly, so that a window after a limit
-- change holds what was measured under that limit only, whoever reports when.
-- An overloaded window is due early: once a quarter of its length old, with enough outcomes and more than ARGV[14]
-- of them overloads or errors (a refusal comes back at once and frees its slot for the next request, so a limit
-- one step past what the site takes drew refusals at the rate the site answered them until the window's end);
-- during a slow start (probe STARTING, 3, or START_HOLDING, 6), at once, and with two overloads or errors even
-- below ARGV[10] outcomes: only the start's last step can have drawn them, and its first refusals come before ten
-- answers do.
-- Besides the caller's observations of slots in use, every report adds one of its own: the lock's held grants
-- (its group's pending count) now, across the cluster, which no process knows.
-- KEYS[1] adapt hash, KEYS[2] the lock's slots stream, KEYS[3] the lock's meta hash, KEYS[4] a key's light zset
-- (optional: a key on its light path has no stream, its live light grants are its slots in use)
-- ARGV[1] responses, ARGV[2] their latencies summed (s), ARGV[3] their squares summed,
-- ARGV[4] overloads (429/503), ARGV[5] errors, ARGV[6] observations of slots in use summed, ARGV[7] their count,
-- ARGV[8] ms the sample covers up to now (0: unknown, added whole), ARGV[9] window ms,
-- ARGV[10] outcomes (responses + overloads + errors) a due window needs at least,
-- ARGV[11] minimum limit, ARGV[12] maximum limit, ARGV[13] ms to keep the hash after this report,
-- ARGV[14] the share of overloads and errors among a window's outcomes that makes it due early,
-- ARGV[15] the responses' slot hold times summed (s; clipped as the counters ARGV[1] to ARGV[7] are)
-- Returns 0 when the window is not due, else (all strings) {version, window start ms, now ms, responses,
-- latency sum, latency square sum, overloads, errors, in-use sum, in-use count, hold sum, limit, applied, noload,
-- noload_error, since_probe, probe, the lock's limit ('' when the lock is not in Redis)}.
local adapt, slots, meta = KEYS[1], KEYS[2], KEYS[3]
local COUNTERS = {'responses', 'latency', 'latency_sq', 'overloads', 'errors', 'in_use', 'observations', 'hold'}
local STATE = {'limit', 'applied', 'noload', 'noload_error', 'since_probe', 'probe'}
local now = now_ms()
local span = tonumber(ARGV[8])
local names = {'version', 'start'}
for _, name in ipairs(COUNTERS) do names[#names + 1] = name end
for _, name in ipairs(STATE) do names[#names + 1] = name end
local values = redis.call('HMGET', adapt, unpack(names))
local got = {}
for i, name in ipairs(names) do got[name] = values[i] end
local write = {}
if not got.version then
  local minimum, maximum = tonumber(ARGV[11]), tonumber(ARGV[12])
  local light = KEYS[4]
  local known, pinned = redis.call('HGET', meta, 'limit'), redis.call('HGET', meta, 'pinned')
  if light then
    local marks = redis.call('ZMSCORE', light, LIMIT_MEMBER, PIN_MEMBER)
    known, pinned = marks[1] or known, marks[2]
  end
  local limit = tonumber(known or minimum)
  if not (pinned and known) then limit = math.min(math.max(limit, minimum), maximum) end
  got = {version = '0', start = string.format('%.0f', now - span), limit = limit, applied = limit, noload = '0',
         noload_error = '0', since_probe = '0', probe = '0'}
  for _, name in ipairs({'version', 'start', unpack(STATE)}) do
    write[#write + 1] = name
    write[#write + 1] = got[name]
  end
end
local share = 1
if span > 0 then share = math.min(1, math.max(0, now - tonumber(got.start)) / span) end
local add = {}
for i = 1, 7 do add[i] = share * tonumber(ARGV[i]) end
add[8] = share * tonumber(ARGV[15] or '0')
-- the lock's slots in use now (no such stream: the lock is not in Redis, nothing to observe)
local groups = redis.pcall('XINFO', 'GROUPS', slots)
if KEYS[4] and (type(groups) ~= 'table' or groups.err) then
  local live = redis.call('ZCOUNT', KEYS[4], '(' .. now, '+inf')
  local pause = tonumber(redis.call('ZSCORE', KEYS[4], PAUSE_MEMBER) or '0')
  add[6] = add[6] + live - ((pause > now) and 1 or 0)
  add[7] = add[7] + 1
elseif type(groups) == 'table' and not groups.err then
  for _, g in ipairs(groups) do
    if info_field(g, 'name') == GROUP then
      add[6] = add[6] + tonumber(info_field(g, 'pending'))
      add[7] = add[7] + 1
    end
  end
end
for i, name in ipairs(COUNTERS) do
  got[name] = string.format('%.17g', tonumber(got[name] or '0') + add[i])
  write[#write + 1] = name
  write[#write + 1] = got[name]
end
redis.call('HSET', adapt, unpack(write))
redis.call('PEXPIRE', adapt, ARGV[13])
local drops = tonumber(got.overloads) + tonumber(got.errors)
local outcomes = tonumber(got.responses) + drops
local age, length = now - tonumber(got.start), tonumber(ARGV[9])
local starting = got.probe == '3' or got.probe == '6'
local overloaded = (age * 4 >= length or starting) and drops > tonumber(ARGV[14]) * outcomes
local enough = outcomes >= tonumber(ARGV[10]) or (starting and drops >= 2)
if not enough or (age < length and not overloaded) then
  return 0
end
local reply = {tostring(got.version), tostring(got.start), string.format('%.0f', now)}
for _, name in ipairs(COUNTERS) do reply[#reply + 1] = got[name] end
for _, name in ipairs(STATE) do reply[#reply + 1] = tostring(got[name]) end
reply[#reply + 1] = redis.call('HGET', meta, 'limit') or ''
return reply
