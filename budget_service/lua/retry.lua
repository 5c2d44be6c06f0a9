-- retry.lua: send dead-lettered samples again (`tokencap retry`).
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] reason ('' for any), ARGV[2..] sample ids
-- A sample still dead (final 'd:<reason>') stops being final: its counts are taken back, its
-- written mark dropped (its result is written when it comes), and it waits in `follow`
-- (score -1: the producer finds it by its id) to be fed again; `retried` keeps its dead
-- letter on disk from making it final again (reconcile). A category whose source was used
-- up is not exhausted any more. Anything else is left alone, so a sample moves once.
-- Returns how many samples were moved.
local n = 0
for i = 2, #ARGV do
  local s = ARGV[i]
  local v = redis.call('HGET', K.final, s)
  if v and string.sub(v, 1, 2) == 'd:' and (ARGV[1] == '' or v == 'd:' .. ARGV[1]) then
    local reason = string.sub(v, 3)
    redis.call('HDEL', K.final, s)
    redis.call('HDEL', K.written, s)
    redis.call('HINCRBY', K.state, 'failed', -1)
    if redis.call('HINCRBY', K.reasons, reason, -1) <= 0 then
      redis.call('HDEL', K.reasons, reason)
    end
    redis.call('SADD', K.retried, s)
    redis.call('ZADD', K.follow, -1, s)
    n = n + 1
  end
end
if n > 0 then redis.call('HSET', K.state, 'exhausted', '0') end
return n
