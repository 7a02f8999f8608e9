-- queue_look: what a worker looks at when it has no stage (at its heartbeat, or woken), and before moving up from
-- an uncapped stage; reads only. Every stage queue's length (its list and its sorted set: see queue_pop.lua), and
-- the requests in flight in every worker (the scripts' counter). One script rather than a pipeline of LLEN, ZCARD
-- and GET: the same single round trip, and the client sends no other command than the scripts it already runs.
-- KEYS[1] in-flight counter, KEYS[2..1+n] stage lists, KEYS[2+n..1+2n] their sorted sets
-- ARGV[1] none (takes no arguments)
-- Returns {requests in flight, pending requests of the first stage, of the second, ...}.
local n = (#KEYS - 1) / 2
local out = {tonumber(redis.call('GET', KEYS[1]) or '0')}
for i = 2, 1 + n do
  out[#out + 1] = redis.call('LLEN', KEYS[i]) + redis.call('ZCARD', KEYS[i + n])
end
return out
