-- adapt_unpin: an operator lets a lock's adaptive controller (lock/adaptive.py) move the limit again after
-- set-limit pinned it (set_limit.lua); it goes on from the pinned limit.
-- KEYS[1] adapt hash
-- ARGV none
-- Returns 1 when a pin was lifted, 0 when there was none (or no live controller).
return redis.call('HDEL', KEYS[1], 'pinned')
