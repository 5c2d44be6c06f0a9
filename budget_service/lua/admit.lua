-- admit.lua: may a worker send this sample to the engine now? If so, reserve for it.
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] sample id  ARGV[2] estimate (tokens to reserve)  ARGV[3] lease deadline (ms)
-- ARGV[4] now (ms)  ARGV[5] the most this sample can add (max_new_tokens [+ prompt]; 0 = no
-- hard guard)  ARGV[6] variance of the estimate (tokens^2)  ARGV[7] margin in standard
-- deviations (z)  ARGV[8] the job's seq (which enqueue of the sample the job carries)
-- ARGV[9] max_unwritten (0 = no bound): while the writer has that many of the category's
-- results still to write, nothing is admitted  ARGV[10] the prompt tokens the sample counts
-- (count = "total"; 0 otherwise): added to the estimate and to the most it can add, and kept
-- beside a sample admit parks so that unpark asks for it exactly as admit does
-- Returns {'ok', payload}; {'done'} (final already); {'closed'} (held back, parked: sent if a
-- raised cap reopens the category);
-- {'wait'} (parked until it fits, or until the writer catches up: unpark.lua); {'stale'} (the
-- job of an earlier enqueue of a sample enqueued again since); {'unknown'} (not pending).
local s = ARGV[1]
if redis.call('HEXISTS', K.final, s) == 1 then
  forget(s)
  return {'done'}
end
local payload = redis.call('HGET', K.pending, s)
if not payload then return {'unknown'} end
if seq_of(s) ~= tonumber(ARGV[8]) then return {'stale'} end
local st, closed = budget()
local extra = tonumber(ARGV[10]) or 0
local function park_with_extra()
  if extra > 0 then redis.call('HSET', K.extra, s, extra) end
end
if closed then
  hold(s, ARGV[4])
  park_with_extra()
  return {'closed'}
end
if redis.call('HEXISTS', K.reserved, s) == 1 then
  redis.call('ZADD', K.leases, ARGV[3], s)
  return {'ok', payload}
end
local est, max_add = with_extra(tonumber(ARGV[2]), tonumber(ARGV[5]), extra)
local est_var = tonumber(ARGV[6]) or 0
if not behind(tonumber(ARGV[9])) and fits(st, est, est_var, max_add, tonumber(ARGV[7]) or 0) then
  reserve(st, s, est, est_var, max_add)
  redis.call('ZADD', K.leases, ARGV[3], s)
  redis.call('ZREM', K.parked, s)
  redis.call('HDEL', K.extra, s)
  return {'ok', payload}
end
if st.used >= st.cap then
  redis.call('HSET', K.state, 'closed', '1')
  hold(s, ARGV[4])
  park_with_extra()
  return {'closed'}
end
redis.call('ZADD', K.parked, ARGV[4], s)
redis.call('ZREM', K.leases, s)
park_with_extra()
return {'wait'}
