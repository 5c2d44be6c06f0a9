-- commit.lua: count a finished sample exactly once and publish its result.
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] sample id  ARGV[2] counted tokens  ARGV[3] waste tokens  ARGV[4] hist bucket
-- ARGV[5] observed decode rate (tok/s per request, 0 = none)  ARGV[6] EWMA weight
-- ARGV[7] result JSON  ARGV[8] its output ids outside the tokenizer's vocabulary (count)
-- ARGV[9] its prompt tokens  ARGV[10] its prompt tokens the engine served from cache
-- ARGV[11] its prompt tokens shared with the turn before  ARGV[12] the engine's URL
-- ARGV[13] why the reply gate kept it out of training ('' for a training row)
-- ARGV[14] its output tokens  ARGV[15] its decode mode ('' : none)
-- Returns {'ok', used}, or {'dup', used} when the sample was final before (then it only
-- clears what the ledger still kept for the sample).
local s = ARGV[1]
forget(s)
if redis.call('HEXISTS', K.final, s) == 1 then
  return {'dup', tonumber(redis.call('HGET', K.state, 'used') or '0')}
end
local counted = tonumber(ARGV[2])
redis.call('HSET', K.final, s, 'c:' .. counted)
local used = redis.call('HINCRBY', K.state, 'used', counted)
redis.call('HINCRBY', K.state, 'samples', 1)
if tonumber(ARGV[3]) > 0 then redis.call('HINCRBY', K.state, 'waste', ARGV[3]) end
count_reply(ARGV[13], ARGV[14])
count_mode(ARGV[15], counted)
redis.call('HINCRBY', K.hist, ARGV[4], 1)
if tonumber(ARGV[8]) > 0 then redis.call('HINCRBY', K.state, 'oov', 1) end
redis.call('HINCRBY', K.state, 'prompt', ARGV[9])
if tonumber(ARGV[10]) > 0 then redis.call('HINCRBY', K.state, 'cached', ARGV[10]) end
if tonumber(ARGV[11]) > 0 then redis.call('HINCRBY', K.state, 'reusable', ARGV[11]) end
local e = ARGV[12]
redis.call('HINCRBY', K.cache, e .. ' samples', 1)
redis.call('HINCRBY', K.cache, e .. ' prompt', ARGV[9])
if tonumber(ARGV[10]) > 0 then redis.call('HINCRBY', K.cache, e .. ' cached', ARGV[10]) end
if tonumber(ARGV[11]) > 0 then redis.call('HINCRBY', K.cache, e .. ' reusable', ARGV[11]) end
local x = tonumber(ARGV[5])
if x > 0 then
  local old = tonumber(redis.call('HGET', K.state, 'rate') or '')
  local a = tonumber(ARGV[6])
  if old then x = old * (1 - a) + x * a end
  redis.call('HSET', K.state, 'rate', tostring(x))
end
redis.call('XADD', K.results, '*', 'r', ARGV[7])
-- a state without a cap means Redis lost the run (restarted empty): never close on that
local cap = tonumber(redis.call('HGET', K.state, 'cap') or '')
if cap and used >= cap then redis.call('HSET', K.state, 'closed', '1') end
return {'ok', used}
