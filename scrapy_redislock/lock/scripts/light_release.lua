-- light_release: give back light grants (see _lib.lua). A grant moved into the stream when the lock escalated is
-- freed there, and its slot goes to the first waiter.
-- KEYS[1] light zset, KEYS[2] migrated hash, KEYS[3] slots stream
-- ARGV[1] .. ARGV[n] the holders' tokens ('<owner>/L<n>')
-- Returns how many were still held (the others had expired, been reaped, or were released by an operator).
-- Costs 2 commands per token while the lock has no stream (EVALSHA, ZREM).
local light, migrated, slots = KEYS[1], KEYS[2], KEYS[3]
local released = 0
for _, token in ipairs(ARGV) do
  if redis.call('ZREM', light, token) == 1 then
    released = released + 1
  else
    local id = redis.call('HGET', migrated, token)
    if id then
      redis.call('HDEL', migrated, token)
      local ok, consumer = pcall(pending_of, slots, id)
      if ok and consumer and owner_of(consumer) == token_owner(token) then
        released = released + free_grant(slots, id)
      end
    end
  end
end
return released
