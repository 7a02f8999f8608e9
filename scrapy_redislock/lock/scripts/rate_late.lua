-- rate_late: a start logged in a rate window (rate.lua) that goes out later than it was logged (its request
-- waits for another delay or window first, or reaches the downloader late) moves its entry to the moment it goes:
-- the window counts it where the site sees it. Only ever moves an entry later, and only an entry still logged.
-- KEYS[1] the key's rate log (zset: member -> start, Redis time in µs)
-- ARGV[1] the start's member, ARGV[2] its new moment (Redis time, µs), ARGV[3] T in µs
-- Returns 1 if the entry moved (the log then lives a window past it), 0 if it was gone or already later.
local log = KEYS[1]
local moment = tonumber(ARGV[2])
local logged = redis.call('ZSCORE', log, ARGV[1])
if not logged or tonumber(logged) >= moment then
    return 0
end
redis.call('ZADD', log, string.format('%.0f', moment), ARGV[1])
-- the log lives a window past its newest entry (rate.lua keeps it so too)
redis.call('PEXPIREAT', log, string.format('%.0f', math.ceil((moment + tonumber(ARGV[3])) / 1000)))
return 1
