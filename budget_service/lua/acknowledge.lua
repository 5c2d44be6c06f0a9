-- acknowledge.lua: the writer has these stream entries on disk: mark their samples written,
-- ack and delete the entries, set `used` back by what differed (a result already on disk,
-- generated again after Redis lost its commit, is not written twice; `used` keeps counting
-- what the files hold), and carry the conversations on: a written turn whose conversation
-- goes on keeps its output ids (`history`) and puts the next turn in `follow` for the
-- producer to feed; a conversation that ended drops its history. The marks are what a writer
-- checks before it appends.
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] 'results' or 'dead' (which stream)  ARGV[2] the writer's group
-- ARGV[3] correction of `used` (tokens, may be 0 or negative)  ARGV[4] n, the entry ids
-- ARGV[5 .. 4+n] entry ids  ARGV[5+n] m, the written marks, then m pairs (sample id, written
-- mark: counted tokens, or 'd'), then conversation events (`turn_events` in _lib.lua)
-- Returns how many entries were acknowledged.
local stream = ARGV[1] == 'dead' and K.dead or K.results
local n = tonumber(ARGV[4])
local i = 5 + n
local m = tonumber(ARGV[i])
i = i + 1
for _ = 1, m do
  redis.call('HSET', K.written, ARGV[i], ARGV[i + 1])
  i = i + 2
end
local bad = turn_events(i)
if bad then return bad end
local correction = tonumber(ARGV[3])
if correction ~= 0 then redis.call('HINCRBY', K.state, 'used', correction) end
if n == 0 then return 0 end
local ids = {}
for j = 5, 4 + n do ids[#ids + 1] = ARGV[j] end
local acked = redis.call('XACK', stream, ARGV[2], unpack(ids))
redis.call('XDEL', stream, unpack(ids))
return acked
