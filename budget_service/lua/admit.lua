-- admit.lua: decide whether a worker may send a sample to the engine, and reserve for it.
-- KEYS[1] state  KEYS[2] pending  KEYS[3] leases  KEYS[4] parked  KEYS[5] reserved  KEYS[6] final
-- KEYS[7] worst (hash: in-flight sample -> the most it can still add)
-- KEYS[8] var (hash: in-flight sample -> variance of its final length, tokens^2)
-- ARGV[1] sample id  ARGV[2] estimate (tokens to reserve)  ARGV[3] lease deadline (ms)
-- ARGV[4] now (ms)  ARGV[5] the most this sample can add (max_new_tokens [+ prompt]; 0 = no
-- hard guard)  ARGV[6] variance of the estimate (tokens^2)  ARGV[7] margin in standard
-- deviations (z)
-- Returns {'ok', payload} | {'done'} | {'closed'} | {'wait'} | {'unknown'}.
-- Rule: admit while used < cap and
--   (expected) used + reserved + estimate + z * sqrt(var + variance) < cap, or nothing is in
--              flight (so a category never stops below its cap), and
--   (hard)     used + worst < cap, worst = the sum of what in-flight samples can still add,
-- so `used` ends below cap + one sample's maximum; close once used >= cap.
local s = ARGV[1]
local function forget()
  drop_inflight(KEYS[1], s, KEYS[5], KEYS[7], KEYS[8])
  redis.call('HDEL', KEYS[2], s)
  redis.call('ZREM', KEYS[3], s)
  redis.call('ZREM', KEYS[4], s)
end
local function skip()
  forget()
  redis.call('HSET', KEYS[6], s, 's')
  redis.call('HINCRBY', KEYS[1], 'skipped', 1)
  return {'closed'}
end
if redis.call('HEXISTS', KEYS[6], s) == 1 then
  forget()
  return {'done'}
end
local payload = redis.call('HGET', KEYS[2], s)
if not payload then return {'unknown'} end
local st = redis.call('HMGET', KEYS[1], 'cap', 'used', 'reserved', 'closed', 'worst', 'var')
local cap = tonumber(st[1]) or 0
local used = tonumber(st[2]) or 0
local res = tonumber(st[3]) or 0
local worst = tonumber(st[5]) or 0
local var = tonumber(st[6]) or 0
if st[4] == '1' then return skip() end
if redis.call('HEXISTS', KEYS[5], s) == 1 then
  redis.call('ZADD', KEYS[3], ARGV[3], s)
  return {'ok', payload}
end
local est = tonumber(ARGV[2])
local max_add = tonumber(ARGV[5])
local est_var = tonumber(ARGV[6]) or 0
local margin = (tonumber(ARGV[7]) or 0) * math.sqrt(math.max(0, var + est_var))
local expected_ok = (used + res + est + margin < cap) or res == 0
local hard_ok = max_add == 0 or used + worst < cap
if used < cap and expected_ok and hard_ok then
  redis.call('HSET', KEYS[5], s, est)
  redis.call('HINCRBY', KEYS[1], 'reserved', est)
  if est_var > 0 then
    redis.call('HSET', KEYS[8], s, est_var)
    redis.call('HINCRBY', KEYS[1], 'var', est_var)
  end
  if max_add > 0 then
    redis.call('HSET', KEYS[7], s, max_add)
    redis.call('HINCRBY', KEYS[1], 'worst', max_add)
  end
  redis.call('ZADD', KEYS[3], ARGV[3], s)
  redis.call('ZREM', KEYS[4], s)
  return {'ok', payload}
end
if used >= cap then
  redis.call('HSET', KEYS[1], 'closed', '1')
  return skip()
end
redis.call('ZADD', KEYS[4], ARGV[4], s)
redis.call('ZREM', KEYS[3], s)
return {'wait'}
