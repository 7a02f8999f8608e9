-- delay: book the next start of one key (a stage or a request key) at least `delay` after the
-- previous booking, on Redis's clock; bookings are served in the order they reach Redis (first
-- come, first served). The gate is one string holding the earliest free booking (Redis time, µs);
-- it expires once that moment has passed, so an idle key leaves nothing behind. A booking that can
-- start now, with the previous confirmed start far enough behind, is confirmed at once (see
-- start.lua): one script per start while nobody else uses the key.
-- KEYS[1] the key's gate (string), KEYS[2] the key's next free confirmed start (string, see start.lua)
-- ARGV[1] the gap to keep after this start, in µs (already randomized by the caller if asked)
-- Returns {µs to wait from now (Redis's clock) before confirming the start, the booked start (Redis time, µs since
-- the epoch), 1 if the start is confirmed now (nothing to wait for or confirm) else 0}.
local gate, started = KEYS[1], KEYS[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local start = math.max(now, tonumber(redis.call('GET', gate) or '0'))
local gap = tonumber(ARGV[1])
local next_start = start + gap
if gap > 0 then  -- a gap of 0 only looks (a start checked against a pause: pause.lua)
    redis.call('SET', gate, string.format('%.0f', next_start), 'PX', math.max(1, math.ceil((next_start - now) / 1000)))
end
if start == now then
    local free = tonumber(redis.call('GET', started) or '0')
    if free <= now then
        if gap > 0 then
            redis.call('SET', started, string.format('%.0f', now + gap), 'PX', math.max(1, math.ceil(gap / 1000)))
        end
        return {'0', string.format('%.0f', now), 1}
    end
    return {string.format('%.0f', free - now), string.format('%.0f', start), 0}
end
return {string.format('%.0f', start - now), string.format('%.0f', start), 0}
