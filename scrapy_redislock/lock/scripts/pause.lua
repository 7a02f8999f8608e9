-- pause: no start of a stage or key before a moment `wait` from now on Redis's clock (a site's Retry-After), for
-- every process: the delay gate and the next free confirmed start (delay.lua, start.lua) move to it, and a key's
-- light path (_lib.lua) is marked, so that its takes are refused until then. Only ever moves the moment later; each
-- key expires when its moment has passed (a light path that exists keeps its own expiry, at least the pause's).
-- KEYS[1] the gate (string), KEYS[2] the next free confirmed start (string), KEYS[3] a key's light zset (optional)
-- ARGV[1] µs from now
-- Returns the end of the pause (Redis time, µs since the epoch): this one, or a later one already in place.
local gate, started, light = KEYS[1], KEYS[2], KEYS[3]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local wanted = now + tonumber(ARGV[1])
local until_ = math.max(wanted, tonumber(redis.call('GET', started) or '0'), tonumber(redis.call('GET', gate) or '0'))
local ms = math.max(1, math.ceil((until_ - now) / 1000))
for _, key in ipairs({gate, started}) do
  redis.call('SET', key, string.format('%.0f', until_), 'PX', ms)
end
if light then
  local fresh = redis.call('EXISTS', light) == 0
  redis.call('ZADD', light, 'GT', math.floor(until_ / 1000), PAUSE_MEMBER)
  if fresh then
    redis.call('PEXPIREAT', light, math.floor(until_ / 1000))
  else
    extend_expiry(light, math.floor(until_ / 1000))
  end
end
return string.format('%.0f', until_)
