-- light_renew: extend the leases of light grants (see _lib.lua); a grant that moved into the stream when the lock
-- escalated is reported with its stream id, and from then on renewed as a stream grant (maintain).
-- KEYS[1] light zset, KEYS[2] migrated hash
-- ARGV[1] lease ms, ARGV[2..] the holders' tokens ('<owner>/L<n>')
-- Returns, per token, 1 (renewed), 0 (lost: its lease ran out, or an operator freed it) or the stream grant id.
local light, migrated = KEYS[1], KEYS[2]
local now = now_ms()
local deadline = now + tonumber(ARGV[1])
local out, renewed = {}, false
for i = 2, #ARGV do
  local token = ARGV[i]
  local ends = tonumber(redis.call('ZSCORE', light, token))
  if ends and ends > now then
    redis.call('ZADD', light, 'XX', deadline, token)
    renewed = true
    table.insert(out, 1)
  elseif ends then
    redis.call('ZREM', light, token)
    table.insert(out, 0)
  else
    local id = redis.call('HGET', migrated, token)
    if id then redis.call('HDEL', migrated, token) end
    table.insert(out, id or 0)
  end
end
if renewed then extend_expiry(light, deadline) end
return out
