-- rate_late: a start logged in a rate window (rate.lua) that goes out later than it was logged (its request waits
-- for another delay or window first, or reaches the downloader late) moves its entry to the moment it goes: the
-- window counts it where the site sees it. Only ever moves an entry later; one the log dropped meanwhile (more
-- than a window late) is logged again, since the request really goes then. The log lives a window past its newest
-- entry, as rate.lua keeps it.
-- KEYS[1] the key's rate log (zset: member -> start, Redis time in µs)
-- ARGV[1] the start's member, ARGV[2] its new moment (Redis time, µs), ARGV[3] T in µs
-- Returns 1 if the entry moved (or was logged again), 0 if it was already later.
local log = KEYS[1]
local moment = tonumber(ARGV[2])
local logged = redis.call('ZSCORE', log, ARGV[1])
if logged and tonumber(logged) >= moment then
    return 0
end
redis.call('ZADD', log, string.format('%.0f', moment), ARGV[1])
local newest = tonumber(redis.call('ZRANGE', log, -1, -1, 'WITHSCORES')[2])
redis.call('PEXPIREAT', log, string.format('%.0f', math.ceil((newest + tonumber(ARGV[3])) / 1000)))
return 1
