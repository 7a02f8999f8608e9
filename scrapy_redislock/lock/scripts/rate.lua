-- rate: a start under a rate window (a scope's 'rate', REDISLOCK_SCOPES: N starts in any T seconds), exact on
-- Redis's clock. The key's log holds the starts of the last window (a sliding log, not a token bucket or GCRA: those
-- let up to 2N through in some window of T); a start is let through and logged when fewer than N logged starts lie
-- in (now - T, now], else it is told to wait until the oldest of the last N is a whole window old, and to ask again
-- then (the caller's one wait per scope and process asks; other processes may win the freed place first). The log
-- expires one window after its newest start (one moved later by rate_late.lua may lie ahead of now), so an idle
-- scope leaves nothing behind.
-- KEYS[1] the key's rate log (zset: member -> start, Redis time in µs)
-- ARGV[1] N, ARGV[2] T in µs, ARGV[3] this start's member (unique: the caller's token)
-- Returns {µs to wait before asking again (0: started now), now (Redis time, µs), places left in the window after
-- this start (0 when told to wait)}: a caller that took the last place knows the window is full without a try.
local log = KEYS[1]
local count = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('ZREMRANGEBYSCORE', log, '-inf', string.format('%.0f', now - window))
local logged = redis.call('ZCARD', log)
if logged >= count then
    local nth = redis.call('ZRANGE', log, -count, -count, 'WITHSCORES')
    local wait = tonumber(nth[2]) + window - now
    return {string.format('%.0f', math.max(1, wait)), string.format('%.0f', now), 0}
end
redis.call('ZADD', log, string.format('%.0f', now), ARGV[3])
-- a window past the newest entry: one moved later (rate_late.lua) may lie ahead of now
local newest = tonumber(redis.call('ZRANGE', log, -1, -1, 'WITHSCORES')[2])
redis.call('PEXPIREAT', log, string.format('%.0f', math.ceil((math.max(now, newest) + window) / 1000)))
return {'0', string.format('%.0f', now), count - logged - 1}
