-- feed.lua: record a fed sample in the category ledger (once).
-- KEYS[1] pending (hash)  KEYS[2] leases (zset)  KEYS[3] final (hash)
-- ARGV[1] sample id  ARGV[2] Pending JSON  ARGV[3] lease deadline (ms)
-- Returns 1 if recorded, 0 if the sample is already final or pending.
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then return 0 end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return 1
