-- close.lua: close a category (an operator's `tokencap close`): nothing more is admitted;
-- a raised cap (set_cap.lua) reopens it.
-- KEYS: the category's keys (_lib.lua)
-- Returns {closed, exhausted, cap}.
redis.call('HSET', K.state, 'closed', '1')
local st = redis.call('HMGET', K.state, 'closed', 'exhausted', 'cap')
return {st[1] or '0', st[2] or '0', st[3] or '0'}
