-- requeue.lua: the reaper puts a sample whose lease expired back on its queue: a worker died
-- with it, or its retry is due. The caller enqueues the job with the seq returned.
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] sample id  ARGV[2] Pending JSON (failures counted)  ARGV[3] now (ms)
-- ARGV[4] new lease deadline (ms)  ARGV[5] the seq the reaper read
-- Returns the new seq (>= 1), or -1 with nothing changed when the sample is final or no longer
-- pending, its lease was extended since it was read (its worker lives), or it was enqueued
-- again since.
local s = ARGV[1]
if redis.call('HEXISTS', K.final, s) == 1 then return -1 end
if redis.call('HEXISTS', K.pending, s) == 0 then return -1 end
local lease = tonumber(redis.call('ZSCORE', K.leases, s) or '')
if lease and lease > tonumber(ARGV[3]) then return -1 end
if seq_of(s) ~= tonumber(ARGV[5]) then return -1 end
drop_inflight(s)
redis.call('ZREM', K.parked, s)
redis.call('HSET', K.pending, s, ARGV[2])
redis.call('ZADD', K.leases, ARGV[4], s)
return redis.call('HINCRBY', K.seq, s, 1)
