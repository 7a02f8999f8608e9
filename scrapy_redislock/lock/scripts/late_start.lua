-- late_start: a confirmed start (start.lua, delay.lua) that was sent late moves the key's next free confirmed start
-- back by its lateness: the next start keeps the whole gap after the moment this one really went out, not after its
-- confirmation. Only ever moves the moment later.
-- KEYS[1] the key's next free confirmed start (string: Redis time, µs)
-- ARGV[1] the next free start this start asks for: its confirmed moment + its lateness + its gap (Redis time, µs)
-- Returns 1 if the moment moved, 0 if it was already later.
local started = KEYS[1]
local wanted = tonumber(ARGV[1])
local free = tonumber(redis.call('GET', started) or '0')
if wanted <= free then
    return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
if wanted <= now then
    return 0
end
redis.call('SET', started, string.format('%.0f', wanted), 'PX', math.max(1, math.ceil((wanted - now) / 1000)))
return 1
