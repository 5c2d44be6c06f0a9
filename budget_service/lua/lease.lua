-- lease.lua: the reaper found an expired lease whose job still waits in its queue: the sample
-- keeps its lease until the new deadline. A sample no longer pending loses its lease entry.
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] sample id  ARGV[2] new lease deadline (ms)
-- Returns 1 if the lease was extended, 0 if it was dropped.
local s = ARGV[1]
if redis.call('HEXISTS', K.pending, s) == 1 and redis.call('HEXISTS', K.final, s) == 0 then
  redis.call('ZADD', K.leases, 'XX', ARGV[2], s)
  return 1
end
redis.call('ZREM', K.leases, s)
return 0
