-- start: confirm a booked start (delay.lua) at the moment it is about to be sent, against the previous
-- *confirmed* start rather than the previous booking: a process that wakes late for its booking and the next one
-- on time would otherwise start closer together than the gap. Confirmed starts of one key are at least their gap
-- apart on Redis's clock, whoever wakes when; a start that comes too soon is told how long to wait, and confirms
-- again then. The string expires once its moment has passed.
-- KEYS[1] the key's next free confirmed start (string: Redis time, µs)
-- ARGV[1] the gap to keep after this start, in µs
-- Returns {µs to wait from now (Redis's clock) before confirming again (0: confirmed now), now (Redis time, µs)}.
local started = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local free = tonumber(redis.call('GET', started) or '0')
if free > now then
    return {string.format('%.0f', free - now), string.format('%.0f', now)}
end
local gap = tonumber(ARGV[1])
if gap > 0 then
    redis.call('SET', started, string.format('%.0f', now + gap), 'PX', math.max(1, math.ceil(gap / 1000)))
end
return {'0', string.format('%.0f', now)}
