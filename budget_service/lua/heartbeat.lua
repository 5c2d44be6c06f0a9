-- heartbeat.lua: extend an in-flight sample's lease and move its reservation.
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] sample id  ARGV[2] new estimate (tokens)  ARGV[3] lease deadline (ms)
-- ARGV[4] new variance (tokens^2)
-- Returns 1, or 0 if the sample holds no reservation (already committed or released).
local s = ARGV[1]
local old = redis.call('HGET', K.reserved, s)
if not old then return 0 end
local est = tonumber(ARGV[2])
redis.call('HSET', K.reserved, s, est)
redis.call('HINCRBY', K.state, 'reserved', est - tonumber(old))
local v = tonumber(ARGV[4]) or 0
local old_v = tonumber(redis.call('HGET', K.var, s) or '0')
if v ~= old_v then
  if v == 0 then redis.call('HDEL', K.var, s) else redis.call('HSET', K.var, s, v) end
  redis.call('HINCRBY', K.state, 'var', v - old_v)
end
redis.call('ZADD', K.leases, 'XX', ARGV[3], s)
return 1
