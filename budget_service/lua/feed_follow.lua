-- feed_follow.lua: feed the next turns of conversations that wait for them, at once.
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] lease deadline (ms)  ARGV[2] n, the turns to feed
-- ARGV[3..]: n pairs (turn sample id, Pending JSON), then groups of 3 for the turns rejected
-- while rendering (turn sample id, reason, dead-letter JSON)
-- A turn is fed (pending with a lease) or rejected only while it waits in `follow`, and it
-- leaves `follow` in the same call: a producer that dies before its enqueue leaves a pending
-- turn the reaper enqueues, and a turn is never fed twice.
-- Returns the ids fed now.
-- unfollow(s): take s out of `follow`; false if it did not wait there.
local function unfollow(s)
  return redis.call('ZREM', K.follow, s) == 1
end

local out = {}
local i = 3
for _ = 1, tonumber(ARGV[2]) do
  local s = ARGV[i]
  if unfollow(s) and unseen(s) then
    pend(s, ARGV[i + 1], ARGV[1])
    out[#out + 1] = s
  end
  i = i + 2
end
reject_each(i, unfollow)
return out
