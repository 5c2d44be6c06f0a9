-- feed.lua: record a batch read from the shuffled order and move the cursor past it, at once.
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] the cursor the batch was read from (compare-and-set)  ARGV[2] the cursor after it
-- ARGV[3] lease deadline (ms)  ARGV[4] n, the samples to feed
-- ARGV[5..]: n groups of 5 (sample id, prompt digest, Pending JSON, the dead letter to write
-- if another sample of the category has the same prompt, and its near-duplicate record to
-- append to K.near when it is fed: "" for none), then groups of 3 for the records
-- rejected while reading (sample id, reason, dead-letter JSON)
-- Returns {'stale', cursor} and writes nothing when Redis's cursor is not ARGV[1] (Redis lost
-- the last feeds, or another producer fed); else {'ok', id, ...}: the samples recorded now,
-- each pending with a lease (one already final or pending is not recorded again; one whose
-- prompt another sample has is rejected as duplicate_prompt).
local cursor = tonumber(redis.call('HGET', K.state, 'cursor') or '0')
if cursor ~= tonumber(ARGV[1]) then return {'stale', cursor} end
local out = {'ok'}
local i = 5
for _ = 1, tonumber(ARGV[4]) do
  local s, digest = ARGV[i], ARGV[i + 1]
  if unseen(s) then
    local first = redis.call('HGET', K.prompts, digest)
    if first and first ~= s then
      reject(s, 'duplicate_prompt', ARGV[i + 3])
    else
      if not first then redis.call('HSET', K.prompts, digest, s) end
      pend(s, ARGV[i + 2], ARGV[3])
      if ARGV[i + 4] ~= '' then redis.call('APPEND', K.near, ARGV[i + 4]) end
      out[#out + 1] = s
    end
  end
  i = i + 5
end
reject_each(i)
redis.call('HSET', K.state, 'cursor', ARGV[2])
return out
