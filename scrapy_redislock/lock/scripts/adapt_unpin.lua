-- adapt_unpin: an operator lets a lock's adaptive controller (lock/adaptive.py) move the limit again after
-- set-limit pinned it (set_limit.lua); it goes on from the pinned limit.
-- KEYS[1] meta hash (a stage's pin), KEYS[2] light zset (a key's pin: see _lib.lua)
-- ARGV none
-- Returns 1 when a pin was lifted, 0 when there was none.
local meta, light = KEYS[1], KEYS[2]
local lifted = redis.call('HDEL', meta, 'pinned') + redis.call('ZREM', light, PIN_MEMBER)
if lifted > 0 then keep_record(light, now_ms()) end
return math.min(lifted, 1)
