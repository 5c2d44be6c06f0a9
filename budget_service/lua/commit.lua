-- commit.lua: count a finished sample exactly once and publish its result.
-- KEYS[1] state  KEYS[2] reserved  KEYS[3] final  KEYS[4] pending  KEYS[5] leases
-- KEYS[6] hist  KEYS[7] results (stream)  KEYS[8] worst  KEYS[9] var
-- ARGV[1] sample id  ARGV[2] counted tokens  ARGV[3] waste tokens  ARGV[4] hist bucket
-- ARGV[5] observed decode rate (tok/s per request, 0 = none)  ARGV[6] EWMA weight
-- ARGV[7] result JSON
-- Returns {'ok', used}, or {'dup', used} when the sample was final before (then it only
-- clears the sample's ledger entries).
local s = ARGV[1]
drop_inflight(KEYS[1], s, KEYS[2], KEYS[8], KEYS[9])
if redis.call('HEXISTS', KEYS[3], s) == 1 then
  redis.call('HDEL', KEYS[4], s)
  redis.call('ZREM', KEYS[5], s)
  return {'dup', tonumber(redis.call('HGET', KEYS[1], 'used') or '0')}
end
local counted = tonumber(ARGV[2])
redis.call('HSET', KEYS[3], s, 'c:' .. counted)
local used = redis.call('HINCRBY', KEYS[1], 'used', counted)
redis.call('HINCRBY', KEYS[1], 'samples', 1)
if tonumber(ARGV[3]) > 0 then redis.call('HINCRBY', KEYS[1], 'waste', ARGV[3]) end
redis.call('HINCRBY', KEYS[6], ARGV[4], 1)
local x = tonumber(ARGV[5])
if x > 0 then
  local old = tonumber(redis.call('HGET', KEYS[1], 'rate') or '')
  local a = tonumber(ARGV[6])
  if old then x = old * (1 - a) + x * a end
  redis.call('HSET', KEYS[1], 'rate', tostring(x))
end
redis.call('HDEL', KEYS[4], s)
redis.call('ZREM', KEYS[5], s)
redis.call('XADD', KEYS[7], '*', 'r', ARGV[7])
-- a state without a cap means Redis lost the run (restarted empty): never close on that
local cap = tonumber(redis.call('HGET', KEYS[1], 'cap') or '')
if cap and used >= cap then redis.call('HSET', KEYS[1], 'closed', '1') end
return {'ok', used}
