-- heartbeat.lua: extend an in-flight sample's lease and move its reservation.
-- KEYS[1] state  KEYS[2] reserved  KEYS[3] leases  KEYS[4] var
-- ARGV[1] sample id  ARGV[2] new estimate (tokens)  ARGV[3] lease deadline (ms)
-- ARGV[4] new variance (tokens^2)
-- Returns 1, or 0 if the sample holds no reservation (already committed or released).
local old = redis.call('HGET', KEYS[2], ARGV[1])
if not old then return 0 end
local est = tonumber(ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], est)
redis.call('HINCRBY', KEYS[1], 'reserved', est - tonumber(old))
local v = tonumber(ARGV[4]) or 0
local old_v = tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0')
if v ~= old_v then
  if v == 0 then redis.call('HDEL', KEYS[4], ARGV[1]) else redis.call('HSET', KEYS[4], ARGV[1], v) end
  redis.call('HINCRBY', KEYS[1], 'var', v - old_v)
end
redis.call('ZADD', KEYS[3], 'XX', ARGV[3], ARGV[1])
return 1
