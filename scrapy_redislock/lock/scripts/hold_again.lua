-- hold_again: reentrant acquire of a grant the caller already holds: checks that Redis still has it as the caller's
-- and renews it. The hold count lives in the caller's process (it follows the grant through a re-adoption after a
-- restart, which renames the grant).
-- KEYS[1] slots stream
-- ARGV[1] owner name, ARGV[2] grant id
-- Returns 1 when the grant is still held (it moves to the consumer named like the owner), 0 when it is not.
local slots = KEYS[1]
-- pcall: a lock that is gone from Redis (reset, data loss) means 'not held', not an error.
local mine = redis.pcall('XPENDING', slots, GROUP, ARGV[2], ARGV[2], 1)
if mine.err or #mine == 0 or owner_of(mine[1][2]) ~= ARGV[1] then return 0 end
redis.call('XCLAIM', slots, GROUP, ARGV[1], 0, ARGV[2], 'JUSTID')
return 1
