-- queue_bury: move popped entries that cannot be loaded (garbage, a pickle payload under the safe format, a
-- truncated entry) from the worker's in-flight record to the spider's dead-letter list, so that they are kept for
-- an operator instead of being dropped or retried for ever. Each dead letter is "<note>\n<stage>\n<data>": the
-- caller's note (one line of JSON: why, which worker, when), then the in-flight value as it was.
-- KEYS[1] the worker's in-flight hash, KEYS[2] the dead-letter list (newest first), KEYS[3] in-flight counter
-- ARGV[1], ARGV[2], ... in pairs: an in-flight id, its note
-- Returns how many were moved (an id no longer in the record, e.g. requeued meanwhile, is skipped).
local moved = 0
for i = 1, #ARGV, 2 do
  local value = redis.call('HGET', KEYS[1], ARGV[i])
  if value then
    redis.call('LPUSH', KEYS[2], ARGV[i + 1] .. '\n' .. value)
    redis.call('HDEL', KEYS[1], ARGV[i])
    moved = moved + 1
  end
end
if moved > 0 and redis.call('DECRBY', KEYS[3], moved) < 0 then redis.call('SET', KEYS[3], 0) end
return moved
