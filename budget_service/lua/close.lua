-- close.lua: change a category's cap or state, and recompute `closed` from the cap.
-- KEYS[1] state
-- ARGV[1] action: 'cap' (ARGV[2] = new cap; reopens if used < cap), 'close', 'exhausted'
-- Returns {closed, exhausted, old cap}.
local old = redis.call('HGET', KEYS[1], 'cap') or '0'
if ARGV[1] == 'cap' then
  redis.call('HSET', KEYS[1], 'cap', ARGV[2])
  local used = tonumber(redis.call('HGET', KEYS[1], 'used') or '0')
  if used >= tonumber(ARGV[2]) then
    redis.call('HSET', KEYS[1], 'closed', '1')
  else
    redis.call('HSET', KEYS[1], 'closed', '0', 'exhausted', '0')
  end
elseif ARGV[1] == 'close' then
  redis.call('HSET', KEYS[1], 'closed', '1')
elseif ARGV[1] == 'exhausted' then
  redis.call('HSET', KEYS[1], 'exhausted', '1')
end
local st = redis.call('HMGET', KEYS[1], 'closed', 'exhausted')
return {st[1] or '0', st[2] or '0', old}
