-- unpark.lua: give parked samples back to their queue once admission would take them.
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] lease deadline (ms)  ARGV[2] the category's estimate (tokens)  ARGV[3] its variance
-- (tokens^2)  ARGV[4] the most a sample can add (0 = no hard guard)  ARGV[5] margin in
-- standard deviations (z)  ARGV[6] look at this many parked samples at most  ARGV[7]
-- max_unwritten (0 = no bound)
-- Closed category: its parked samples stay held (a raised cap reopens it). Else, unless the
-- writer is `behind`, oldest first, a parked sample is leased again with a new seq while
-- `fits` holds for it, and reserved for as admit reserves (the same ask: the category's
-- estimate plus the prompt tokens admit kept beside it, `extra`): its job's admit finds the
-- reservation and sends it, so what unpark releases is never parked again on the way.
-- The caller enqueues their jobs.
-- Returns {sample id, seq, prompt tokens counted, ...}.
local deadline, est0, est_var = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local max_add0, z, limit = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local st, closed = budget()
local writer_behind = behind(tonumber(ARGV[7]))
local out = {}
if closed or writer_behind then return out end
while limit > 0 do
  local s = redis.call('ZRANGE', K.parked, 0, 0)[1]
  if not s then break end
  limit = limit - 1
  if redis.call('HEXISTS', K.final, s) == 1 or redis.call('HEXISTS', K.pending, s) == 0 then
    redis.call('ZREM', K.parked, s)
    redis.call('HDEL', K.extra, s)
  else
    local extra = tonumber(redis.call('HGET', K.extra, s) or '0')
    local est, max_add = with_extra(est0, max_add0, extra)
    if not fits(st, est, est_var, max_add, z) then break end
    redis.call('ZREM', K.parked, s)
    redis.call('HDEL', K.extra, s)
    reserve(st, s, est, est_var, max_add)
    redis.call('ZADD', K.leases, deadline, s)
    out[#out + 1] = s
    out[#out + 1] = redis.call('HINCRBY', K.seq, s, 1)
    out[#out + 1] = extra
  end
end
return out
