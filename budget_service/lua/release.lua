-- release.lua: give back an in-flight sample after a transient failure, to retry later (the
-- reaper enqueues it again once the lease, set to the retry time, has passed).
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] sample id  ARGV[2] updated Pending JSON  ARGV[3] retry-at (ms)
-- Returns 1, or 0 if the sample is final or no longer pending.
local s = ARGV[1]
if redis.call('HEXISTS', K.final, s) == 1 then return 0 end
if redis.call('HEXISTS', K.pending, s) == 0 then return 0 end
drop_inflight(s)
redis.call('HSET', K.pending, s, ARGV[2])
redis.call('ZADD', K.leases, ARGV[3], s)
return 1
