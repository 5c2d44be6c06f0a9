-- dedup.lua: reject a sample whose prompt token ids were already fed in this category.
-- KEYS[1] state  KEYS[2] prompts (hash: prompt digest -> first sample id)  KEYS[3] final
-- KEYS[4] reasons (hash)  KEYS[5] dead (stream)
-- ARGV[1] sample id  ARGV[2] prompt digest  ARGV[3] dead-letter JSON (used if duplicate)
-- Returns 1 if the sample may be fed (first with this prompt, or fed before by itself),
-- 0 if it was recorded as rejected (duplicate_prompt).
local first = redis.call('HGET', KEYS[2], ARGV[2])
if not first then
  redis.call('HSET', KEYS[2], ARGV[2], ARGV[1])
  return 1
end
if first == ARGV[1] then return 1 end
if redis.call('HSETNX', KEYS[3], ARGV[1], 'r:duplicate_prompt') == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'rejected', 1)
redis.call('HINCRBY', KEYS[1], 'dup_prompts', 1)
redis.call('HINCRBY', KEYS[4], 'duplicate_prompt', 1)
redis.call('XADD', KEYS[5], '*', 'r', ARGV[3])
return 0
