-- queue_push: add a request to its stage's queue unless the shared dupefilter has seen it.
-- KEYS[1] dupefilter set, KEYS[2] the stage's queue (list)
-- ARGV[1] request fingerprint ('' = do not filter), ARGV[2] serialized request, ARGV[3] '1' = to the front
-- Returns 1 queued, 0 filtered as a duplicate.
if ARGV[1] ~= '' and redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
if ARGV[3] == '1' then redis.call('LPUSH', KEYS[2], ARGV[2]) else redis.call('RPUSH', KEYS[2], ARGV[2]) end
return 1
