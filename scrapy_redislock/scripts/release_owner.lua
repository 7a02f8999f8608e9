-- release_owner: free every grant of one consumer and forget it
-- (spider close, or an operator freeing a worker known to be dead).
-- KEYS[1] slots stream, KEYS[2] owners hash, KEYS[3] holds hash
-- ARGV[1] consumer (owner) name; ARGV[2] '1' to keep the consumer registered
-- Returns the number of grants freed.
local slots, owners, holds = KEYS[1], KEYS[2], KEYS[3]
if redis.call('EXISTS', slots) == 0 then return 0 end
local freed = 0
for _, p in ipairs(redis.call('XPENDING', slots, GROUP, '-', '+', 100000, ARGV[1])) do
  freed = freed + free_grant(slots, holds, p[1])
end
if ARGV[2] ~= '1' then
  redis.call('XGROUP', 'DELCONSUMER', slots, GROUP, ARGV[1])
  redis.call('HDEL', owners, ARGV[1])
end
return freed
