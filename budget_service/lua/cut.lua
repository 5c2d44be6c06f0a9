-- cut.lua: report conversations held back by their category's cap: each turn not sent because
-- the category closed gets one "cut" record in the dead-letter stream (for the files; the turn
-- stays held, not final: a raised cap sends it, and its row then supersedes the record).
-- KEYS: the category's keys (_lib.lua)
-- ARGV: pairs (turn sample id, cut-record JSON)
-- A turn is reported once (`cut`), and only while the category is closed and the turn waits
-- in `follow` or parked.
-- Returns how many were reported now.
if redis.call('HGET', K.state, 'closed') ~= '1' then return 0 end
local n = 0
for i = 1, #ARGV, 2 do
  local s = ARGV[i]
  local held = redis.call('ZSCORE', K.follow, s) or redis.call('ZSCORE', K.parked, s)
  if held and redis.call('HEXISTS', K.final, s) == 0
      and redis.call('HSETNX', K.cut, s, '1') == 1 then
    redis.call('XADD', K.dead, '*', 'r', ARGV[i + 1])
    n = n + 1
  end
end
return n
