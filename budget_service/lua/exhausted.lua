-- exhausted.lua: mark a category done because its source is used up: only if Redis's cursor
-- is the producer's (ARGV[1]; else Redis lost feeds and the source is not used up after
-- all), nothing is pending, no conversation waits for its next turn and the writer has
-- written everything (a written turn may still give a conversation its next turn).
-- KEYS: the category's keys (_lib.lua)
-- Returns {closed, exhausted, cap}.
if tonumber(redis.call('HGET', K.state, 'cursor') or '0') == tonumber(ARGV[1])
    and redis.call('HLEN', K.pending) == 0 and redis.call('ZCARD', K.follow) == 0
    and not behind(1) then
  redis.call('HSET', K.state, 'exhausted', '1')
end
local st = redis.call('HMGET', K.state, 'closed', 'exhausted', 'cap')
return {st[1] or '0', st[2] or '0', st[3] or '0'}
