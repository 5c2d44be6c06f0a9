-- set_cap.lua: change a category's cap and recompute `closed` from it: a category whose
-- `used` is below the new cap (re)opens (and is no longer exhausted), one at or above it
-- closes. The change goes to the category's event log.
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] the new cap, or 'none' (uncapped); ARGV[2] the time in ms; ARGV[3] who changed it
-- Returns {closed, exhausted, old cap}.
local old = redis.call('HGET', K.state, 'cap') or '0'
redis.call('HSET', K.state, 'cap', ARGV[1])
local used = tonumber(redis.call('HGET', K.state, 'used') or '0')
if used >= cap_of(ARGV[1]) then
  redis.call('HSET', K.state, 'closed', '1')
else
  redis.call('HSET', K.state, 'closed', '0', 'exhausted', '0')
end
redis.call('XADD', K.events, 'MAXLEN', '~', EVENTS_MAXLEN, '*', 'at', ARGV[2] or '0',
           'kind', 'cap', 'old', old, 'new', ARGV[1], 'by', ARGV[3] or '',
           'used', tostring(used))
local st = redis.call('HMGET', K.state, 'closed', 'exhausted')
return {st[1] or '0', st[2] or '0', old}
