-- engine_counts.lua: add a worker's per-engine request counters and latency histogram.
-- KEYS[1] engines (hash)
-- ARGV: pairs of field, increment
-- Returns how many fields were added to.
for i = 1, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
return #ARGV / 2
