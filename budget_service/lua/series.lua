-- series.lua: append one point of the run's time series (the budget service's recorder).
-- KEYS[1] the series (stream)
-- ARGV[1] the most points kept (older ones are trimmed)  ARGV[2] the point (JSON)
-- Returns the point's stream id.
return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'p', ARGV[2])
