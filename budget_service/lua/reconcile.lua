-- reconcile.lua: rebuild done-marks and counters from records read back from the output files.
-- KEYS[1] state  KEYS[2] final  KEYS[3] hist  KEYS[4] reasons
-- ARGV: groups of 5: sample id, final value ('c:<n>', 'r:<reason>', 'd:<kind>'),
--       counted tokens, waste tokens, hist bucket ('' for non-committed)
-- Returns how many records were new to Redis.
local n = 0
for i = 1, #ARGV, 5 do
  local s, v = ARGV[i], ARGV[i + 1]
  if redis.call('HSETNX', KEYS[2], s, v) == 1 then
    n = n + 1
    local kind = string.sub(v, 1, 1)
    if kind == 'c' then
      redis.call('HINCRBY', KEYS[1], 'used', ARGV[i + 2])
      redis.call('HINCRBY', KEYS[1], 'samples', 1)
      if tonumber(ARGV[i + 3]) > 0 then redis.call('HINCRBY', KEYS[1], 'waste', ARGV[i + 3]) end
      redis.call('HINCRBY', KEYS[3], ARGV[i + 4], 1)
    else
      redis.call('HINCRBY', KEYS[1], kind == 'r' and 'rejected' or 'failed', 1)
      redis.call('HINCRBY', KEYS[4], string.sub(v, 3), 1)
      if v == 'r:duplicate_prompt' then redis.call('HINCRBY', KEYS[1], 'dup_prompts', 1) end
    end
  end
end
local st = redis.call('HMGET', KEYS[1], 'cap', 'used')
if tonumber(st[2] or '0') >= tonumber(st[1] or '0') then redis.call('HSET', KEYS[1], 'closed', '1') end
return n
