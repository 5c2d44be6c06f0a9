-- heartbeat.lua: extend an in-flight sample's lease and move its reservation.
-- KEYS[1] state  KEYS[2] reserved  KEYS[3] leases
-- ARGV[1] sample id  ARGV[2] new estimate (tokens)  ARGV[3] lease deadline (ms)
-- Returns 1, or 0 if the sample holds no reservation (already committed or released).
local old = redis.call('HGET', KEYS[2], ARGV[1])
if not old then return 0 end
local est = tonumber(ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], est)
redis.call('HINCRBY', KEYS[1], 'reserved', est - tonumber(old))
redis.call('ZADD', KEYS[3], 'XX', ARGV[3], ARGV[1])
return 1
