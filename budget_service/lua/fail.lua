-- fail.lua: end a sample as rejected or dead-lettered (terminal; never counted).
-- KEYS[1] state  KEYS[2] reserved  KEYS[3] final  KEYS[4] pending  KEYS[5] leases
-- KEYS[6] parked  KEYS[7] dead (stream)  KEYS[8] reasons (hash: reason -> count)
-- KEYS[9] worst  KEYS[10] var
-- ARGV[1] sample id  ARGV[2] final value ('r:<reason>' or 'd:<kind>')
-- ARGV[3] state counter to bump ('rejected' or 'failed')  ARGV[4] dead-letter JSON
-- ARGV[5] reason
-- Returns 1, or 0 if the sample already had a terminal state.
local s = ARGV[1]
if redis.call('HEXISTS', KEYS[3], s) == 1 then return 0 end
drop_inflight(KEYS[1], s, KEYS[2], KEYS[9], KEYS[10])
redis.call('HSET', KEYS[3], s, ARGV[2])
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
redis.call('HINCRBY', KEYS[8], ARGV[5], 1)
redis.call('HDEL', KEYS[4], s)
redis.call('ZREM', KEYS[5], s)
redis.call('ZREM', KEYS[6], s)
redis.call('XADD', KEYS[7], '*', 'r', ARGV[4])
return 1
