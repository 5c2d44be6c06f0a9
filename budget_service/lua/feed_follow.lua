-- feed_follow.lua: feed the next turns of conversations that wait for them, at once.
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] lease deadline (ms)  ARGV[2] n, the turns to feed
-- ARGV[3..]: n pairs (turn sample id, Pending JSON), then groups of 3 for the turns rejected
-- while rendering (turn sample id, reason, dead-letter JSON)
-- A turn is fed (pending with a lease) or rejected only while it waits in `follow`, and it
-- leaves `follow` in the same call: a producer that dies before its enqueue leaves a pending
-- turn the reaper enqueues, and a turn is never fed twice.
-- Returns the ids fed now.
local out = {}
local i = 3
for _ = 1, tonumber(ARGV[2]) do
  local s = ARGV[i]
  if redis.call('ZSCORE', K.follow, s) then
    redis.call('ZREM', K.follow, s)
    if redis.call('HEXISTS', K.final, s) == 0 and redis.call('HEXISTS', K.pending, s) == 0 then
      redis.call('HSET', K.pending, s, ARGV[i + 1])
      redis.call('ZADD', K.leases, ARGV[1], s)
      out[#out + 1] = s
    end
  end
  i = i + 2
end
while i <= #ARGV do
  if redis.call('ZSCORE', K.follow, ARGV[i]) then
    redis.call('ZREM', K.follow, ARGV[i])
    reject(ARGV[i], ARGV[i + 1], ARGV[i + 2])
  end
  i = i + 3
end
return out
