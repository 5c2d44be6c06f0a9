-- fail.lua: end a sample as rejected or dead-lettered (terminal; never counted).
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] sample id  ARGV[2] outcome ('rejected', 'stopped': never sent; or 'dead')
-- ARGV[3] reason
-- ARGV[4] dead-letter JSON
-- Returns 1, or 0 if the sample already had a terminal state.
local s, reason = ARGV[1], ARGV[3]
if ARGV[2] == 'rejected' or ARGV[2] == 'stopped' then
  return reject(s, reason, ARGV[4]) and 1 or 0
end
if redis.call('HSETNX', K.final, s, 'd:' .. reason) == 0 then return 0 end
forget(s)
redis.call('HINCRBY', K.state, 'failed', 1)
redis.call('HINCRBY', K.reasons, reason, 1)
redis.call('XADD', K.dead, '*', 'r', ARGV[4])
return 1
