-- engine_trouble.lua: record whether one thing of the run is in trouble: an engine that does
-- not answer (KEYS[1] the engine trouble hash; its producer's engine watch is the one caller)
-- or a hidden-state stage's states folder without room (the disk trouble hash; the stage's
-- workers): trouble keeps the time it was first seen, its reason updated.
-- KEYS[1] the trouble hash (field -> {"why", "since_ms"} JSON)
-- ARGV[1] the field (url, folder), ARGV[2] why ("" clears: it works again), ARGV[3] now (ms)
-- Returns the trouble's since_ms when set; when cleared, how long it lasted in ms (-1 when
-- none was recorded).
local url, why, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
local raw = redis.call('HGET', KEYS[1], url)
local since = raw and cjson.decode(raw)['since_ms'] or nil
if why == '' then
  if not since then return -1 end
  redis.call('HDEL', KEYS[1], url)
  return now - since
end
since = since or now
redis.call('HSET', KEYS[1], url, cjson.encode({why = why, since_ms = since}))
return since
