-- engine_info.lua: record what the run's engines serve, as the producer's preflight found it
-- (url -> EngineInfo JSON); what it no longer uses is dropped.
-- KEYS[1] engine info (hash)
-- ARGV: pairs of url, EngineInfo JSON
-- Returns how many engines are recorded.
redis.call('DEL', KEYS[1])
for i = 1, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
return #ARGV / 2
