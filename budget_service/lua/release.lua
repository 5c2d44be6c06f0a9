-- release.lua: give back an in-flight sample after a transient failure, to retry later.
-- KEYS[1] state  KEYS[2] reserved  KEYS[3] pending  KEYS[4] final  KEYS[5] leases
-- KEYS[6] worst  KEYS[7] var
-- ARGV[1] sample id  ARGV[2] updated Pending JSON  ARGV[3] retry-at (ms)
-- Returns 1, or 0 if the sample is final or no longer pending.
local s = ARGV[1]
if redis.call('HEXISTS', KEYS[4], s) == 1 then return 0 end
if redis.call('HEXISTS', KEYS[3], s) == 0 then return 0 end
drop_inflight(KEYS[1], s, KEYS[2], KEYS[6], KEYS[7])
redis.call('HSET', KEYS[3], s, ARGV[2])
redis.call('ZADD', KEYS[5], ARGV[3], s)
return 1
