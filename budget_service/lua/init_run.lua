-- init_run.lua: record the run's config (replacing the stored one) and its creation time.
-- KEYS[1] meta
-- ARGV[1] config JSON  ARGV[2] run name  ARGV[3] now (ms)
-- Returns 1 if the run was created now, 0 if it existed.
local created = redis.call('HSETNX', KEYS[1], 'created_ms', ARGV[3])
redis.call('HSET', KEYS[1], 'config', ARGV[1], 'run', ARGV[2])
return created
