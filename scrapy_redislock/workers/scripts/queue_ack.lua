-- queue_ack: a request has been fully handled (download, callback, the requests it yielded are queued);
-- drop it from the worker's in-flight record.
-- KEYS[1] the worker's in-flight hash
-- ARGV[1], ARGV[2], ... in-flight ids
-- Returns how many were dropped.
return redis.call('HDEL', KEYS[1], unpack(ARGV))
