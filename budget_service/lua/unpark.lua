-- unpark.lua: give parked samples back to their queue once admission would take them.
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] lease deadline (ms)  ARGV[2] estimate (tokens)  ARGV[3] its variance (tokens^2)
-- ARGV[4] the most a sample can add (0 = no hard guard)  ARGV[5] margin in standard
-- deviations (z)  ARGV[6] look at this many parked samples at most  ARGV[7] max_unwritten
-- (0 = no bound)
-- Closed category: its parked samples stay held (a raised cap reopens it). Else, unless the
-- writer is `behind`, oldest first, a parked sample is leased again with a new seq while
-- `fits` holds, each one taken counted as if admitted with the category's estimate (each
-- worker's admit checks again with the sample's own). The caller enqueues their jobs.
-- Returns {sample id, seq, sample id, seq, ...}.
local deadline, est, est_var = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local max_add, z, limit = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local st, closed = budget()
local writer_behind = behind(tonumber(ARGV[7]))
local out = {}
if closed then return out end
while limit > 0 do
  local s = redis.call('ZRANGE', K.parked, 0, 0)[1]
  if not s then break end
  limit = limit - 1
  if redis.call('HEXISTS', K.final, s) == 1 or redis.call('HEXISTS', K.pending, s) == 0 then
    redis.call('ZREM', K.parked, s)
  elseif not writer_behind and fits(st, est, est_var, max_add, z) then
    redis.call('ZREM', K.parked, s)
    redis.call('ZADD', K.leases, deadline, s)
    out[#out + 1] = s
    out[#out + 1] = redis.call('HINCRBY', K.seq, s, 1)
    st.reserved = st.reserved + est
    st.var = st.var + est_var
    st.worst = st.worst + max_add
  else
    break
  end
end
return out
