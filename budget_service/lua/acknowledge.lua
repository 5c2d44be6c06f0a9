-- acknowledge.lua: the writer has these stream entries on disk: mark their samples written,
-- ack and delete the entries, and set `used` back by what differed (a result already on
-- disk, generated again after Redis lost its commit, is not written twice; `used` keeps
-- counting what the files hold). The marks are what a writer checks before it appends.
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] 'results' or 'dead' (which stream)  ARGV[2] the writer's group
-- ARGV[3] correction of `used` (tokens, may be 0 or negative)  ARGV[4] n, the entry ids
-- ARGV[5 .. 4+n] entry ids, then pairs (sample id, written mark: counted tokens, or 'd')
-- Returns how many entries were acknowledged.
local stream = ARGV[1] == 'dead' and K.dead or K.results
local n = tonumber(ARGV[4])
for i = 5 + n, #ARGV, 2 do redis.call('HSET', K.written, ARGV[i], ARGV[i + 1]) end
local correction = tonumber(ARGV[3])
if correction ~= 0 then redis.call('HINCRBY', K.state, 'used', correction) end
if n == 0 then return 0 end
local ids = {}
for i = 5, 4 + n do ids[#ids + 1] = ARGV[i] end
local acked = redis.call('XACK', stream, ARGV[2], unpack(ids))
redis.call('XDEL', stream, unpack(ids))
return acked
