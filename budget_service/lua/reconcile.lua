-- reconcile.lua: rebuild done-marks and counters from records read back from the output files.
-- KEYS: the category's keys (_lib.lua)
-- ARGV: groups of 8: sample id, final value ('c:<n>', 'r:<reason>', 'd:<kind>'),
--       counted tokens, waste tokens, hist bucket ('' for non-committed), why the reply gate
--       kept it out of training ('' for a training row), output tokens, decode mode ('' : none)
-- A sample new to the done-marks is also forgotten by the ledger (it may have been pending
-- or in flight when Redis lost its commit): it is final on disk, it is never sent again.
-- A dead letter of a sample sent again (`retry`, in `retried`) is history, not its end.
-- Returns how many records were new to Redis.
local n = 0
for i = 1, #ARGV, 8 do
  local s, v = ARGV[i], ARGV[i + 1]
  local retried = string.sub(v, 1, 2) == 'd:' and redis.call('SISMEMBER', K.retried, s) == 1
  if not retried and redis.call('HSETNX', K.final, s, v) == 1 then
    n = n + 1
    forget(s)
    local kind = string.sub(v, 1, 1)
    if kind == 'c' then
      redis.call('HINCRBY', K.state, 'used', ARGV[i + 2])
      redis.call('HINCRBY', K.state, 'samples', 1)
      if tonumber(ARGV[i + 3]) > 0 then redis.call('HINCRBY', K.state, 'waste', ARGV[i + 3]) end
      redis.call('HINCRBY', K.hist, ARGV[i + 4], 1)
      count_reply(ARGV[i + 5], ARGV[i + 6])
      count_mode(ARGV[i + 7], tonumber(ARGV[i + 2]))
    else
      redis.call('HINCRBY', K.state, kind == 'r' and 'rejected' or 'failed', 1)
      redis.call('HINCRBY', K.reasons, string.sub(v, 3), 1)
      if v == 'r:duplicate_prompt' then redis.call('HINCRBY', K.state, 'dup_prompts', 1) end
    end
  end
end
local st = redis.call('HMGET', K.state, 'cap', 'used')
local cap = cap_of(st[1])
if cap and tonumber(st[2] or '0') >= cap then
  redis.call('HSET', K.state, 'closed', '1')
end
return n
