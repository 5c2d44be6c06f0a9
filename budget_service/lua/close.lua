-- close.lua: change a category's cap or state, and recompute `closed` from the cap.
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] action: 'cap' (ARGV[2] = new cap, or 'none'; reopens if used < cap; ARGV[3] = the
-- time in ms and ARGV[4] who changed it, recorded in the category's event log), 'close',
-- 'exhausted' (ARGV[2] = the producer's cursor: marked only if Redis's cursor is the same,
-- else Redis lost feeds and the source is not used up after all; and only once nothing is
-- pending, no conversation waits for its next turn and the writer has written everything,
-- for a written turn may still give a conversation its next turn)
-- Returns {closed, exhausted, old cap}.
local old = redis.call('HGET', K.state, 'cap') or '0'
if ARGV[1] == 'cap' then
  redis.call('HSET', K.state, 'cap', ARGV[2])
  local used = tonumber(redis.call('HGET', K.state, 'used') or '0')
  if used >= cap_of(ARGV[2]) then
    redis.call('HSET', K.state, 'closed', '1')
  else
    redis.call('HSET', K.state, 'closed', '0', 'exhausted', '0')
  end
  redis.call('XADD', K.events, 'MAXLEN', '~', EVENTS_MAXLEN, '*', 'at', ARGV[3] or '0',
             'kind', 'cap', 'old', old, 'new', ARGV[2], 'by', ARGV[4] or '',
             'used', tostring(used))
elseif ARGV[1] == 'close' then
  redis.call('HSET', K.state, 'closed', '1')
elseif ARGV[1] == 'exhausted' then
  if tonumber(redis.call('HGET', K.state, 'cursor') or '0') == tonumber(ARGV[2])
      and redis.call('HLEN', K.pending) == 0 and redis.call('ZCARD', K.follow) == 0
      and not behind(1) then
    redis.call('HSET', K.state, 'exhausted', '1')
  end
else
  return redis.error_reply('close.lua: unknown action ' .. tostring(ARGV[1]))
end
local st = redis.call('HMGET', K.state, 'closed', 'exhausted')
return {st[1] or '0', st[2] or '0', old}
