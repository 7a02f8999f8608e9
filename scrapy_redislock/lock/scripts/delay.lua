-- delay: book the next start of one key (a stage or a request key) at least `delay` after the
-- previous booking, on Redis's clock; bookings are served in the order they reach Redis (first
-- come, first served). The gate is one string holding the earliest free start (Redis time, µs);
-- it expires once that moment has passed, so an idle key leaves nothing behind.
-- KEYS[1] the key's gate (string)
-- ARGV[1] the gap to keep after this start, in µs (already randomized by the caller if asked)
-- Returns {µs to wait from now (Redis's clock) before starting (0 when the gate is open), the booked start (Redis
-- time, µs since the epoch)}.
local gate = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local start = math.max(now, tonumber(redis.call('GET', gate) or '0'))
local gap = tonumber(ARGV[1])
local next_start = start + gap
redis.call('SET', gate, string.format('%.0f', next_start), 'PX', math.max(1, math.ceil((next_start - now) / 1000)))
return {string.format('%.0f', start - now), string.format('%.0f', start)}
