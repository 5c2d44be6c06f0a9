-- source_size.lua: the category's source has ARGV[1] records now. The cursor is a position in
-- the seeded shuffled order of the source's records, which is another order when their number
-- changed (a hidden-state stage's rows file grew by the rows generated since): when the
-- number recorded is not ARGV[1] (or none is: a run older than the field), the cursor goes
-- back to 0 (the feed skips what is final or pending: only what was never fed is fed) and a
-- category marked exhausted is open again (a closed one stays closed).
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] the source's records
-- Returns 1 when the cursor went back or the category opened again, else 0.
local before = redis.call('HGET', K.state, 'records')
if before == ARGV[1] then return 0 end
redis.call('HSET', K.state, 'records', ARGV[1])
local st = redis.call('HMGET', K.state, 'cursor', 'exhausted')
if tonumber(st[1] or '0') == 0 and st[2] ~= '1' then return 0 end
redis.call('HSET', K.state, 'cursor', 0, 'exhausted', 0)
return 1
