-- hold_again: reentrant acquire of a grant the caller already holds (renews it too).
-- KEYS[1] slots stream, KEYS[2] holds hash
-- ARGV[1] owner name, ARGV[2] grant id
-- Returns the new hold count (>= 2), or 0 if the grant is no longer held.
-- The grant moves to the consumer named like the owner.
local slots, holds = KEYS[1], KEYS[2]
-- pcall: a lock that is gone from Redis (reset, data loss) means 'not held', not an error.
local mine = redis.pcall('XPENDING', slots, GROUP, ARGV[2], ARGV[2], 1)
if mine.err or #mine == 0 or owner_of(mine[1][2]) ~= ARGV[1] then return 0 end
redis.call('XCLAIM', slots, GROUP, ARGV[1], 0, ARGV[2], 'JUSTID')
return redis.call('HINCRBY', holds, ARGV[2], 1) + 1
