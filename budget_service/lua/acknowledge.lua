-- acknowledge.lua: the writer has these stream entries on disk: ack and delete them, and set
-- `used` back by what differed (a result already on disk, generated again after Redis lost
-- its commit, is not written twice; `used` keeps counting what the files hold).
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] 'results' or 'dead' (which stream)  ARGV[2] the writer's group
-- ARGV[3] correction of `used` (tokens, may be 0 or negative)  ARGV[4..] entry ids
-- Returns how many entries were acknowledged.
local stream = ARGV[1] == 'dead' and K.dead or K.results
local ids = {}
for i = 4, #ARGV do ids[#ids + 1] = ARGV[i] end
if #ids == 0 then return 0 end
local acked = redis.call('XACK', stream, ARGV[2], unpack(ids))
redis.call('XDEL', stream, unpack(ids))
local correction = tonumber(ARGV[3])
if correction ~= 0 then redis.call('HINCRBY', K.state, 'used', correction) end
return acked
