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
-- mark: counted tokens, or 'd'), then conversation events:
--   'next', turn sample id, its output ids (JSON), the next turn's sample id, ordinal, the
--           engine that served the turn (or ''): keep the output; the next turn waits in
--           `follow` (with the engine it prefers) unless it is pending or final
--   'end', k, k history fields to drop
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
while i <= #ARGV do
  if ARGV[i] == 'next' then
    local nxt = ARGV[i + 3]
    redis.call('HSET', K.history, ARGV[i + 1], ARGV[i + 2])
    if redis.call('HEXISTS', K.final, nxt) == 0 and redis.call('HEXISTS', K.pending, nxt) == 0 then
      redis.call('ZADD', K.follow, 'NX', ARGV[i + 4], nxt)
      if ARGV[i + 5] ~= '' then redis.call('HSET', K.engine_of, nxt, ARGV[i + 5]) end
    end
    i = i + 6
  elseif ARGV[i] == 'end' then
    local k = tonumber(ARGV[i + 1])
    for j = i + 2, i + 1 + k do redis.call('HDEL', K.history, ARGV[j]) end
    i = i + 2 + k
  else
    return redis.error_reply('acknowledge.lua: unknown event ' .. tostring(ARGV[i]))
  end
end
local correction = tonumber(ARGV[3])
if correction ~= 0 then redis.call('HINCRBY', K.state, 'used', correction) end
if n == 0 then return 0 end
local ids = {}
for j = 5, 4 + n do ids[#ids + 1] = ARGV[j] end
local acked = redis.call('XACK', stream, ARGV[2], unpack(ids))
redis.call('XDEL', stream, unpack(ids))
return acked
